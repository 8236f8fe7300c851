"""The prefill staging of an `ExpertStore` with offloaded experts: host records copied into VRAM slots
for a prompt chunk's layers.

A prefill chunk (`ExpertStore.forward(prefill=True)`, never captured) with more (token, expert) pairs than the
MoE kernels' `PREFILL_MIN_PAIRS` would read each host expert over PCIe once per block of its tokens,
in short runs. Instead `PrefillStaging` copies the host experts a layer needs into VRAM staging slots, once
per chunk, in two steps. Consecutive layers alternate between two buffers of slots: while a layer
computes, the copy engines already move into the other buffer the next layer's host experts that
the chunk is expected to use at least `PREFETCH_MIN_USES` times (the plan's pick rates; decided on
the host, one copy per run of consecutive ids). When the layer's routing is known, the experts it
uses that are still not in VRAM go into the buffer's remaining slots, the most used first, all
decided on the device (per-expert counts, a top-k, a copy of the layer's table pointing the staged
experts at their slots) and copied by one gather kernel (`kernels.staging`); the host waits only for
whether some used expert is left in host memory, and only when more experts are outside VRAM than a
buffer has slots. The MoE kernels run on that table in two passes
(`Backend.routed_experts_split`): on CUDA the copies run on its copy stream while the
compute stream computes the pairs of the other experts (those in VRAM, and those left over in host
memory, read over PCIe as before); then the compute stream waits for the layer's copies and computes
the staged experts' pairs with the VRAM tiles. The copy stream first waits for the work queued on
the compute stream, so a copy never overwrites slots the layer before reads. Decode steps never
stage. Staged records (prefetched ones whether used or not) count as PCIe bytes
(`StoreStats.staged`), their uses not; both are counted on the device.
"""

from __future__ import annotations

import numpy as np
import torch

from ninfer_offload.model.experts import ExpertBank

# A prefill chunk prefetches the host experts it is expected to use at least this often (from the plan's pick
# rates). On the benchmark trace (2048-token chunks, 160 experts per layer in VRAM) 3 prefetches 7 % more
# records than the chunks use and leaves 4 % of the used ones to the copy after routing; 1 (63 % sure to be
# used) wastes 12 %, 8 leaves 18 %.
PREFETCH_MIN_USES = 3.0
GATHER_PROGRAMS = 16  # programs of each staging gather: enough loads in flight for PCIe, few SMs taken from the layers computing


def gather_records_reference(
    arena: torch.Tensor, host: torch.Tensor, experts: torch.Tensor, slots: torch.Tensor, valid: torch.Tensor, nbytes: int
) -> None:
    """What `kernels.staging.gather_records` does, from the layer's host records [E, nbytes] (syncs on CUDA)."""
    for expert, slot in zip(experts[valid].tolist(), slots[valid].tolist()):
        arena[slot : slot + nbytes].copy_(host[expert])


