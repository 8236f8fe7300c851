"""The engine thread: queues requests, admits them into the decode loop, hands their tokens to the HTTP side.

One thread owns the engine and its `runtime.decoder.Decoder`. Each iteration it (1) admits waiting
requests up to `max_concurrency` active sequences, (2) ends the sequences of cancelled requests,
(3) runs one `Decoder.step()` (one prefill piece, one batched decode step: see `runtime.decoder`),
(4) sends the tokens and ends it gave back to each request's asyncio queue on its event loop.

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
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

from ninfer_offload.runtime.decoder import Decoder, End, GenerationRequest, Token, TokenLogprob

log = logging.getLogger("ninfer.serve")

SHUTTING_DOWN = "the server is shutting down"


class QueueFullError(Exception):
    """Every slot is taken and the waiting queue is at its limit."""


class ShuttingDownError(Exception):
    """The server is shutting down and takes no new requests."""


@dataclass
class Finished:
    """Last event of a request: why it ended and how many tokens it produced."""

    reason: str  # "stop" | "length" | "cancelled" | "error" | "shutdown"
    completion_tokens: int
    error: str | None = None
    expert_hit_rate: float | None = None  # the engine's expert-cache hit rate so far, when experts are offloaded
    speculation: dict | None = None  # drafted/accepted counts, when the sequence decoded speculatively
    cached_tokens: int = 0  # prompt tokens resumed from the prompt cache


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


class Scheduler:
    """Runs every request through one engine's decode loop; see the module docstring."""

    def __init__(self, engine: Any, max_concurrency: int = 4, max_queue: int = 64, prefill_chunk: int | None = None) -> None:
        self.engine = engine
        self.max_concurrency = max_concurrency
        self.max_queue = max_queue
        self.decoder = Decoder(engine, prefill_chunk)
        self._waiting: deque[RequestHandle] = deque()
        self._outstanding: set[RequestHandle] = set()
        self._wake = threading.Condition()
        self._stopping = False
        self._closed = False
        self._ids = itertools.count(1)
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
        with offloaded experts the expert cache's counters (as of the last step boundary), and with a prompt
        cache its counters and memory."""
        with self._wake:
            stats = {"active": len(self.decoder.sequences), "waiting": len(self._waiting), "largest_batch": self.decoder.largest_batch}
        if self.engine.store.offloaded:
            stats["experts"] = self.engine.store.counters.to_json()
        if self.engine.prompt_cache is not None:
            stats["prompt_cache"] = self.engine.prompt_cache.stats()
        return stats

    # -- engine thread ---------------------------------------------------------------------
    def _run(self) -> None:
        while True:
            with self._wake:
                while not self._stopping and not self._waiting and not self.decoder.sequences:
                    self._wake.wait()
                if self._stopping:
                    break
                admitted = self._take_admissible()
            try:
                for handle in admitted:
                    self._start(handle)
                for sequence in [s for s in self.decoder.sequences if s.owner.cancelled]:
                    self._end(self.decoder.end(sequence, "cancelled"))
                for event in self.decoder.step():
                    self._send(event)
            except Exception:  # noqa: BLE001 - a failure here must not stop the server
                log.exception("scheduler iteration failed; ending its sequences")
                for sequence in list(self.decoder.sequences):
                    self._end(self.decoder.end(sequence, "error", "internal error in the scheduler"))
        self._shutdown()

    def _take_admissible(self) -> list[RequestHandle]:
        admitted = []
        while self._waiting and len(self.decoder.sequences) + len(admitted) < self.max_concurrency:
            handle = self._waiting.popleft()
            if handle.cancelled:
                self._close(handle, Finished("cancelled", 0))
            else:
                admitted.append(handle)
        return admitted

    def _start(self, handle: RequestHandle) -> None:
        handle.timings.started = time.perf_counter()
        try:
            self.decoder.add(handle.request, owner=handle)
        except Exception as exc:  # noqa: BLE001 - reported to the client, the loop keeps serving
            log.exception("request %s: could not start", handle.id)
            self._close(handle, Finished("error", 0, str(exc)))

    def _send(self, event: Token | End) -> None:
        """Hand a token of the decode loop to its request, or end the request."""
        if isinstance(event, End):
            self._end(event)
            return
        handle = event.sequence.owner
        if handle.timings.first_token is None:
            handle.timings.first_token = time.perf_counter()
        if event.logprob is not None:
            handle.logprobs.append(event.logprob)
        handle._push(event.token)

    def _end(self, ended: End | None) -> None:
        """Send the last event of a request whose sequence ended."""
        if ended is None:
            return
        sequence = ended.sequence
        handle = sequence.owner
        handle.timings.finished = time.perf_counter()
        if handle.timings.first_token is None and sequence.output:  # it ended on its first token (a stop id)
            handle.timings.first_token = handle.timings.finished
        store = self.engine.store
        hit_rate = store.counters.hit_rate if store.offloaded else None
        finished = Finished(ended.reason, len(sequence.output), ended.error, hit_rate, sequence.speculation, sequence.cached_tokens)
        self._close(handle, finished)

    def _close(self, handle: RequestHandle, finished: Finished) -> None:
        """Send a request's last event; it no longer counts against the limit."""
        with self._wake:
            self._outstanding.discard(handle)
        handle._push(finished)

    def _shutdown(self) -> None:
        for sequence in list(self.decoder.sequences):
            self._end(self.decoder.end(sequence, "shutdown", SHUTTING_DOWN))
        with self._wake:
            self._waiting.clear()
            left = list(self._outstanding)
        for handle in left:
            self._close(handle, Finished("shutdown", 0, SHUTTING_DOWN))
