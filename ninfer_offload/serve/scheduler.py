"""The engine thread: admits queued requests, interleaves prefill chunks with batched decode.

One thread owns the engine. Each iteration it (1) admits waiting requests up to `max_concurrency`
active sequences, (2) frees the sessions of cancelled requests, (3) runs one prefill: the next
piece of several plainly decoding newcomers' prompts in one padded forward (`Engine.prefill_batch`,
experts in VRAM), else one chunk of one newcomer, (4) runs one batched decode step over every
sequence that is decoding. When every plainly decoding sequence is greedy without penalties, grammar
or logprobs (its next token is the argmax of its logits), the step runs one ahead of the host: it
takes the previous step's argmax on the device (`Engine.step_on_device`) and is queued before the
host reads the previous step's tokens, so the device does not wait for the host's work between steps
(handing out tokens, admitting, the HTTP side holding the interpreter); a sequence that ends on a
token read then has one step thrown away. Otherwise the step waits for the host's tokens; its greedy
rows are picked in one argmax. With an engine loaded for speculation (`spec="mtp"`), sequences
without a grammar or logprobs decode speculatively instead: one batched verify step over their
anchors and MTP drafts, each sequence keeping as many tokens as its own acceptance gives. Tokens go
back to the request's asyncio queue on its event loop.

A request counts against `max_concurrency + max_queue` from `submit` until its last event is
sent, whatever state it is in (waiting, admitted, decoding).
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import threading
import time
from collections import deque
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from ninfer_offload.runtime.engine import BATCHED_PREFILL_MIN_SEQUENCES, BATCHED_PREFILL_TOKENS
from ninfer_offload.runtime.generate import QueuedTokens, queue_greedy_step
from ninfer_offload.runtime.speculative import MtpSpeculator, draft_together
from ninfer_offload.runtime.step_inputs import upload

log = logging.getLogger("ninfer.serve")

SHUTTING_DOWN = "the server is shutting down"
# Newcomers' prompts prefilled together: one eager forward of the decode kernels over several sequences
# (`Engine.prefill_batch`) against a prefill each. H200 at e012db3 (bench/results/short_prompts_h200_e012db3.json):
# prompts of up to 32 tokens replay a captured prefill (7.9-14.4 ms with the head and the token read), a 40-128
# token one took 21-51 ms in replayed pieces, and one eager forward 48-80 ms whatever its rows, so prefilling
# together pays from about four newcomers (`engine.BATCHED_PREFILL_MIN_SEQUENCES`). Each gives its next tokens
# padded to one piece of `Engine.batched_prefill_piece` tokens (16, 32 or 64: the shapes the warm-up compiled, the
# smallest that holds the longest), so prompts of up to 64 tokens take one forward whatever their lengths (at a3c1de7
# the piece was the shortest prompt's and the rest of each prompt was prefilled alone, one after another).


class QueueFullError(Exception):
    """Every slot is taken and the waiting queue is at its limit."""


class ShuttingDownError(Exception):
    """The server is shutting down and takes no new requests."""


@dataclass(frozen=True)
class GenerationRequest:
    """What the engine thread needs for one sequence."""

    prompt_ids: list[int]
    max_tokens: int
    sampling: Any  # a SamplingParams
    stop_ids: frozenset[int] = frozenset()
    constraint: Any = None  # a frontend.grammar.GrammarConstraint (structured output), or None
    logprobs: int | None = None  # report each token's log-probability and this many alternatives (None: off)


@dataclass(frozen=True)
class TokenLogprob:
    """A sampled token's log-probability under the model (before penalties, temperature and grammar)
    and the `top` most likely tokens with theirs."""

    logprob: float
    top: list[tuple[int, float]]


@dataclass
class Finished:
    """Last event of a request: why it ended and how many tokens it produced."""

    reason: str  # "stop" | "length" | "cancelled" | "error" | "shutdown"
    completion_tokens: int
    error: str | None = None
    expert_hit_rate: float | None = None  # the engine's expert-cache hit rate so far, when experts are offloaded
    speculation: dict | None = None  # drafted/accepted counts, when the sequence decoded speculatively


@dataclass
class Timings:
    submitted: float = field(default_factory=time.perf_counter)
    started: float | None = None
    first_token: float | None = None
    finished: float | None = None


class RequestHandle:
    """The HTTP side's view of one request: an async stream of token ids, and `cancel()`."""

    def __init__(self, request_id: str, request: GenerationRequest, loop: asyncio.AbstractEventLoop) -> None:
        self.id = request_id
        self.request = request
        self.timings = Timings()
        self.finished: Finished | None = None
        self.logprobs: list[TokenLogprob] = []  # one per token handed out, when the request asks for them
        self._loop = loop
        self._events: asyncio.Queue = asyncio.Queue()
        self._cancelled = threading.Event()

    @property
    def cancelled(self) -> bool:
        return self._cancelled.is_set()

    def cancel(self) -> None:
        """Ask the engine thread to drop this request and free its state (idempotent)."""
        self._cancelled.set()

    def _push(self, event: int | Finished) -> None:
        try:
            self._loop.call_soon_threadsafe(self._events.put_nowait, event)
        except RuntimeError:  # the event loop is closed: nobody is listening any more
            self.cancel()

    async def tokens(self) -> AsyncIterator[int]:
        """Token ids as they are sampled (stop tokens excluded); `finished` is set at the end."""
        while True:
            event = await self._events.get()
            if isinstance(event, Finished):
                self.finished = event
                return
            yield event


