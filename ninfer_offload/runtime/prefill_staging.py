"""The prefill staging of an `ExpertStore` with offloaded experts: host records copied into VRAM slots
for a prompt chunk's layers.

A prefill chunk (`ExpertStore.forward(prefill=True)`, never captured) with more (token, expert) pairs than the
MoE kernels' `PREFILL_MIN_PAIRS` would read each host expert over PCIe once per block of its tokens,
in short runs. Instead `PrefillStaging` copies a layer's host experts into VRAM staging slots once per
chunk, by one gather kernel (`kernels.staging.gather_records`) on its copy stream, and the MoE kernels
run on a copy of the layer's table that points the staged experts at their slots, in two passes
(`Backend.routed_experts_split`): the compute stream computes the pairs of the other experts (those in
VRAM, and those left in host memory, read over PCIe as before) while the copy runs, then waits for the
layer's copy and computes the staged experts' pairs. Staged records count as PCIe bytes
(`StoreStats.staged`), their uses not; both are counted on the device. Decode steps never stage.

Which experts, in one of two ways (`PrefillStaging.ahead`):
* ahead (the default): while layer L computes, the copy stream already moves layer L+1's host experts
  that the chunk is expected to use at least `AHEAD_MIN_USES` times (the plan's pick rates, decided on
  the host: no routing needed) into the other of two buffers of slots; a large chunk uses nearly all of
  them (a 4096-token chunk ~90 % of the host experts on the benchmark trace), so the link moves a few
  more bytes but runs beside the layers instead of after each layer's routing. A copy into a buffer
  waits for the work queued on the compute stream, which includes every read of it by the layer before.
* after routing: when the layer's routing is known, the experts it uses that are not in VRAM go into the
  slots (one buffer), the most used first, as many as fit, decided on the device by one kernel
  (`kernels.staging.choose_staged`); the host waits only for whether some used expert is left in host
  memory, and only when more experts are outside VRAM than there are slots.
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np
import torch

from ninfer_offload.model.experts import ExpertBank

# Programs of each staging gather: enough loads in flight for the PCIe link, few SMs taken from the MoE kernels
# computing beside it. Measured at ec7539d (15 GiB, 4K prefill in 2048-token chunks): 16 programs 12.8K tok/s,
# 64 programs 11.8K (the copies equally long, ~51 GB/s; the compute stream busy 125 ms against 164 beside them).
GATHER_PROGRAMS = 16
# Ahead of its routing a chunk's layer stages the host experts it is expected to use at least this often.
AHEAD_MIN_USES = 1.0


class StagingChoice(NamedTuple):
    """Which used experts outside VRAM a layer stages (all on the device): the layer's table with them
    pointing at their slots, an [E] bool of the staged ones, per slot the expert, its byte offset and
    whether it is used, and whether some used expert outside VRAM got no slot (a 0-dim bool)."""

    table: torch.Tensor
    staged: torch.Tensor
    experts: torch.Tensor
    slots: torch.Tensor
    valid: torch.Tensor
    left: torch.Tensor


def choose_staged_reference(
    topk_ids: torch.Tensor, table: torch.Tensor, arena_bytes: int, offsets: torch.Tensor, uses: torch.Tensor,
    staged_uses: torch.Tensor, staged_records: torch.Tensor,
) -> StagingChoice:
    """What `kernels.staging.choose_staged` does: the experts `topk_ids` uses whose `table` offsets fall outside
    the arena get the slots at byte `offsets`, the most used first (ties: the lower id), as many as there
    are slots; every expert's uses are added to `uses`, the staged ones' uses and records to
    `staged_uses` / `staged_records` (each [E])."""
    experts_count = table.numel()
    flat = topk_ids.reshape(-1)  # (not bincount: on CUDA it syncs twice, for the ids' min and max)
    counts = torch.zeros(experts_count, dtype=torch.int64, device=table.device).index_add_(0, flat, torch.ones_like(flat))
    uses += counts.to(uses.dtype)
    missing = (counts > 0) & ((table < 0) | (table >= arena_bytes))
    ids = torch.arange(experts_count, device=table.device)
    key = torch.where(missing, counts, 0) * experts_count + (experts_count - 1 - ids)  # distinct: no ties for topk
    top, _ = torch.topk(key, min(offsets.numel(), experts_count))
    experts, used = experts_count - 1 - top % experts_count, top // experts_count
    valid = used > 0
    slots = offsets[: experts.numel()]
    chosen = table.clone().scatter_(0, experts, torch.where(valid, slots, table[experts]))
    staged = torch.zeros(experts_count, dtype=torch.bool, device=table.device).scatter_(0, experts, valid)
    staged_uses.index_add_(0, experts, torch.where(valid, used, 0).to(staged_uses.dtype))
    staged_records.index_add_(0, experts, valid.to(staged_records.dtype))
    return StagingChoice(chosen, staged, experts, slots, valid, missing.sum() > valid.sum())


def gather_records_reference(
    arena: torch.Tensor, host: torch.Tensor, experts: torch.Tensor, slots: torch.Tensor, valid: torch.Tensor, nbytes: int
) -> None:
    """What `kernels.staging.gather_records` does, from the layer's host records [E, nbytes] (syncs on CUDA)."""
    for expert, slot in zip(experts[valid].tolist(), slots[valid].tolist()):
        arena[slot : slot + nbytes].copy_(host[expert])


