"""The step runner: a loaded model's parts on one device (text model, MTP module, proposal head,
expert store, backend, state pool, captured graphs) and the forwards over them.

`Engine` checks what callers give it (tokens, sessions, room in the context) and keeps the sessions'
lengths; it hands the runner token lists, state slots and starts. Every forward builds one step
context (`runtime.step_inputs`) that all layers read, and the context alone says what kind of step
it is (`StepContext.prefill`, `.staged`). Decode steps on CUDA with a capturable backend and store
replay CUDA graphs (`runtime.graphs`), as do short prompt pieces when every expert is in VRAM.
The target's steps go through the expert store's step bookkeeping (`ExpertStore.around_step`); the
MTP module's do not (its experts are pinned in VRAM: see `mtp_step`).
"""

from __future__ import annotations

import torch

from ninfer_offload.model.context import StepContext
from ninfer_offload.planner.memory import prefill_span_chunks
from ninfer_offload.runtime.batched_prefill import BATCHED_PREFILL_MIN_SEQUENCES, BATCHED_PREFILL_TOKENS
from ninfer_offload.runtime.graphs import PREFILL_BUCKETS, StepGraphs, prefill_bucket
from ninfer_offload.runtime.step_inputs import step_inputs

# Prompts of up to this many tokens replay the largest captured prefill in pieces rather than run one eager
# chunk, which the host's ~900 launches bound at these lengths (docs/performance.md, Prefill).
GRAPHED_PROMPT_MAX = 128


