"""The decode loop: every generated token of `ninfer generate`, the Python API and the server comes from here.

A `Decoder` runs a batch of sequences on one engine. Each `step()`:
1. prefills one piece: the next piece of several plainly decoding newcomers' prompts in one padded
   forward (`Engine.prefill_batch`, experts in VRAM) when there are enough of them, else one chunk
   of the first newcomer's prompt; a prompt's last piece gives its first token;
2. decodes once over every sequence that has a token to feed:
   - speculating sequences (an engine loaded with `spec="mtp"`; requests without a grammar or
     logprobs) run one round together: MTP drafts, one verify step over every anchor and its
     drafts, each sequence keeping what its own acceptance rule gives;
   - when every other sequence picks the argmax of its logits (greedy, no penalties, grammar or
     logprobs), the step runs one ahead of the host: it takes the previous step's argmax on the
     device (`Engine.step_on_device`) and is queued before the host reads the previous step's
     tokens, so the device does not wait for the host between steps; a sequence that ends on a
     token read then has one step thrown away;
   - otherwise one step on the host's tokens; greedy rows are picked in one argmax, the others
     sampled (penalties, grammar mask, logprobs).
With the engine's prompt cache (`runtime.prefix_cache`), a newcomer first resumes the longest saved
prefix of its prompt and prefills only the rest, its prompt pieces ending at the cache's save points,
where its state is saved; a sequence that stops or reaches its length is saved too. A request may opt
out (`GenerationRequest.cache_prompt`).
A sequence ends on a stop id (not handed out), at `max_tokens`, when its context is full, on an
error of its own, or when its caller ends it. `step()` returns what happened, in order: the tokens
handed out (`Token`) and the sequences that ended (`End`).
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from typing import Any

import torch

from ninfer_offload.errors import NinferError
from ninfer_offload.runtime.batched_prefill import BATCHED_PREFILL_MIN_SEQUENCES, BATCHED_PREFILL_TOKENS
from ninfer_offload.runtime.sampling import Sampler, SamplingParams
from ninfer_offload.runtime.speculative import MtpSpeculator, draft_together
from ninfer_offload.runtime.step_inputs import upload

log = logging.getLogger("ninfer.decode")


# Prompt tokens per step of a prompt prefilled beside running streams (a server's default): each piece stalls them
# for one forward.
PIECE_BESIDE_STREAMS = 512


@dataclass(frozen=True)
class GenerationRequest:
    """One sequence to generate: its prompt, budget, sampling and stop ids; optionally a grammar
    (`constraint`, with `mask(logits)` and `accept(token)`) and log-probabilities of each token with
    `logprobs` alternatives; `cache_prompt`: resume from and save to the engine's prompt cache, if it has one."""

    prompt_ids: list[int]
    max_tokens: int
    sampling: SamplingParams = field(default_factory=SamplingParams)
    stop_ids: frozenset[int] = frozenset()
    constraint: Any = None  # a frontend.grammar.GrammarConstraint (structured output), or None
    logprobs: int | None = None  # report each token's log-probability and this many alternatives (None: off)
    cache_prompt: bool = True

    def __post_init__(self) -> None:
        if not self.prompt_ids:
            raise NinferError("the prompt is empty: give at least one token")
        if self.max_tokens < 1:
            raise NinferError(f"max_tokens must be >= 1, got {self.max_tokens}")


@dataclass(frozen=True)
class TokenLogprob:
    """A sampled token's log-probability under the model (before penalties, temperature and grammar)
    and the `top` most likely tokens with theirs."""

    logprob: float
    top: list[tuple[int, float]]


