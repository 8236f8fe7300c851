"""The generation loop: prefill a prompt, then sample and step until a stop id or the token budget
(speculatively, K MTP drafts verified per step, when the engine was loaded with `spec="mtp"`)."""

from __future__ import annotations

import time
from collections.abc import Iterable, Iterator
from dataclasses import asdict, dataclass

from ninfer_offload.errors import NinferError
from ninfer_offload.runtime.sampling import Sampler, SamplingParams
from ninfer_offload.runtime.speculative import MtpSpeculator


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

    The session is opened at the first `next()` and closed when the loop ends (or the iterator
    is closed or garbage-collected), so an abandoned stream frees its state.
    """

    def __init__(
        self,
        engine,
        prompt_ids: Iterable[int],
        max_tokens: int,
        sampling: SamplingParams | None = None,
        stop_ids: Iterable[int] | None = None,
    ):
        self.prompt_ids = [int(i) for i in prompt_ids]
        if not self.prompt_ids:
            raise NinferError("the prompt is empty: give at least one token")
        if max_tokens < 1:
            raise NinferError(f"max_tokens must be >= 1, got {max_tokens}")
        self.engine = engine
        self.max_tokens = max_tokens
        self.sampler = Sampler(sampling or SamplingParams())
        self.stop_ids = frozenset(stop_ids or ())
        self.result: GenerationResult | None = None
        self._tokens = self._run()

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
        output: list[int] = []
        session = self.engine.session()
        speculator = MtpSpeculator(session, self.sampler, self.prompt_ids, self.engine.spec_tokens) if self.engine.spec_tokens else None
        try:
            start = time.perf_counter()
            if speculator is not None:
                token = speculator.prefill()
            else:
                token = self.sampler.sample(session.prefill(self.prompt_ids), output, self.prompt_ids)
            prefill_seconds = time.perf_counter() - start
            decode_seconds, steps, produced = 0.0, 0, 0
            following: list[int] = []  # tokens a speculative round produced that are not emitted yet
            while token not in self.stop_ids:
                output.append(token)
                yield token
                if len(output) >= self.max_tokens:
                    break
                if not following:
                    if session.length >= self.engine.max_context:
                        break
                    start = time.perf_counter()
                    if speculator is not None:
                        following = speculator.round(token, output)
                    else:
                        following = [self.sampler.sample(session.step(token), output, self.prompt_ids)]
                    decode_seconds += time.perf_counter() - start
                    steps += 1
                    produced += len(following)
                token = following.pop(0)
            stopped = token in self.stop_ids
            self.result = GenerationResult(
                token_ids=output,
                finish_reason="stop" if stopped else "length",
                stop_id=token if stopped else None,
                prompt_tokens=len(self.prompt_ids),
                prefill_seconds=prefill_seconds,
                decode_steps=steps,
                decode_tokens=produced,
                decode_seconds=decode_seconds,
                speculation=speculator.stats.to_json() if speculator is not None else None,
            )
        finally:
            session.close()


def generate(
    engine,
    prompt_ids: Iterable[int],
    max_tokens: int = 256,
    sampling: SamplingParams | None = None,
    stop_ids: Iterable[int] | None = None,
) -> Generation:
    """Generate after `prompt_ids` with `engine` (an `Engine`); iterate the returned `Generation`
    for token ids, read `.result` (finish reason, timings) when it is exhausted."""
    return Generation(engine, prompt_ids, max_tokens, sampling, stop_ids)
