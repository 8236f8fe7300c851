"""The prefill staging of an `ExpertStore` with offloaded experts: host records copied into VRAM slots
for a prompt chunk's layers.

A prefill chunk (`StepContext.staged`, never captured) with more (token, expert) pairs than the
MoE kernels' `PREFILL_MIN_PAIRS` would read each host expert over PCIe once per block of its tokens,
in short runs. Instead `PrefillStaging` copies a layer's host experts into VRAM staging slots once per
chunk, by one gather kernel (`kernels.staging.gather_records`) on its copy stream, and the MoE kernels
run on a copy of the layer's table that points the staged experts at their slots, in passes
(`Backend.routed_experts_split`): the compute stream computes the pairs of the other experts (those in
VRAM, and those left in host memory, read over PCIe) while the copy runs, then waits for the layer's
copy and computes the staged experts' pairs. Staged records count as PCIe bytes (`StoreStats.staged`),
their uses not; a host expert left unstaged counts one read per block of its pairs (the tiled kernels read
its record once per block of `PREFILL_TILES.block_m` pairs); all of it is counted on the device. Decode steps
never stage.

Which experts: those outside VRAM that the chunk is expected to use at least `AHEAD_MIN_USES` times (the
plan's pick rates, decided on the host before the layer's routing is known), the likeliest first, up to
one buffer of slots. A large chunk uses nearly all of them (a 4096-token chunk ~90 % of the host experts
on the benchmark trace), so the link moves a few more bytes than the chunk uses, but it runs beside the
layers instead of after each layer's routing (docs/performance.md, Offload at a VRAM budget).
Two buffers alternate between consecutive layers: when layer L's MoE is queued, the copy of layer L + 2
into the buffer L just read is queued behind it (the chunk's first two layers when its forward starts), so
the copy stream moves the next layer's records while a layer computes.
What every layer stages is decided once per chunk, for all text layers at once (`StagingPlan`: their
table copies, staged marks and expert lists in one upload), so a layer's staging costs the host a gather
launch and a few views; the MTP layer, which prompt chunks do not run, stages nothing.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from ninfer_offload.model.experts import ExpertBank

# Programs of each staging gather: enough loads in flight for the PCIe link, few SMs taken from the MoE kernels
# computing beside it (16 led 64: docs/performance.md, Offload at a VRAM budget).
GATHER_PROGRAMS = 16
# A chunk's layer stages the host experts it is expected to use at least this often (1 led 2, 3 and 6: same place).
AHEAD_MIN_USES = 1.0


def gather_records_reference(arena: torch.Tensor, host: torch.Tensor, experts: torch.Tensor, slots: torch.Tensor, nbytes: int) -> None:
    """What `kernels.staging.gather_records` does, from the layer's host records [E, nbytes] (syncs on CUDA)."""
    for expert, slot in zip(experts.tolist(), slots.tolist()):
        arena[slot : slot + nbytes].copy_(host[expert])


@dataclass(frozen=True)
class StagingPlan:
    """What every text layer of one prefill chunk stages (device tensors, one upload)."""

    tokens: int  # the chunk's
    tables: torch.Tensor  # [layers, E] int64: each layer's table with its staged experts pointed at their slots
    staged: torch.Tensor  # [layers, E] int32: 1 for a staged expert
    experts: torch.Tensor  # [layers, slots per buffer] int64: each layer's staged ids first (counts[layer] of them)
    host_only: torch.Tensor  # [layers, E] int32: 1 for an expert outside VRAM that is not staged
    counts: np.ndarray  # [layers]
    keeps_host: np.ndarray  # [layers] bool: some expert outside VRAM is not staged