@dataclass
class Sequence:
    """One request in the loop: its session, sampler, what is left of its prompt and what it generated.
    `output` holds every sampled token (a final stop id included); `steps`/`produced` count the decode
    forwards after its prefill and the tokens they gave it."""

    request: GenerationRequest
    session: Any
    sampler: Sampler
    unprefilled: list[int]
    owner: Any = None  # the caller's handle of this sequence
    speculator: MtpSpeculator | None = None
    output: list[int] = field(default_factory=list)
    next_token: int | None = None  # the last token handed out, not yet fed to the model
    started: bool = False  # the speculator knows the first generated token
    steps: int = 0
    produced: int = 0
    first_token_at: float | None = None  # perf_counter() when its first token was sampled
    ended: bool = False
    cached_tokens: int = 0  # prompt tokens resumed from the prompt cache
    save_points: list[int] = field(default_factory=list)  # prompt positions still to save at, ascending

    @property
    def prompt(self) -> list[int]:
        return self.request.prompt_ids

    @property
    def prefilled(self) -> int:
        """Prompt tokens its session holds so far."""
        return len(self.prompt) - len(self.unprefilled)

    @property
    def picks_argmax(self) -> bool:
        """Whether its next token is the argmax of its logits (greedy, no penalties, grammar, logprobs or drafts)."""
        request = self.request
        plain = self.speculator is None and request.constraint is None and request.logprobs is None
        return plain and self.sampler.params.picks_argmax

    @property
    def speculation(self) -> dict | None:
        """Drafted/accepted counts, when it decodes speculatively."""
        return self.speculator.stats.to_json() if self.speculator is not None else None


@dataclass(frozen=True)
class Token:
    """A token handed out to `sequence` (with its log-probability when the request asks for them)."""

    sequence: Sequence
    token: int
    logprob: TokenLogprob | None = None


@dataclass(frozen=True)
class End:
    """`sequence` ended: "stop" | "length" | "error" or the reason its caller gave."""

    sequence: Sequence
    reason: str
    error: str | None = None


Event = Token | End


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


def _last_message_end(request: GenerationRequest) -> int:
    """Where a chat prompt's last message ends: after its last stop id (`<|im_end|>`), 0 if it has none. The next turn
    shares the prompt up to there but not after (the reply replaces what the template opened, its reasoning among it)."""
    prompt = request.prompt_ids
    return next((i + 1 for i in range(len(prompt) - 1, -1, -1) if prompt[i] in request.stop_ids), 0)


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


@dataclass(frozen=True)
class _QueuedStep:
    """A decode step queued ahead of the host: its sequences, in order, and the tokens it picks for them."""

    sequences: list[Sequence]
    tokens: QueuedTokens