class PrefillStaging:
    """The staging slots of one store (after its cache slots), the copy stream that fills them, and the
    layers staged ahead."""

    def __init__(self, store):
        self.store = store
        self.slots = store.staging_slots
        self._offsets = torch.tensor([store.staging_offset(slot) for slot in range(self.slots)], dtype=torch.int64, device=store.device)
        self.gather_programs = GATHER_PROGRAMS  # (benchmarks compare)
        self.ahead = True  # stage each next layer while a layer computes; False: after each layer's routing (benchmarks compare)
        self.ahead_min_uses = AHEAD_MIN_USES  # (benchmarks compare)
        self._ahead: dict[int, tuple[ExpertBank, torch.Tensor, torch.cuda.Event | None]] = {}  # per layer staged ahead
        self._copy_stream = None  # the staging copies' (CUDA)
        self._staged = None  # the event after the copy of the layer computing (CUDA)
        if store.device.type == "cuda":
            # high priority: the gather's few programs take SMs as the compute kernels free them
            self._copy_stream = torch.cuda.Stream(store.device, priority=-1)
            store.arena.record_stream(self._copy_stream)  # freed arena memory is reused only after the copies queued by then

    def takes(self, topk_ids: torch.Tensor) -> bool:
        """Whether a prefill chunk's layer stages its host experts: as many (token, expert) pairs as take the
        MoE kernels' prefill tiles."""
        from ninfer_offload.kernels.moe import PREFILL_MIN_PAIRS  # here: kernels.moe needs triton, CPU-only installs may lack it

        return topk_ids.numel() > PREFILL_MIN_PAIRS

    def bank(self, layer: int, topk_ids: torch.Tensor) -> tuple[ExpertBank, torch.Tensor]:
        """The bank of `layer` for one prefill chunk, and which experts were staged ([E] bool on the device);
        the chunk's uses of the layer's experts are counted here. The staged experts can be read once
        `wait` was called."""
        if not self.ahead:
            return self._after_routing(layer, topk_ids)
        tokens, store = topk_ids.shape[0], self.store
        bank, staged, self._staged = self._ahead.pop(layer, None) or self._stage_ahead(layer, tokens)
        if layer + 1 < len(store.layouts):  # the next layer's copy queues behind this one's, beside this layer's compute
            self._ahead[layer + 1] = self._stage_ahead(layer + 1, tokens)
        flat = topk_ids.reshape(-1)
        store.uses[layer].index_add_(0, flat, torch.ones_like(flat, dtype=torch.int32))
        store.staged_uses[layer].index_add_(0, flat, staged[flat].to(torch.int32))
        return bank, staged

    def forget(self) -> None:
        """After a forward: drop what was staged for layers it did not reach."""
        self._ahead.clear()

    def _stage_ahead(self, layer: int, tokens: int) -> tuple[ExpertBank, torch.Tensor, torch.cuda.Event | None]:
        """Start copying into `layer`'s buffer (consecutive layers alternate between the two halves of the
        slots) the experts outside VRAM that a chunk of `tokens` tokens is expected to use at least
        `ahead_min_uses` times, the likeliest first, as many as fit; (the layer's bank on a copy of its table
        pointing them at their slots, the [E] bool of the staged ones, the event after their copy). The
        bank keeps `host` when some expert outside VRAM is not staged (the first pass reads it over PCIe
        if used)."""
        store, half = self.store, self.slots // 2
        outside = np.flatnonzero(~store.cache.in_vram[layer])
        expected = store.placement.scores[layer, outside] * tokens
        likeliest = np.argsort(-expected, kind="stable")[:half]
        chosen = np.sort(outside[likeliest[expected[likeliest] >= self.ahead_min_uses]])
        (experts,) = store.upload(torch.from_numpy(chosen))
        slots = self._offsets[(layer % 2) * half : (layer % 2) * half + chosen.size]
        table = store.table[layer].clone().index_copy_(0, experts, slots)
        staged = torch.zeros(store.num_experts, dtype=torch.bool, device=store.device).index_fill_(0, experts, True)
        store.staged_records[layer] += staged.to(torch.int32)
        event = self._stage(layer, experts, slots, torch.ones_like(experts, dtype=torch.bool)) if chosen.size else None
        host = store.host[layer] if chosen.size < outside.size else None
        return ExpertBank(store.layouts[layer], store.arena, table, host), staged, event

    def _after_routing(self, layer: int, topk_ids: torch.Tensor) -> tuple[ExpertBank, torch.Tensor]:
        """The experts `layer`'s tokens use that are outside VRAM (their table offsets fall outside the arena)
        start copying into the staging slots, the most used first, as many as fit; a copy of the layer's
        table points at them. Decided on the device, staged uses and records counted there. The bank keeps
        `host` only if some used expert is left in host memory (the first pass then takes the PCIe tiles):
        when more experts are outside VRAM than there are slots, the host waits for that answer while the
        copy runs; otherwise none can be."""
        store = self.store
        counters = store.uses[layer], store.staged_uses[layer], store.staged_records[layer]
        args = (topk_ids, store.table[layer], store.arena.numel(), self._offsets, *counters)
        if store.device.type == "cuda":
            from ninfer_offload.kernels.staging import choose_staged

            choice = StagingChoice(*choose_staged(*args))
        else:
            choice = choose_staged_reference(*args)
        self._staged = self._stage(layer, choice.experts, choice.slots, choice.valid)
        # Whether some used expert stays in host memory: impossible when every expert outside VRAM has a slot
        # (the host's view of the table tells, no sync); otherwise one host sync, with the copy under way.
        outside = int((~store.cache.in_vram[layer]).sum())
        left = outside > self.slots and bool(choice.left)
        return ExpertBank(store.layouts[layer], store.arena, choice.table, store.host[layer] if left else None), choice.staged

    def _stage(self, layer: int, experts: torch.Tensor, slots: torch.Tensor, valid: torch.Tensor) -> torch.cuda.Event | None:
        """Copy the host records of `experts` (where `valid`) into the staging slots at byte offsets `slots`;
        the event after the copy. On CUDA the copy runs on the copy stream, after the work queued on the
        compute stream (the previous chunk's and layers' kernels that read the slots, and the choice of
        experts)."""
        if self._copy_stream is None:
            self._copy_records(layer, experts, slots, valid)
            return None
        self._copy_stream.wait_stream(torch.cuda.current_stream(self.store.device))
        with torch.cuda.stream(self._copy_stream):
            self._copy_records(layer, experts, slots, valid)
        for tensor in (experts, slots, valid):
            tensor.record_stream(self._copy_stream)
        event = torch.cuda.Event()
        event.record(self._copy_stream)
        return event

    def _copy_records(self, layer: int, experts: torch.Tensor, slots: torch.Tensor, valid: torch.Tensor) -> None:
        nbytes = self.store.layouts[layer].nbytes
        if self.store.device.type == "cuda":
            from ninfer_offload.kernels.staging import gather_records

            gather_records(self.store.arena, self.store.table[layer], experts, slots, valid, nbytes, self.gather_programs)
        else:
            gather_records_reference(self.store.arena, self.store.host[layer], experts, slots, valid, nbytes)

    def wait(self) -> None:
        """Make the compute stream wait for the copy of the layer computing (nothing to wait for on the CPU)."""
        if self._staged is not None:
            torch.cuda.current_stream(self.store.device).wait_event(self._staged)