class PrefillStaging:
    """The staging slots of one store (after its cache slots), their two buffers, the copy stream and
    the experts prefetched for the layers ahead."""

    def __init__(self, store):
        self.store = store
        self.slots = store.staging_slots
        self._offsets = torch.tensor([store.staging_offset(slot) for slot in range(self.slots)], dtype=torch.int64, device=store.device)
        start = store.staging_offset(0)
        self._rows = store.arena[start : start + self.slots * store.slot_bytes].view(self.slots, store.slot_bytes)  # a slot each
        self._ahead: dict[int, torch.Tensor] = {}  # per layer, the experts prefetched into its buffer
        self.prefetch_min_uses = PREFETCH_MIN_USES  # inf: no prefetch (benchmarks compare)
        self.gather_programs = GATHER_PROGRAMS  # programs of the gather kernel (benchmarks compare)
        self.prefetch_by_copy_engines = False  # prefetch by one copy per run of ids instead (benchmarks compare)
        self._copy_stream = None  # the staging copies' (CUDA)
        if store.device.type == "cuda":
            # high priority: the gather's few programs take SMs as the compute kernels free them
            self._copy_stream = torch.cuda.Stream(store.device, priority=-1)
            self._staged = torch.cuda.Event()  # after the copies into the buffer of the layer computing
            store.arena.record_stream(self._copy_stream)  # freed arena memory is reused only after the copies queued by then

    def forget(self) -> None:
        """After a forward: drop the prefetches for layers it did not reach."""
        self._ahead.clear()

    def takes(self, topk_ids: torch.Tensor) -> bool:
        """Whether a prefill chunk's layer stages its host experts: as many (token, expert) pairs as take the
        MoE kernels' prefill tiles."""
        from ninfer_offload.kernels.moe import PREFILL_MIN_PAIRS  # here: kernels.moe needs triton, CPU-only installs may lack it

        return topk_ids.numel() > PREFILL_MIN_PAIRS

    def bank(self, layer: int, topk_ids: torch.Tensor) -> tuple[ExpertBank, torch.Tensor]:
        """The bank of `layer` for one prefill chunk, and which experts were staged ([E] bool on the device).
        The layer's staging buffer holds the experts prefetched while the previous layer computed
        (`_prefetch`); the experts its tokens use that are still outside VRAM (their table offsets fall
        outside the arena) start copying into the buffer's other slots, the most used first, as many as
        fit. A copy of the layer's table points at both: they can be read once `wait` was
        called. It is decided on the device, staged uses and records counted there. Then the next layer's
        prefetch is queued. The bank keeps `host` only if some used expert is left in host memory (the
        first pass then takes the PCIe tiles): when more experts are outside VRAM than the buffer has
        slots, the host waits for that answer while the copies run; otherwise none can be."""
        store, buffer = self.store, self._buffer(layer)
        ahead = self._ahead.pop(layer, None)
        table = store.table[layer].clone()
        counts = torch.bincount(topk_ids.reshape(-1), minlength=store.num_experts)
        later = torch.zeros(store.num_experts, dtype=torch.bool, device=store.device)
        prefetched = 0 if ahead is None else ahead.numel()
        if prefetched:
            table[ahead] = buffer[:prefetched]
            later[ahead] = True
            store.staged_uses[layer].index_add_(0, ahead, counts[ahead].to(torch.int32))
            store.staged_records[layer].index_add_(0, ahead, torch.ones_like(ahead, dtype=torch.int32))
        missing = (counts > 0) & ((table < 0) | (table >= store.arena.numel()))
        staged = missing.new_zeros(())
        if prefetched < buffer.numel():
            used, experts = torch.topk(torch.where(missing, counts, 0), min(buffer.numel() - prefetched, store.num_experts))
            valid = used > 0
            slots = buffer[prefetched : prefetched + experts.numel()]
            table.scatter_(0, experts, torch.where(valid, slots, table[experts]))
            later |= torch.zeros_like(later).scatter_(0, experts, valid)
            store.staged_uses[layer].index_add_(0, experts, torch.where(valid, used, 0).to(torch.int32))
            store.staged_records[layer].index_add_(0, experts, valid.to(torch.int32))
            self._stage(layer, experts, slots, valid)
            staged = valid.sum()
        if self._copy_stream is not None:
            self._staged.record(self._copy_stream)
        self._prefetch(layer + 1, topk_ids.shape[0])
        # Whether some used expert stays in host memory: impossible when every expert outside VRAM has a slot
        # (the host's view of the table tells, no sync); otherwise one host sync, with the copies under way.
        outside = int((~store.cache.in_vram[layer]).sum())
        left = outside > buffer.numel() and bool(missing.sum() > staged)
        return ExpertBank(store.layouts[layer], store.arena, table, store.host[layer] if left else None), later

    def _buffer(self, layer: int) -> torch.Tensor:
        """Byte offsets of the staging slots of `layer`'s buffer: consecutive layers alternate between the
        two halves, so one layer's prefetch never overwrites what the layer before it still reads."""
        half = self.slots // 2
        return self._offsets[(layer % 2) * half : (layer % 2 + 1) * half]

    def _prefetch(self, layer: int, tokens: int) -> None:
        """Start copying into `layer`'s buffer the experts outside VRAM that a chunk of `tokens` tokens is
        expected to use at least `prefetch_min_uses` times (the plan's per-token pick rates; the likeliest
        when more than the buffer holds), before its routing is known: the copy overlaps the layers
        computed meanwhile."""
        if layer >= len(self.store.layouts):
            return
        rates = self.store.placement.scores[layer]
        wanted = np.flatnonzero(~self.store.cache.in_vram[layer] & (rates * tokens >= self.prefetch_min_uses))
        wanted = np.sort(wanted[np.argsort(-rates[wanted], kind="stable")][: self.slots // 2])
        if not wanted.size:
            return
        (experts,) = self.store.upload(torch.from_numpy(wanted))
        if not self.prefetch_by_copy_engines:  # one gather launch, like the copy after routing
            slots = self._buffer(layer)[: wanted.size]
            self._stage(layer, experts, slots, torch.ones(wanted.size, dtype=torch.bool, device=self.store.device))
        elif self._copy_stream is None:
            self._copy_prefetched(layer, wanted, (layer % 2) * (self.slots // 2))
        else:  # after the work queued so far (the reads of the buffer's previous layer)
            self._copy_stream.wait_stream(torch.cuda.current_stream(self.store.device))
            with torch.cuda.stream(self._copy_stream):
                self._copy_prefetched(layer, wanted, (layer % 2) * (self.slots // 2))
        self._ahead[layer] = experts

    def _copy_prefetched(self, layer: int, experts: np.ndarray, first: int) -> None:
        """Copy the host records of `experts` (ascending ids) into the staging slots from `first` on, in
        order: the host chose them, so on CUDA the copy engines move them (a gather kernel's SMs would
        compete with the layers computing meanwhile), one copy per run of consecutive ids (their host
        records and their slots are both contiguous)."""
        nbytes, host = self.store.layouts[layer].nbytes, self.store.host[layer]
        breaks = np.flatnonzero(np.diff(experts) != 1) + 1
        for start, end in zip(np.r_[0, breaks].tolist(), np.r_[breaks, experts.size].tolist()):
            e0 = int(experts[start])
            dst, src = self._rows[first + start : first + end], host[e0 : e0 + end - start]
            if self.store.slot_bytes == nbytes:
                dst.copy_(src, non_blocking=True)
            else:  # a record shorter than a slot: one contiguous copy each
                for row, record in zip(dst, src):
                    row[:nbytes].copy_(record, non_blocking=True)

    def _stage(self, layer: int, experts: torch.Tensor, slots: torch.Tensor, valid: torch.Tensor) -> None:
        """Copy the host records of `experts` (where `valid`) into the staging slots at byte offsets `slots`.
        On CUDA the copy runs on the copy stream, after the work queued on the compute stream (the
        previous chunk's and layers' kernels that read the slots, and the choice of experts)."""
        if self._copy_stream is None:
            self._copy_records(layer, experts, slots, valid)
            return
        self._copy_stream.wait_stream(torch.cuda.current_stream(self.store.device))
        with torch.cuda.stream(self._copy_stream):
            self._copy_records(layer, experts, slots, valid)
        for tensor in (experts, slots, valid):
            tensor.record_stream(self._copy_stream)

    def _copy_records(self, layer: int, experts: torch.Tensor, slots: torch.Tensor, valid: torch.Tensor) -> None:
        nbytes = self.store.layouts[layer].nbytes
        if self.store.device.type == "cuda":
            from ninfer_offload.kernels.staging import gather_records

            gather_records(self.store.arena, self.store.table[layer], experts, slots, valid, nbytes, self.gather_programs)
        else:
            gather_records_reference(self.store.arena, self.store.host[layer], experts, slots, valid, nbytes)

    def wait(self) -> None:
        """Make the compute stream wait for the last staging copies (nothing to wait for on the CPU)."""
        if self._copy_stream is not None:
            torch.cuda.current_stream(self.store.device).wait_event(self._staged)