class PrefillStaging:
    """The staging slots of one store (after its cache slots), the copy stream that fills them, and the
    layers staged ahead."""

    def __init__(self, store):
        self.store = store
        self.slots = store.staging_slots
        self._offsets_host = np.array([store.staging_offset(slot) for slot in range(self.slots)], dtype=np.int64)
        self._offsets = torch.from_numpy(self._offsets_host).to(store.device)
        self._ones = torch.ones(0, dtype=torch.int32, device=store.device)  # one per (token, expert) pair of a chunk
        self._none = torch.zeros(store.num_experts, dtype=torch.int32, device=store.device)  # no expert staged
        self.gather_programs = GATHER_PROGRAMS  # (benchmarks compare)
        self.ahead_min_uses = AHEAD_MIN_USES  # (benchmarks compare)
        self._ahead: dict[int, tuple[ExpertBank, torch.Tensor, torch.cuda.Event | None]] = {}  # per layer staged ahead
        self._plan: StagingPlan | None = None  # the current chunk's (or span's)
        self._layer: tuple[int, ExpertBank, torch.Tensor] | None = None  # the layer computing: (layer, bank, staged)
        self._uses_before: torch.Tensor | None = None  # the text layers' use counts when the chunk's forward started
        self._copy_stream = None  # the staging copies' (CUDA)
        self._staged = None  # the event after the copy of the layer computing (CUDA)
        if store.device.type == "cuda":
            # high priority: the gather's few programs take SMs as the compute kernels free them
            self._copy_stream = torch.cuda.Stream(store.device, priority=-1)
            store.arena.record_stream(self._copy_stream)  # freed arena memory is reused only after the copies queued by then

    def takes(self, tokens: int) -> bool:
        """Whether a prefill chunk of `tokens` tokens stages its host experts: as many (token, expert) pairs as
        take the MoE kernels' prefill tiles."""
        from ninfer_offload.kernels.moe import PREFILL_MIN_PAIRS  # here: kernels.moe needs triton, CPU-only installs may lack it

        return tokens * self.store.top_k > PREFILL_MIN_PAIRS

    def begin(self, tokens: int) -> None:
        """A prefill chunk of `tokens` tokens starts: decide what each layer stages and queue the copies of its
        first two layers."""
        if self.takes(tokens):
            self._start_plan(tokens)
            for layer in range(min(2, self.store.text_layers)):
                self._ahead[layer] = self._stage(layer, tokens)

    def bank(self, layer: int, topk_ids: torch.Tensor, tokens: int) -> tuple[ExpertBank, torch.Tensor]:
        """The bank of `layer` for the prefill chunks of `tokens` token rows in all (one chunk, or a span whose
        chunks each layer runs in turn: its later chunks find the layer's experts staged by its first), and which
        experts were staged ([E] int32, 1 for a staged one, on the device); the chunk's uses of the layer's experts
        are counted here (those of staged experts once per forward, by `forget`). The staged experts can be read
        once `wait` was called."""
        store = self.store
        if self._layer is None or self._layer[0] != layer:
            bank, staged, self._staged = self._ahead.pop(layer, None) or self._stage(layer, tokens)
            self._layer = layer, bank, staged
        _, bank, staged = self._layer
        flat = topk_ids.reshape(-1)
        if self._ones.numel() < flat.numel():
            self._ones = torch.ones(flat.numel(), dtype=torch.int32, device=store.device)
        store.uses[layer].index_add_(0, flat, self._ones[: flat.numel()])
        return bank, staged

    def done(self, layer: int, tokens: int) -> None:
        """`layer`'s MoE is queued: queue the copy of layer + 2 into the buffer it read, behind it."""
        if layer + 2 < self.store.text_layers:
            self._ahead[layer + 2] = self._stage(layer + 2, tokens)

    def forget(self) -> None:
        """After a forward: count the uses that read no record of their own (the forward's uses of what its plan
        staged, and of each unstaged host expert all but one per block of pairs; a few elementwise ops for all
        layers), and drop what was staged for layers it did not reach."""
        if self._plan is not None:
            from ninfer_offload.kernels.moe import PREFILL_TILES

            layers, block = self.store.text_layers, PREFILL_TILES.block_m
            uses = self.store.uses[:layers] - self._uses_before
            followers = uses - (uses + block - 1) // block
            self.store.shared_uses[:layers] += uses * self._plan.staged + followers * self._plan.host_only
        self._ahead.clear()
        self._plan = self._uses_before = self._layer = None

    def _start_plan(self, tokens: int) -> None:
        """The plan of a chunk of `tokens` tokens, and the use counts it starts from."""
        self._plan = self._choose(tokens)
        self._uses_before = self.store.uses[: self.store.text_layers].clone()

    def _choose(self, tokens: int) -> StagingPlan:
        """What each text layer of a chunk of `tokens` tokens stages: the experts outside VRAM it is expected to
        use at least `ahead_min_uses` times, the likeliest first, as many as one buffer holds (consecutive layers
        alternate between the two halves of the slots). Decided on the host, from its view of the table (no
        table changes inside a forward), for all layers at once: one upload."""
        store, half, e, layers = self.store, self.slots // 2, self.store.num_experts, self.store.text_layers
        outside = ~store.cache.in_vram[:layers]
        expected = np.where(outside, store.placement.scores[:layers] * tokens, -np.inf)
        likeliest = np.argsort(-expected, axis=1, kind="stable")[:, :half]
        rows = np.broadcast_to(np.arange(layers)[:, None], likeliest.shape)
        taken = np.take_along_axis(expected, likeliest, axis=1) >= self.ahead_min_uses
        chosen = np.zeros((layers, e), dtype=bool)
        chosen[rows[taken], likeliest[taken]] = True
        counts = chosen.sum(axis=1)
        experts = np.argsort(~chosen, axis=1, kind="stable")[:, :half]  # each layer's chosen ids first, ascending
        filled = np.arange(half)[None, :] < counts[:, None]
        starts = (np.arange(layers) % 2) * half
        tables = store.table_host[:layers].copy()
        tables[rows[filled], experts[filled]] = self._offsets_host[(starts[:, None] + np.arange(half)[None, :])[filled]]
        marks = np.concatenate([chosen.ravel(), (outside & ~chosen).ravel()]).astype(np.int64)
        (packed,) = store.upload(torch.from_numpy(np.concatenate([tables.ravel(), marks, experts.ravel()])))
        n = layers * e
        staged, host_only = packed[n : 3 * n].to(torch.int32).view(2, layers, e)
        return StagingPlan(
            tokens, packed[:n].view(layers, e), staged, packed[3 * n :].view(layers, half), host_only, counts,
            counts < outside.sum(axis=1),
        )

    def _stage(self, layer: int, tokens: int) -> tuple[ExpertBank, torch.Tensor, torch.cuda.Event | None]:
        """Start copying into `layer`'s buffer what the chunk's plan stages for it; (the layer's bank on the plan's
        copy of its table, pointing the staged experts at their slots, the [E] int32 marking the staged ones, the
        event after their copy). The bank keeps `host` when some expert outside VRAM is not staged (the kernels
        read it over PCIe if used)."""
        if self._plan is None or self._plan.tokens != tokens:
            self._start_plan(tokens)
        plan, store = self._plan, self.store
        n = int(plan.counts[layer])
        host = store.host[layer] if plan.keeps_host[layer] else None
        if not n:  # nothing to copy: the layer's own table
            return ExpertBank(store.layouts[layer], store.arena, store.table[layer], host), self._none, None
        staged = plan.staged[layer]
        store.staged_records[layer] += staged
        start = (layer % 2) * (self.slots // 2)
        event = self._copy(layer, plan.experts[layer, :n], self._offsets[start : start + n])
        return ExpertBank(store.layouts[layer], store.arena, plan.tables[layer], host), staged, event

    def _copy(self, layer: int, experts: torch.Tensor, slots: torch.Tensor) -> torch.cuda.Event | None:
        """Copy the host records of `experts` into the staging slots at byte offsets `slots`; the event after
        the copy. On CUDA the copy runs on the copy stream, after the work queued on the compute stream (the
        kernels of the layer before that read the slots, and the upload of `experts`)."""
        if self._copy_stream is None:
            self._copy_records(layer, experts, slots)
            return None
        self._copy_stream.wait_stream(torch.cuda.current_stream(self.store.device))
        with torch.cuda.stream(self._copy_stream):
            self._copy_records(layer, experts, slots)
        for tensor in (experts, slots):
            tensor.record_stream(self._copy_stream)
        event = torch.cuda.Event()
        event.record(self._copy_stream)
        return event

    def _copy_records(self, layer: int, experts: torch.Tensor, slots: torch.Tensor) -> None:
        nbytes = self.store.layouts[layer].nbytes
        if self.store.device.type == "cuda":
            from ninfer_offload.kernels.staging import gather_records

            gather_records(self.store.arena, self.store.table[layer], experts, slots, nbytes, self.gather_programs)
        else:
            gather_records_reference(self.store.arena, self.store.host[layer], experts, slots, nbytes)

    def wait(self) -> None:
        """Make the compute stream wait for the copy of the layer computing (nothing to wait for on the CPU)."""
        if self._staged is not None:
            torch.cuda.current_stream(self.store.device).wait_event(self._staged)