class Decoder:
    """Runs sequences on `engine`, one `step()` at a time (see the module docstring); `prefill_chunk`: prompt tokens of
    one sequence per step (default: as `_piece_tokens` chooses by what else is running)."""

    def __init__(self, engine, prefill_chunk: int | None = None) -> None:
        self.engine = engine
        self.prefill_chunk = prefill_chunk
        self.sequences: list[Sequence] = []  # the sequences not ended, in the order they were added
        self.largest_batch = 0  # most sequences in one decode step so far
        self._queued: _QueuedStep | None = None  # the decode step queued ahead of the host, if any
        self._events: list[Event] = []

    def add(self, request: GenerationRequest, owner: Any = None) -> Sequence:
        """Open a session for `request` (NinferError when every slot is taken); it starts at the next `step()`."""
        session = self.engine.session()
        try:
            sequence = Sequence(request, session, Sampler(request.sampling), unprefilled=list(request.prompt_ids), owner=owner)
            if self.engine.spec_tokens and request.constraint is None and request.logprobs is None:
                sequence.speculator = MtpSpeculator(session, sequence.sampler, request.prompt_ids, self.engine.spec_tokens)
            self._resume(sequence)
        except BaseException:
            session.close()
            raise
        self.sequences.append(sequence)
        return sequence

    # -- prompt cache --------------------------------------------------------------------------
    def _cache(self, sequence: Sequence):
        """The engine's prompt cache where `sequence` uses it, else None."""
        return self.engine.prompt_cache if sequence.request.cache_prompt else None

    def _resume(self, sequence: Sequence) -> None:
        """Start `sequence` from the longest saved prefix of its prompt (one with MTP rows for a speculating one)."""
        cache = self._cache(sequence)
        if cache is None:
            return
        match = cache.match(sequence.prompt, with_mtp=sequence.speculator is not None)
        sequence.session.resume(match)
        sequence.unprefilled = sequence.prompt[match.tokens :]
        sequence.cached_tokens = match.tokens
        if sequence.speculator is not None and match.tokens:
            sequence.speculator.resume(match.hidden)
        sequence.save_points = cache.save_points(len(sequence.prompt), match, (_last_message_end(sequence.request),))

    def _piece_room(self, sequence: Sequence, tokens: int) -> int:
        """At most `tokens` of the prompt's next piece, ending at the next save point if it comes before."""
        points = sequence.save_points
        return min(tokens, points[0] - sequence.prefilled) if points else tokens

    def _after_piece(self, sequence: Sequence) -> None:
        """Save the state of `sequence` if its prompt has reached its next save point."""
        points = sequence.save_points
        if points and sequence.prefilled == points[0]:
            points.pop(0)
            self._save(sequence)

    def _save(self, sequence: Sequence) -> None:
        """Save the state of `sequence` in the prompt cache under the tokens its session holds (those it knows)."""
        session = sequence.session
        if self._cache(sequence) is None or session.pending or session.slot is None:
            return
        held = (sequence.prompt + sequence.output)[: session.length]
        if len(held) < session.length:  # it was fed a token it never handed out (ended by its caller)
            return
        hidden = sequence.speculator.last_hidden if sequence.speculator is not None else None
        try:
            session.remember(held, hidden)
        except Exception:  # noqa: BLE001 - a cache that cannot save costs a later request time, never this one its tokens
            log.exception("saving a %d-token sequence in the prompt cache failed", len(held))

    def step(self) -> list[Event]:
        """One prefill piece and one decode step; the tokens handed out and the sequences ended meanwhile."""
        self._prefill()
        self._decode()
        events, self._events = self._events, []
        return events

    def end(self, sequence: Sequence, reason: str, error: str | None = None) -> End | None:
        """End `sequence` now (its caller cancelled it, a shutdown) and free its session; None if it had ended."""
        if sequence.ended:
            return None
        self._finish(sequence, reason, error)
        return self._events.pop()

    # -- prefill -------------------------------------------------------------------------------
    def _prefill(self) -> None:
        """The next piece of several plainly decoding newcomers' prompts in one forward when there are enough of them
        with BATCHED_PREFILL_TOKENS[0] or more tokens left (`BATCHED_PREFILL_MIN_SEQUENCES`; shorter prompts replay a
        captured prefill alone; each piece padded to `Engine.batched_prefill_piece` tokens, the smallest warmed-up
        size that holds the longest), else one chunk of the first newcomer's prompt."""
        waiting = [s for s in self.sequences if s.unprefilled]
        plain = [s for s in waiting if s.speculator is None and len(s.unprefilled) >= BATCHED_PREFILL_TOKENS[0]]
        piece = self.engine.batched_prefill_piece
        tokens = piece(max((len(s.unprefilled) for s in plain), default=0))
        room = self.engine.max_context - tokens  # a padded piece writes KV rows up to its full length
        together = [s for s in plain if s.prefilled <= room][: (self.prefill_chunk or PIECE_BESIDE_STREAMS) // max(1, tokens)]
        if tokens and len(together) >= BATCHED_PREFILL_MIN_SEQUENCES:
            self._prefill_together(together, piece(max(len(s.unprefilled) for s in together)))
        elif waiting:
            self._prefill_one(waiting[0])

    def _prefill_together(self, sequences: list[Sequence], tokens: int) -> None:
        """Up to `tokens` tokens of each one's prompt in one forward, each padded to `tokens`."""
        rows = [s.unprefilled[: self._piece_room(s, tokens)] for s in sequences]
        try:
            logits = self.engine.prefill_batch([s.session for s in sequences], rows, tokens)
        except Exception as exc:  # noqa: BLE001 - the sequences end with the error, the loop goes on
            self._fail(sequences, f"prefill of {len(sequences)} prompts together", exc)
            return
        for sequence, piece, row in zip(sequences, rows, logits):
            sequence.unprefilled = sequence.unprefilled[len(piece) :]
            self._after_piece(sequence)
            if not sequence.unprefilled:
                self._sample(sequence, row)

    def _prefill_one(self, sequence: Sequence) -> None:
        size = self._piece_room(sequence, self._piece_tokens(sequence))
        chunk, sequence.unprefilled = sequence.unprefilled[:size], sequence.unprefilled[size:]
        try:
            if sequence.speculator is not None:
                logits = sequence.speculator.feed_prompt(chunk)
            else:
                logits = sequence.session.prefill(chunk)
        except Exception as exc:  # noqa: BLE001
            self._fail([sequence], f"prefill of a {len(sequence.prompt)}-token prompt", exc)
            return
        self._after_piece(sequence)
        if not sequence.unprefilled:
            self._sample(sequence, logits)

    def _piece_tokens(self, sequence: Sequence) -> int:
        """Most tokens of `sequence`'s next prompt piece: `prefill_chunk` where the loop was given one. Else, beside
        running streams, pieces that keep their stall short (PIECE_BESIDE_STREAMS; with staged host experts a whole
        chunk: a piece's stall is then its staging's, about the same for a few hundred tokens as for a chunk); with
        none, a plain prompt in the engine's spans (with staged host experts several chunks a forward, each layer's
        host experts crossing the link once for them) and a speculating one in chunks (its MTP layer prefills the
        whole piece in one forward)."""
        engine = self.engine
        if self.prefill_chunk is not None:
            return self.prefill_chunk
        if any(s is not sequence and not s.unprefilled for s in self.sequences):  # streams decoding
            staged = engine.prefill_span > engine.prefill_chunk
            return engine.prefill_chunk if staged else min(PIECE_BESIDE_STREAMS, engine.prefill_chunk)
        return engine.prefill_chunk if sequence.speculator is not None else engine.prefill_span

    # -- decode --------------------------------------------------------------------------------
    def _decode(self) -> None:
        queued, self._queued = self._queued, None
        for sequence in [s for s in self.sequences if s.next_token is not None and s.session.length >= self.engine.max_context]:
            self._finish(sequence, "length")  # no room for the token it would feed
        decoding = [s for s in self.sequences if s.next_token is not None]
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
                self._decode_now([s for s in self.sequences if s.speculator is None and s.next_token is not None])
        except Exception as exc:  # noqa: BLE001
            self._queued = None
            self._fail([s for s in batch if not s.ended], f"decode step of {len(batch)} sequences", exc)

    def _decode_ahead(self, ready: list[Sequence], queued: _QueuedStep | None) -> None:
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
            self.largest_batch = max(self.largest_batch, len(sequences))
            self._queued = _QueuedStep(sequences, queue_greedy_step(self.engine, [s.session for s in sequences], torch.cat(parts)))
        if queued is not None:
            self._hand_out(queued)
        if self._queued is not None:
            for sequence in self._queued.sequences:
                sequence.next_token = None  # already fed to the queued step

    def _goes_on(self, sequence: Sequence) -> bool:
        """Whether a sequence of the queued step needs a step after it (unless the token it picked ends it): its
        budget and its context leave room for another token."""
        room = sequence.session.length < self.engine.max_context
        return not sequence.ended and len(sequence.output) + 1 < sequence.request.max_tokens and room

    def _hand_out(self, queued: _QueuedStep) -> None:
        """Hand out the tokens a queued step picked (waits for it), to the sequences still running."""
        for sequence, token in zip(queued.sequences, queued.tokens.read()):
            if not sequence.ended:
                sequence.steps += 1
                sequence.produced += 1
                self._emit(sequence, token)

    def _decode_now(self, plain: list[Sequence]) -> None:
        """One decode step over `plain` on their host tokens; the argmax-picking rows in one argmax, the others sampled."""
        if not plain:
            return
        self.largest_batch = max(self.largest_batch, len(plain))
        logits = self.engine.step_batch([s.session for s in plain], [s.next_token for s in plain])
        rows = [i for i, s in enumerate(plain) if s.picks_argmax]
        picked = dict(zip(rows, logits[rows].argmax(dim=-1).tolist())) if rows else {}
        for i, (sequence, row) in enumerate(zip(plain, logits)):
            sequence.steps += 1
            sequence.produced += 1
            if i in picked:
                self._emit(sequence, picked[i])
            else:
                self._sample(sequence, row)

    def _speculate(self, batch: list[Sequence]) -> None:
        """One speculative round over `batch`: each sequence drafts with its MTP speculator, one target
        step verifies every sequence's anchor and drafts, each keeps what its own rule accepts."""
        for sequence in batch:
            if not sequence.started:
                sequence.speculator.start(sequence.next_token)
                sequence.started = True
        k = max(0, min(s.speculator.room() for s in batch))
        drafted = draft_together([s.speculator for s in batch], k, [s.output for s in batch])
        tokens = [[s.next_token] + drafts for s, (drafts, _) in zip(batch, drafted)]
        self.largest_batch = max(self.largest_batch, len(batch))
        logits, hidden = self.engine.step([s.session for s in batch], tokens, with_hidden=True)
        for i, (sequence, (drafts, probs)) in enumerate(zip(batch, drafted)):
            rows = hidden[i * (k + 1) : (i + 1) * (k + 1)]
            following = sequence.speculator.settle(logits[i], rows, drafts, probs, sequence.output)
            sequence.steps += 1
            sequence.produced += len(following)
            for token in following:
                if not self._emit(sequence, token):
                    break

    # -- tokens out ----------------------------------------------------------------------------
    def _sample(self, sequence: Sequence, logits: torch.Tensor) -> None:
        """Sample the next token from `logits` (grammar mask, penalties, log-probabilities) and hand it out."""
        request = sequence.request
        constraint = request.constraint
        logprob = None
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
                logprob = TokenLogprob(float(logprobs[token]), alternatives)
        except Exception as exc:  # noqa: BLE001
            self._fail([sequence], "sampling", exc)
            return
        self._emit(sequence, token, logprob)

    def _emit(self, sequence: Sequence, token: int, logprob: TokenLogprob | None = None) -> bool:
        """Hand out a generated token; False when the sequence ends with it."""
        request = sequence.request
        sequence.output.append(token)
        if sequence.first_token_at is None:
            sequence.first_token_at = time.perf_counter()
        sequence.next_token = None
        if token in request.stop_ids:
            self._finish(sequence, "stop")
            return False
        self._events.append(Token(sequence, token, logprob))
        if len(sequence.output) >= request.max_tokens:
            self._finish(sequence, "length")
            return False
        sequence.next_token = token
        return True

    def _fail(self, sequences: list[Sequence], what: str, exc: Exception) -> None:
        """End `sequences` with the error `exc` raised by `what`: a NinferError (a request the engine refuses, such
        as a token outside the vocabulary) is logged in one line, anything else with its traceback."""
        if isinstance(exc, NinferError):
            log.info("%s failed: %s", what, exc)
        else:
            log.exception("%s failed", what)
        for sequence in sequences:
            self._finish(sequence, "error", str(exc))

    def _finish(self, sequence: Sequence, reason: str, error: str | None = None) -> None:
        if reason in ("stop", "length"):
            self._save(sequence)
        sequence.ended = True
        sequence.next_token = None
        if sequence in self.sequences:
            self.sequences.remove(sequence)
        try:
            sequence.session.close()
        finally:
            self._events.append(End(sequence, reason, error))