class StepRunner:
    """Runs the forwards of one loaded model: prefill chunks and batched prefills, decode steps of one
    or more tokens per sequence (their ids from the host or already on the device), MTP steps, and
    the warm-up's captures."""

    def __init__(self, loaded, backend, device: torch.device, dtype: torch.dtype, state, prefill_chunk: int, cuda_graphs: bool):
        self.config = loaded.config
        self.text = loaded.text
        self.mtp = loaded.mtp
        self.proposal = loaded.proposal  # the proposal head drafts when loaded, else the output head
        self.store = loaded.store
        self.backend = backend
        self.device = device
        self.dtype = dtype
        self.state = state
        self.max_context = state.capacity
        self.prefill_chunk = prefill_chunk  # most tokens per prefill forward
        capturable = cuda_graphs and device.type == "cuda" and backend.capturable and self.store.capturable
        self.graphs = StepGraphs(self) if capturable else None

    # ------------------------------------------------------------------ forwards (what a captured step records)
    def forward(self, token_ids: torch.Tensor, ctx: StepContext) -> tuple[torch.Tensor, torch.Tensor]:
        """(logits [N, vocab], final-normed hidden states [N, H]) of the target's forward described by `ctx`."""
        hidden = self.hidden(token_ids, ctx)
        return self.logits_of(hidden), hidden

    def hidden(self, token_ids: torch.Tensor, ctx: StepContext) -> torch.Tensor:
        """Final-normed hidden states [N, H] of the target's forward described by `ctx` (no head)."""
        return self.text.hidden(self.backend, token_ids, ctx, self.state)

    def mtp_forward(
        self, hidden: torch.Tensor, token_ids: torch.Tensor, ctx: StepContext, all_logits: bool = True
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(draft logits, MTP hidden states) of the MTP module's forward described by `ctx` over target hidden
        states `hidden` and the tokens after them; the draft logits of every row, or (`all_logits` off) of the last."""
        out = self.mtp(self.backend, self.text, hidden.to(self.dtype), token_ids, ctx, self.state)
        return self.draft_logits(out if all_logits else out[-1:]), out

    def logits_of(self, hidden: torch.Tensor) -> torch.Tensor:
        """Output-head logits [T, vocab] (float32) of final-normed hidden states."""
        with torch.no_grad():
            return self.text.logits(self.backend, hidden)

    def draft_logits(self, mtp_hidden: torch.Tensor) -> torch.Tensor:
        """Draft logits [T, vocab] (float32) of MTP hidden states: the proposal head's when it is loaded (-inf
        outside its token ids), else the output head's."""
        if self.proposal is None:
            return self.logits_of(mtp_hidden)
        with torch.no_grad():
            return self.proposal.logits(self.backend, mtp_hidden)

    # ------------------------------------------------------------------ prompts
    @property
    def prefill_span(self) -> int:
        """Most prompt tokens of one forward: with staged host experts, several chunks (`prefill_span_chunks`) that
        each layer runs in turn (a layer's host experts cross the link once for all of them), else one chunk."""
        if self.store.staging is None:
            return self.prefill_chunk
        return self.prefill_chunk * prefill_span_chunks(self.prefill_chunk, self.max_context)

    def prefill_piece(self, tokens: int) -> int:
        """Most tokens per forward of a prompt of `tokens` tokens: a short one on a load that replays prefills goes
        in pieces of the largest captured chunk (GRAPHED_PROMPT_MAX), any other in spans (`prefill_span`)."""
        short = self.replays_prefills() and tokens <= GRAPHED_PROMPT_MAX
        return min(PREFILL_BUCKETS[-1], self.prefill_chunk) if short else self.prefill_span

    def prefill(self, piece: list[int], slot: int, start: int) -> torch.Tensor:
        """Hidden states [len(piece), H] of the prompt piece `piece` appended to the sequence in `slot` that holds
        `start` tokens: a captured prefill's replay (padded to its bucket) where there is one, else an eager
        forward over its chunks of `prefill_chunk` tokens, layer by layer (`TextModel.hidden_chunks`), whose host
        experts the store may stage once for the piece."""
        with torch.no_grad():
            if self._captured_prefill(start, len(piece)):
                t = prefill_bucket(len(piece))
                padded = piece + [0] * (t - len(piece))
                return self.graphs.prefill(padded, [slot], [start], t, [len(piece)])[: len(piece)].clone()
            chunks = [(c, piece[c : c + self.prefill_chunk]) for c in range(0, len(piece), self.prefill_chunk)]
            inputs = [
                step_inputs(
                    ids, [slot], [start + c], len(ids), self.max_context, self.device, prefill=True, staged=True,
                    stage_tokens=len(piece), span_row=c,
                )
                for c, ids in chunks
            ]
            with self.store.around_step(len(piece), inputs[0][1]):
                hidden = self.text.hidden_chunks(self.backend, [ids for ids, _ in inputs], [ctx for _, ctx in inputs], self.state)
            return hidden[0] if len(hidden) == 1 else torch.cat(hidden)

    def prefill_batch(self, flat: list[int], slots: list[int], starts: list[int], t: int, valid: list[int]) -> torch.Tensor:
        """Hidden states [B * t, H] of one forward appending t tokens (`flat`, sequence-major; the first valid[b] of
        sequence b's real, the rest padding) to each of the sequences in `slots` holding `starts` tokens, each row
        attending to its own cache (the decode step's kernels); a captured forward's replay where there is one."""
        with torch.no_grad():
            if self.captured_batched_prefill(t):
                return self.graphs.prefill(flat, slots, starts, t, valid)
            tokens, ctx = step_inputs(flat, slots, starts, t, self.max_context, self.device, valid=valid)
            with self.store.around_step(len(flat), ctx):
                return self.hidden(tokens, ctx)

    def batched_prefill_piece(self, unprefilled: int) -> int:
        """Tokens per sequence of a batched prefill whose longest prompt has `unprefilled` tokens left: the smallest
        of BATCHED_PREFILL_TOKENS (what the warm-up compiled) that holds them, else the largest; 0 if none fits the
        context or the experts are offloaded."""
        pieces = [t for t in BATCHED_PREFILL_TOKENS if t < self.max_context]
        if self.store.offloaded or not pieces:
            return 0
        return next((t for t in pieces if t >= unprefilled), pieces[-1])

    def replays_prefills(self) -> bool:
        """Whether short prompt chunks replay captured prefills: graphs, and all experts in VRAM (an offloaded
        prefill stages host experts)."""
        return self.graphs is not None and not self.store.offloaded

    def captured_batched_prefill(self, tokens: int) -> bool:
        """Whether a batched prefill of `tokens` tokens per sequence replays a captured forward: graphs, all experts
        in VRAM, a size the warm-up captures, and padding entries' rows within the scratch slot's."""
        return self.replays_prefills() and tokens in BATCHED_PREFILL_TOKENS and tokens <= self.state.scratch_rows

    def _captured_prefill(self, start: int, tokens: int) -> bool:
        """Whether a prompt chunk of `tokens` tokens after `start` replays a captured prefill: graphs, all experts in
        VRAM, and its padded rows within the context."""
        return self.replays_prefills() and tokens <= PREFILL_BUCKETS[-1] and start + prefill_bucket(tokens) <= self.max_context

    # ------------------------------------------------------------------ decode steps
    def step(
        self, flat: list[int], slots: list[int], starts: list[int], t: int, device_tokens: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(logits [B * T, vocab], hidden [B * T, H]) of one decode step adding T tokens (`flat`, sequence-major; the
        ids of `device_tokens` [B * T] on the device where given) to each of the sequences in `slots` holding
        `starts` tokens: a graph's replay where the runner has graphs (the hidden states then a view of its output,
        valid until the next replay), else an eager forward."""
        with torch.no_grad():
            if self.graphs is not None:
                with self.store.around_step(len(flat)):
                    return self.graphs.run(flat, slots, starts, t, device_tokens)
            ids, ctx = step_inputs(flat, slots, starts, t, self.max_context, self.device, keep_states=t > 1)
            if device_tokens is not None:
                ids.copy_(device_tokens)
            with self.store.around_step(len(flat), ctx):
                return self.forward(ids, ctx)

    def mtp_prefill(
        self, hidden: torch.Tensor, ids: list[int], slot: int, start: int, all_logits: bool = True
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(draft logits, MTP hidden states) of the MTP module over target hidden states `hidden` [T, H] and the T
        tokens `ids` after them, appended to the MTP cache of the sequence in `slot` at `start`, eagerly; the draft
        logits of every position, or (`all_logits` off) of the last one only ([1, vocab]: a prompt chunk's would
        take GiBs)."""
        tokens, ctx = step_inputs(ids, [slot], [start], len(ids), self.max_context, self.device, prefill=True)
        with torch.no_grad():  # no `store.around_step`: see `mtp_step`
            return self.mtp_forward(hidden, tokens, ctx, all_logits)

    def mtp_step(
        self, hidden: torch.Tensor, ids: list[int], slots: list[int], starts: list[int], t: int,
        device_tokens: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(draft logits [B * T, vocab], MTP hidden [B * T, H]) of T MTP positions for each of the sequences in
        `slots` (their MTP caches holding `starts` entries) over target hidden states `hidden` [B * T, H] and the
        tokens `ids` after them (those of `device_tokens` where given): the decode kernels, a graph's replay where
        the runner has graphs."""
        # The MTP layer's experts are pinned in VRAM, so its forwards are not the target's steps for the expert store
        # (`ExpertStore.around_step`: the cache's step boundaries, count reads and promotions, the CPU miss path's
        # tuner, which times decode steps per token): each would add that host work to a draft that takes a fraction
        # of a step.
        with torch.no_grad():
            if self.graphs is not None:
                return self.graphs.run_mtp(hidden, ids, slots, starts, t, device_tokens)
            tokens, ctx = step_inputs(ids, slots, starts, t, self.max_context, self.device)
            if device_tokens is not None:
                tokens.copy_(device_tokens)
            return self.mtp_forward(hidden, tokens, ctx)

    # ------------------------------------------------------------------ warm-up
    def capture_steps(self, spec_tokens: int) -> None:
        """Capture the step graph of every batch bucket (with `spec_tokens` drafts also the verify steps and the MTP
        steps) and, where prefills replay, the batched prefills of each bucket a batch of
        BATCHED_PREFILL_MIN_SEQUENCES or more pads to."""
        if self.graphs is None:
            return
        for bucket in self.graphs.buckets:
            if bucket >= BATCHED_PREFILL_MIN_SEQUENCES:  # the buckets of the batches a server admits together
                for tokens in filter(self.captured_batched_prefill, BATCHED_PREFILL_TOKENS):
                    self.graphs.capture("prefill", bucket, tokens)
            self.graphs.capture("target", bucket, 1)
            if spec_tokens:
                self.graphs.capture("target", bucket, spec_tokens + 1)
                self.graphs.capture("mtp", bucket, 1)
        for t in range(2, spec_tokens + 2):  # the MTP layer catching up after a round
            self.graphs.capture("mtp", 1, t)
        torch.cuda.synchronize(self.device)
