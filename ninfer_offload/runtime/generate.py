"""One generation as an iterator of token ids: a batch of one in the decode loop (`runtime.decoder`), which
prefills the prompt, then samples and steps until a stop id, the token budget or the context limit
(speculatively, K MTP drafts verified per step, when the engine was loaded with `spec="mtp"`)."""

from __future__ import annotations

import time
from collections.abc import Iterable, Iterator
from dataclasses import asdict, dataclass
from typing import Any

from ninfer_offload.errors import NinferError
from ninfer_offload.runtime.decoder import Decoder, End, GenerationRequest, TokenLogprob
from ninfer_offload.runtime.sampling import SamplingParams


@dataclass
class GenerationResult:
    """What a finished generation produced. `token_ids` excludes the stop id (kept in `stop_id`).
    finish_reason "length" means `max_tokens` was reached or the context limit was full."""

    token_ids: list[int]
    finish_reason: str  # "stop" | "length"
    stop_id: int | None
    prompt_tokens: int
    prefill_seconds: float  # prompt forward + first token
    decode_steps: int  # forward passes after the prefill (speculative rounds)
    decode_tokens: int  # tokens those passes produced (more than one per pass when drafts are accepted)
    decode_seconds: float
    speculation: dict | None = None  # drafted/accepted counts when decoding speculatively

    @property
    def prefill_tokens_per_s(self) -> float:
        return self.prompt_tokens / self.prefill_seconds if self.prefill_seconds > 0 else 0.0

    @property
    def decode_tokens_per_s(self) -> float:
        return self.decode_tokens / self.decode_seconds if self.decode_seconds > 0 else 0.0

    def as_dict(self) -> dict:
        """JSON-ready fields plus the two rates."""
        return {
            **asdict(self),
            "prefill_tokens_per_s": self.prefill_tokens_per_s,
            "decode_tokens_per_s": self.decode_tokens_per_s,
        }


class Generation:
    """Iterate to get generated token ids as they are produced; `result` is set once it ends.

    A batch of one in the decode loop (`runtime.decoder`). The session is opened at the first `next()` and closed
    when the loop ends (or the iterator is closed or garbage-collected), so an abandoned stream frees its state.
    `logprobs` (when the request asks for them) holds one entry per token handed out.
    """

    def __init__(self, engine, request: GenerationRequest):
        self.engine = engine
        self.request = request
        self.logprobs: list[TokenLogprob] = []
        self.result: GenerationResult | None = None
        self._tokens = self._run()

    @property
    def prompt_ids(self) -> list[int]:
        return self.request.prompt_ids

    def __iter__(self) -> Iterator[int]:
        return self._tokens

    def __next__(self) -> int:
        return next(self._tokens)

    def close(self) -> None:
        """Stop early and free the sequence state."""
        self._tokens.close()

    def run(self) -> GenerationResult:
        """Consume the whole generation and return its result."""
        for _ in self._tokens:
            pass
        assert self.result is not None
        return self.result

    def _run(self) -> Iterator[int]:
        decoder = Decoder(self.engine)
        sequence = decoder.add(self.request)
        try:
            start = time.perf_counter()
            held = 0.0  # while the caller has a token (not the loop's time)
            ended: End | None = None
            while ended is None:
                for event in decoder.step():
                    if isinstance(event, End):
                        ended = event
                        continue
                    if event.logprob is not None:
                        self.logprobs.append(event.logprob)
                    paused = time.perf_counter()
                    yield event.token
                    held += time.perf_counter() - paused
            if ended.reason not in ("stop", "length"):
                raise NinferError(ended.error or f"generation ended: {ended.reason}")
            first = sequence.first_token_at or start
            stopped = ended.reason == "stop"
            self.result = GenerationResult(
                token_ids=sequence.output[:-1] if stopped else sequence.output,
                finish_reason=ended.reason,
                stop_id=sequence.output[-1] if stopped else None,
                prompt_tokens=len(self.request.prompt_ids),
                prefill_seconds=first - start,
                decode_steps=sequence.steps,
                decode_tokens=sequence.produced,
                decode_seconds=time.perf_counter() - first - held,
                speculation=sequence.speculation,
            )
        finally:
            decoder.end(sequence, "cancelled")


def generate(
    engine,
    prompt_ids: Iterable[int],
    max_tokens: int = 256,
    sampling: SamplingParams | None = None,
    stop_ids: Iterable[int] | None = None,
    constraint: Any = None,
    logprobs: int | None = None,
) -> Generation:
    """Generate after `prompt_ids` with `engine` (an `Engine`); iterate the returned `Generation`
    for token ids, read `.result` (finish reason, timings) when it is exhausted. `constraint`: a grammar
    the output follows (`frontend.grammar`); `logprobs`: record each token's log-probability and this
    many alternatives (`Generation.logprobs`)."""
    request = GenerationRequest(
        [int(i) for i in prompt_ids], max_tokens, sampling or SamplingParams(), frozenset(stop_ids or ()), constraint, logprobs
    )
    return Generation(engine, request)
