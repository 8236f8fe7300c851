"""The generation loop: prefill a prompt, then sample and step until a stop id or the token budget
(speculatively, K MTP drafts verified per step, when the engine was loaded with `spec="mtp"`)."""

from __future__ import annotations

import time
from collections.abc import Iterable, Iterator
from dataclasses import asdict, dataclass

import torch

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
        on_device = speculator is None and self.sampler.params.picks_argmax
        try:
            start = time.perf_counter()
            if speculator is not None:
                token = speculator.prefill()
            else:
                logits = session.prefill(self.prompt_ids)
                token = self.sampler.sample(logits, output, self.prompt_ids)
            prefill_seconds = time.perf_counter() - start
            if on_device:
                loop = self._argmax_steps(session, logits, token, output)
            else:
                loop = self._sampled_steps(session, speculator, token, output)
            began, held = time.perf_counter(), 0.0  # held: while the caller has a token (not the loop's time)
            try:
                while True:
                    token = next(loop)
                    paused = time.perf_counter()
                    yield token
                    held += time.perf_counter() - paused
            except StopIteration as finished:
                steps, produced, last = finished.value
            decode_seconds = time.perf_counter() - began - held
            stopped = last in self.stop_ids
            self.result = GenerationResult(
                token_ids=output,
                finish_reason="stop" if stopped else "length",
                stop_id=last if stopped else None,
                prompt_tokens=len(self.prompt_ids),
                prefill_seconds=prefill_seconds,
                decode_steps=steps,
                decode_tokens=produced,
                decode_seconds=decode_seconds,
                speculation=speculator.stats.to_json() if speculator is not None else None,
            )
        finally:
            session.close()

    def _more(self, session, emitted: int) -> bool:
        """Whether another decode step may be needed once `emitted` tokens are out: the budget and the
        context leave room for its token."""
        return emitted < self.max_tokens and session.length < self.engine.max_context

    def _sampled_steps(self, session, speculator: MtpSpeculator | None, token: int, output: list[int]) -> Iterator[int]:
        """Emit `token` and the tokens of the steps after it (sampled on the host, or speculative rounds) until a
        stop id, the budget or the context limit; returns (steps, tokens they produced, the token it ended on)."""
        steps, produced = 0, 0
        following: list[int] = []  # tokens a speculative round produced that are not emitted yet
        while token not in self.stop_ids:
            output.append(token)
            yield token
            if len(output) >= self.max_tokens:
                break
            if not following:
                if session.length >= self.engine.max_context:
                    break
                if speculator is not None:
                    following = speculator.round(token, output)
                else:
                    following = [self.sampler.sample(session.step(token), output, self.prompt_ids)]
                steps += 1
                produced += len(following)
            token = following.pop(0)
        return steps, produced, token

    def _argmax_steps(self, session, logits: torch.Tensor, token: int, output: list[int]) -> Iterator[int]:
        """Greedy decode without penalties, one step ahead of the host: each step takes the previous step's
        argmax on the device (`queue_greedy_step`) and is queued before the host reads that token, so the
        device never waits for the host between steps. The same tokens as `_sampled_steps`; a stop id costs one
        step that is thrown away. Returns (steps, tokens they produced, the token it ended on)."""
        if token in self.stop_ids:
            return 0, 0, token
        output.append(token)
        queued = queue_greedy_step(self.engine, [session], logits.argmax().view(1)) if self._more(session, 1) else None
        yield token
        steps = 0
        while queued is not None:
            # the step after it, queued before the host waits for its token (useful unless that token ends the loop)
            following = queue_greedy_step(self.engine, [session], queued.device) if self._more(session, len(output) + 1) else None
            token, steps = queued.read()[0], steps + 1
            if token in self.stop_ids:
                break
            output.append(token)
            yield token
            queued = following
        return steps, steps, token


@dataclass(frozen=True)
class QueuedTokens:
    """The tokens a queued greedy step picks, one per sequence: on the device (the next step's input) and
    on their way to the host."""

    device: torch.Tensor  # [B] int64
    host: torch.Tensor  # [B] int64, pinned on CUDA
    copied: torch.cuda.Event | None  # after the copy to `host` (None on the CPU)

    def read(self) -> list[int]:
        """The token ids (waits for their step)."""
        if self.copied is not None:
            self.copied.synchronize()
        return self.host.tolist()


def queue_greedy_step(engine, sessions: list, picked: torch.Tensor) -> QueuedTokens:
    """Queue the step that adds picked[i] ([B] int64 on the engine's device) to sessions[i]
    (`Engine.step_on_device`), its argmax and those ids' copy to the host, without waiting for the device."""
    following = engine.step_on_device(sessions, picked).argmax(dim=-1)
    if following.device.type != "cuda":
        return QueuedTokens(following, following, None)
    host = torch.empty(following.shape, dtype=following.dtype, pin_memory=True)  # pinned: the copy does not block
    host.copy_(following, non_blocking=True)
    copied = torch.cuda.Event()
    copied.record()
    return QueuedTokens(following, host, copied)


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