@dataclass
class _Sequence:
    handle: RequestHandle
    session: Any
    sampler: Any
    prompt: list[int]
    unprefilled: list[int]
    output: list[int] = field(default_factory=list)
    next_token: int | None = None
    speculator: Any = None  # a runtime.speculative.MtpSpeculator when this sequence decodes speculatively
    started: bool = False  # the speculator knows the first generated token

    @property
    def prefilled(self) -> int:
        """Prompt tokens its session holds so far."""
        return len(self.prompt) - len(self.unprefilled)

    @property
    def picks_argmax(self) -> bool:
        """Whether its next token is the argmax of its logits (greedy, no penalties, grammar, logprobs or drafts)."""
        request = self.handle.request
        plain = self.speculator is None and request.constraint is None and request.logprobs is None
        return plain and self.sampler.params.picks_argmax


@dataclass(frozen=True)
class _QueuedStep:
    """A decode step queued ahead of the host: its sequences, in order, and the tokens it picks for them."""

    sequences: list[_Sequence]
    tokens: QueuedTokens


class Scheduler:
    """Runs every request through one engine; see the module docstring for the loop."""

    def __init__(
        self,
        engine: Any,
        sampler_factory: Callable[[Any], Any],
        max_concurrency: int = 4,
        max_queue: int = 64,
        prefill_chunk: int = 512,
    ) -> None:
        self.engine = engine
        self.max_concurrency = max_concurrency
        self.max_queue = max_queue
        self.prefill_chunk = prefill_chunk
        self._sampler_factory = sampler_factory
        self._waiting: deque[RequestHandle] = deque()
        self._active: list[_Sequence] = []
        self._outstanding: set[RequestHandle] = set()
        self._wake = threading.Condition()
        self._stopping = False
        self._closed = False
        self._ids = itertools.count(1)
        self._largest_batch = 0
        self._queued: _QueuedStep | None = None  # the decode step queued ahead of the host, if any
        self._thread = threading.Thread(target=self._run, name="ninfer-engine", daemon=True)

    # -- HTTP side -------------------------------------------------------------------------
    def start(self) -> None:
        self._thread.start()

    def stop(self, timeout: float = 30.0) -> None:
        """Stop the loop after the current iteration and cancel whatever is still queued or active."""
        with self._wake:
            self._stopping = True
            self._wake.notify()
        if self._thread.is_alive():
            self._thread.join(timeout)

    def submit(self, request: GenerationRequest, loop: asyncio.AbstractEventLoop, request_id: str | None = None) -> RequestHandle:
        """Queue a request; QueueFullError when `max_concurrency + max_queue` requests are already
        in, ShuttingDownError after `stop` or `abort`."""
        with self._wake:
            if self._stopping or self._closed:
                raise ShuttingDownError(SHUTTING_DOWN)
            if len(self._outstanding) >= self.max_concurrency + self.max_queue:
                raise QueueFullError(f"too many requests waiting ({self.max_queue}); retry later")
            handle = RequestHandle(request_id or f"req-{next(self._ids)}", request, loop)
            self._outstanding.add(handle)
            self._waiting.append(handle)
            self._wake.notify()
        return handle

    def abort(self) -> None:
        """End every request at once with a "shutdown" event, without waiting for the engine thread
        (which frees their sessions at its next iteration), and refuse new ones."""
        with self._wake:
            self._closed = True
            handles = list(self._outstanding)
        for handle in handles:
            handle.cancel()
            handle._push(Finished("shutdown", 0, SHUTTING_DOWN))

    def stats(self) -> dict[str, int]:
        """Active sequences (each holding an engine session), waiting requests, largest decode batch so far,
        and with offloaded experts the expert cache's counters (as of the last step boundary)."""
        with self._wake:
            stats = {"active": len(self._active), "waiting": len(self._waiting), "largest_batch": self._largest_batch}
        if self.engine.store.offloaded:
            stats["experts"] = self.engine.store.counters.to_json()
        return stats

    # -- engine thread ---------------------------------------------------------------------
    def _run(self) -> None:
        while True:
            with self._wake:
                while not self._stopping and not self._waiting and not self._active:
                    self._wake.wait()
                if self._stopping:
                    break
                admitted = self._take_admissible()
            try:
                for handle in admitted:
                    self._start(handle)
                self._drop_cancelled()
                self._prefill()
                self._decode_all()
            except Exception:  # noqa: BLE001 - a failure here must not stop the server
                log.exception("scheduler iteration failed; ending its sequences")
                for sequence in list(self._active):
                    self._finish(sequence, "error", "internal error in the scheduler")
        self._shutdown()

    def _take_admissible(self) -> list[RequestHandle]:
        admitted = []
        while self._waiting and len(self._active) + len(admitted) < self.max_concurrency:
            handle = self._waiting.popleft()
            if handle.cancelled:
                self._end(handle, Finished("cancelled", 0))
            else:
                admitted.append(handle)
        return admitted

    def _start(self, handle: RequestHandle) -> None:
        handle.timings.started = time.perf_counter()
        try:
            session = self.engine.session()
            sampler = self._sampler_factory(handle.request.sampling)
        except Exception as exc:  # noqa: BLE001 - reported to the client, the loop keeps serving
            log.exception("request %s: could not start", handle.id)
            self._end(handle, Finished("error", 0, str(exc)))
            return
        prompt = list(handle.request.prompt_ids)
        sequence = _Sequence(handle, session, sampler, prompt=prompt, unprefilled=prompt)
        request = handle.request
        if self.engine.spec_tokens and request.constraint is None and request.logprobs is None:
            sequence.speculator = MtpSpeculator(session, sampler, prompt, self.engine.spec_tokens)
        with self._wake:
            self._active.append(sequence)

    def _drop_cancelled(self) -> None:
        for sequence in [s for s in self._active if s.handle.cancelled]:
            self._finish(sequence, "cancelled")

    def _prefill(self) -> None:
        """The next piece of several plainly decoding newcomers' prompts in one forward when there are enough of them
        with BATCHED_PREFILL_TOKENS[0] or more tokens left (`BATCHED_PREFILL_MIN_SEQUENCES`; shorter prompts replay a
        captured prefill alone; each piece padded to `Engine.batched_prefill_piece` tokens, the smallest warmed-up
        size that holds the longest), else one chunk of the first newcomer's prompt."""
        waiting = [s for s in self._active if s.unprefilled]
        plain = [s for s in waiting if s.speculator is None and len(s.unprefilled) >= BATCHED_PREFILL_TOKENS[0]]
        piece = self.engine.batched_prefill_piece
        tokens = piece(max((len(s.unprefilled) for s in plain), default=0))
        room = self.engine.max_context - tokens  # a padded piece writes KV rows up to its full length
        together = [s for s in plain if s.prefilled <= room][: self.prefill_chunk // max(1, tokens)]
        if tokens and len(together) >= BATCHED_PREFILL_MIN_SEQUENCES:
            self._prefill_together(together, piece(max(len(s.unprefilled) for s in together)))
        elif waiting:
            self._prefill_one(waiting[0])

    def _prefill_together(self, sequences: list[_Sequence], tokens: int) -> None:
        """Up to `tokens` tokens of each one's prompt in one forward, each padded to `tokens`."""
        try:
            logits = self.engine.prefill_batch([s.session for s in sequences], [s.unprefilled[:tokens] for s in sequences], tokens)
        except Exception as exc:  # noqa: BLE001
            log.exception("prefill of %d requests together failed", len(sequences))
            for sequence in sequences:
                self._finish(sequence, "error", str(exc))
            return
        for sequence, row in zip(sequences, logits):
            sequence.unprefilled = sequence.unprefilled[tokens:]
            if not sequence.unprefilled:
                self._accept(sequence, row)

    def _prefill_one(self, sequence: _Sequence) -> None:
        chunk, sequence.unprefilled = sequence.unprefilled[: self.prefill_chunk], sequence.unprefilled[self.prefill_chunk :]
        try:
            if sequence.speculator is not None:
                logits = sequence.speculator.feed_prompt(chunk)
            else:
                logits = sequence.session.prefill(chunk)
        except Exception as exc:  # noqa: BLE001
            log.exception("request %s: prefill failed", sequence.handle.id)
            self._finish(sequence, "error", str(exc))
            return
        if not sequence.unprefilled:
            self._accept(sequence, logits)

    def _decode_all(self) -> None:
        queued, self._queued = self._queued, None
        decoding = [s for s in self._active if s.next_token is not None]
        batch = decoding + (queued.sequences if queued is not None else [])
        if not batch:
            return
        speculating = [s for s in decoding if s.speculator is not None]
        plain = [s for s in decoding if s.speculator is None]
        try:
            if speculating:
                self._speculate(speculating)
            if all(s.picks_argmax for s in plain):
                self._decode_ahead(plain, queued)
            else:
                if queued is not None:
                    self._hand_out(queued)
                self._decode_now([s for s in self._active if s.speculator is None and s.next_token is not None])
        except Exception as exc:  # noqa: BLE001
            log.exception("decode step failed for %d sequences", len(batch))
            self._queued = None
            for sequence in batch:
                if sequence in self._active:
                    self._finish(sequence, "error", str(exc))

    def _decode_ahead(self, ready: list[_Sequence], queued: _QueuedStep | None) -> None:
        """Queue the next greedy step (the sequences of `queued` that go on, on the tokens it picks, and `ready`,
        on their host tokens), then hand out the tokens `queued` picked."""
        carried = [i for i, s in enumerate(queued.sequences) if self._goes_on(s)] if queued is not None else []
        sequences = [queued.sequences[i] for i in carried] + ready
        if sequences:
            device = self.engine.device
            parts = [upload(torch.tensor([s.next_token for s in ready]), device)] if ready else []
            if carried:
                picked = queued.tokens.device
                parts.insert(0, picked if len(carried) == picked.numel() else picked[upload(torch.tensor(carried), device)])
            self._largest_batch = max(self._largest_batch, len(sequences))
            self._queued = _QueuedStep(sequences, queue_greedy_step(self.engine, [s.session for s in sequences], torch.cat(parts)))
        if queued is not None:
            self._hand_out(queued)
        if self._queued is not None:
            for sequence in self._queued.sequences:
                sequence.next_token = None  # already fed to the queued step

    def _goes_on(self, sequence: _Sequence) -> bool:
        """Whether a sequence of the queued step needs a step after it (unless the token it picked ends it)."""
        return sequence in self._active and len(sequence.output) + 1 < sequence.handle.request.max_tokens

    def _hand_out(self, queued: _QueuedStep) -> None:
        """Hand out the tokens a queued step picked (waits for it), to the sequences still running."""
        for sequence, token in zip(queued.sequences, queued.tokens.read()):
            if sequence in self._active:
                self._emit(sequence, token)

    def _decode_now(self, plain: list[_Sequence]) -> None:
        """One decode step over `plain` on their host tokens; the argmax-picking rows in one argmax, the others sampled."""
        if not plain:
            return
        self._largest_batch = max(self._largest_batch, len(plain))
        logits = self.engine.step_batch([s.session for s in plain], [s.next_token for s in plain])
        rows = [i for i, s in enumerate(plain) if s.picks_argmax]
        picked = dict(zip(rows, logits[rows].argmax(dim=-1).tolist())) if rows else {}
        for i, (sequence, row) in enumerate(zip(plain, logits)):
            if i in picked:
                self._emit(sequence, picked[i])
            else:
                self._accept(sequence, row)

    def _speculate(self, batch: list[_Sequence]) -> None:
        """One speculative round over `batch`: each sequence drafts with its MTP speculator, one target
        step verifies every sequence's anchor and drafts, each keeps what its own rule accepts."""
        for sequence in batch:
            if not sequence.started:
                sequence.speculator.start(sequence.next_token)
                sequence.started = True
        k = max(0, min(s.speculator.room() for s in batch))
        drafted = draft_together([s.speculator for s in batch], k, [s.output for s in batch])
        tokens = [[s.next_token] + drafts for s, (drafts, _) in zip(batch, drafted)]
        logits, hidden = self.engine.step([s.session for s in batch], tokens, with_hidden=True)
        for i, (sequence, (drafts, probs)) in enumerate(zip(batch, drafted)):
            rows = hidden[i * (k + 1) : (i + 1) * (k + 1)]
            for token in sequence.speculator.settle(logits[i], rows, drafts, probs, sequence.output):
                if not self._emit(sequence, token):
                    break

    def _accept(self, sequence: _Sequence, logits: Any) -> None:
        """Sample the next token from `logits`, hand it out, and decide whether the sequence ends."""
        request = sequence.handle.request
        constraint = request.constraint
        try:
            if request.logprobs is not None:
                logprobs = torch.log_softmax(logits.float(), dim=-1)
            if constraint is not None:
                logits = logits.clone()
                constraint.mask(logits)
            token = int(sequence.sampler.sample(logits, sequence.output, sequence.prompt))
            if constraint is not None and token not in request.stop_ids:
                constraint.accept(token)
            if request.logprobs is not None and token not in request.stop_ids:
                top = torch.topk(logprobs, request.logprobs) if request.logprobs else None
                alternatives = list(zip(top.indices.tolist(), top.values.tolist())) if top is not None else []
                sequence.handle.logprobs.append(TokenLogprob(float(logprobs[token]), alternatives))
        except Exception as exc:  # noqa: BLE001
            log.exception("request %s: sampling failed", sequence.handle.id)
            self._finish(sequence, "error", str(exc))
            return
        self._emit(sequence, token)

    def _emit(self, sequence: _Sequence, token: int) -> bool:
        """Hand out a generated token; False when the sequence ends with it."""
        request = sequence.handle.request
        sequence.output.append(token)
        handle = sequence.handle
        if handle.timings.first_token is None:
            handle.timings.first_token = time.perf_counter()
        sequence.next_token = None
        if token in request.stop_ids:
            self._finish(sequence, "stop")
            return False
        handle._push(token)
        if len(sequence.output) >= request.max_tokens:
            self._finish(sequence, "length")
            return False
        sequence.next_token = token
        return True

    def _finish(self, sequence: _Sequence, reason: str, error: str | None = None) -> None:
        with self._wake:
            if sequence in self._active:
                self._active.remove(sequence)
        try:
            sequence.session.close()
        finally:
            sequence.handle.timings.finished = time.perf_counter()
            store = self.engine.store
            hit_rate = store.counters.hit_rate if store.offloaded else None
            speculation = sequence.speculator.stats.to_json() if sequence.speculator is not None else None
            self._end(sequence.handle, Finished(reason, len(sequence.output), error, hit_rate, speculation))

    def _end(self, handle: RequestHandle, finished: Finished) -> None:
        """Send a request's last event; it no longer counts against the limit."""
        with self._wake:
            self._outstanding.discard(handle)
        handle._push(finished)

    def _shutdown(self) -> None:
        for sequence in list(self._active):
            self._finish(sequence, "shutdown", SHUTTING_DOWN)
        with self._wake:
            self._waiting.clear()
            left = list(self._outstanding)
        for handle in left:
            self._end(handle, Finished("shutdown", 0, SHUTTING_DOWN))
