"""Where each routed expert's record lives, and how the MoE layers reach it.

Mode "resident": every layer's records sit on the compute device; the bank's slot table is the
identity. Mode "host": records stay in host memory (pinned on CUDA) and the experts a call needs
are copied into a small device slot pool shared by all layers, least recently used evicted, with
hit/miss counts. Records are one contiguous span per expert, so staging an expert is one copy.

Staging needs the routing on the host (one sync per MoE layer); a call whose distinct experts do
not fit the pool is split into token chunks that do. Both modes run the same backend op on the
same record bytes, so they produce identical outputs.

With a miss path ("cpu" or "auto", `cpu_experts.CpuMissPath`), experts missing from the slots
are computed on the host straight from the host records (numba kernels), concurrently with the
device work on the others, and the partial outputs are added.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, field

import torch

from ninfer_offload.artifact.records import RecordLayout
from ninfer_offload.errors import NinferError
from ninfer_offload.model.experts import ExpertBank

MODES = ("resident", "host")
MISS_PATHS = (None, "cpu", "auto")


@dataclass
class StoreStats:
    hits: int = 0
    misses: int = 0
    staged_bytes: int = 0
    cpu_assignments: int = 0
    miss_path: dict = field(default_factory=dict)  # the CPU miss path's rates and split


class ExpertStore:
    """Routed-expert records of every MoE layer (text layers first, then the MTP layer if loaded)."""

    def __init__(
        self,
        layouts: list[RecordLayout],
        records: list[torch.Tensor],
        device: torch.device,
        mode: str = "resident",
        num_slots: int = 0,
        miss_path: str | None = None,
        top_k: int = 1,
    ):
        if mode not in MODES:
            raise NinferError(f"experts must be one of {', '.join(MODES)} (--experts), got {mode!r}")
        if miss_path not in MISS_PATHS:
            raise NinferError(f"miss path must be staged, cpu or auto (--miss-path; miss_path=None, 'cpu' or 'auto'), got {miss_path!r}")
        if miss_path is not None and mode != "host":
            raise NinferError(f"--miss-path {miss_path}: a miss path needs host-resident experts; add --experts host (experts='host')")
        self.layouts = layouts
        self.device = device
        self.mode = mode
        self.miss_path = miss_path
        self.top_k = top_k
        self.stats = StoreStats()
        self.num_experts = records[0].shape[0] if records else 0
        if mode == "resident":
            self.host: list[torch.Tensor] = []
            identity = torch.arange(self.num_experts, device=device)
            self.banks = [ExpertBank(layout, r.to(device), identity) for layout, r in zip(layouts, records)]
            return
        self.host = records
        if miss_path is not None:
            from ninfer_offload.runtime.cpu_experts import CpuMissPath

            self.cpu_path = CpuMissPath(miss_path, device)
        if num_slots < top_k:
            raise NinferError(f"host mode needs at least {top_k} staging slots (one token's experts), got {num_slots}")
        self.num_slots = num_slots
        width = max(layout.nbytes for layout in layouts)
        self.pool = torch.zeros(self.num_slots, width, dtype=torch.uint8, device=device)
        self.lru: OrderedDict[tuple[int, int], int] = OrderedDict()  # (layer, expert) -> slot, oldest first
        self.free = list(range(self.num_slots - 1, -1, -1))

    @property
    def capturable(self) -> bool:
        """Whether a step can be captured as a CUDA graph: host mode syncs on the routing."""
        return self.mode == "resident"

    @property
    def nbytes(self) -> int:
        """Bytes of all records (whatever memory holds them)."""
        return sum(layout.nbytes for layout in self.layouts) * self.num_experts

    # ------------------------------------------------------------------ compute
    def routed(self, backend, layer: int, x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor) -> torch.Tensor:
        """sum_j w[t, j] * expert_{ids[t, j]}(x[t]) for layer `layer` -> [T, H]."""
        if self.mode == "resident":
            return backend.routed_experts(x, topk_ids, topk_weights, self.banks[layer])
        if self.miss_path is not None:
            return self._routed_cpu_misses(backend, layer, x, topk_ids, topk_weights)
        experts = torch.unique(topk_ids).tolist()  # sorted; one host sync
        if len(experts) <= self.num_slots:
            return backend.routed_experts(x, topk_ids, topk_weights, self._stage(layer, experts))
        chunk = max(1, self.num_slots // self.top_k)
        outputs = []
        for t0 in range(0, x.shape[0], chunk):
            ids = topk_ids[t0 : t0 + chunk]
            bank = self._stage(layer, torch.unique(ids).tolist())
            outputs.append(backend.routed_experts(x[t0 : t0 + chunk], ids, topk_weights[t0 : t0 + chunk], bank))
        return torch.cat(outputs)

    def _routed_cpu_misses(self, backend, layer: int, x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor) -> torch.Tensor:
        """Experts in a slot run on the device; the host computes the missing ones ("cpu") or its
        measured share of them ("auto": the rest are staged), while the device works."""
        ids = topk_ids.cpu()
        in_slot = torch.zeros(self.num_experts, dtype=torch.bool)
        in_slot[[expert for (lyr, expert) in self.lru if lyr == layer]] = True
        used_slots = int(torch.unique(ids[in_slot[ids]]).numel())
        on_host = self.cpu_path.host_assignments(ids, in_slot, self.num_slots - used_slots)
        self.stats.misses += int(torch.unique(ids[on_host]).numel())
        self.stats.cpu_assignments += int(on_host.sum())
        host = self.cpu_path.submit(self.layouts[layer], self.host[layer], x, ids, topk_weights, on_host)
        out = None
        on_device = ~on_host
        if bool(on_device.any()):
            mark, staged = self.cpu_path.staging_started(self.device), self.stats.staged_bytes
            bank = self._stage(layer, sorted(set(ids[on_device].tolist())))
            self.cpu_path.staging_finished(mark, self.stats.staged_bytes - staged)
            # Host assignments become zero-weight uses of an expert in the bank: the bank has no
            # record of theirs, and whatever a slot holds could decode to inf (inf * 0 = NaN).
            device_ids = torch.where(on_device, ids, ids[on_device][0]).to(x.device, non_blocking=True)
            weights = topk_weights * on_device.to(device=x.device, dtype=topk_weights.dtype)
            out = backend.routed_experts(x, device_ids, weights, bank)
        partial = host.result().to(device=x.device, dtype=x.dtype)
        self.stats.miss_path = self.cpu_path.stats()
        return partial if out is None else out + partial

    # ------------------------------------------------------------------ staging
    def _stage(self, layer: int, experts: list[int]) -> ExpertBank:
        """Make sure `experts` of `layer` sit in pool slots; returns the layer's bank over the pool."""
        if len(experts) > self.num_slots:
            raise NinferError(f"{len(experts)} experts needed at once, but the slot pool has {self.num_slots} slots")
        layout = self.layouts[layer]
        for expert in experts:  # touch hits first, so that eviction below never takes a needed expert
            if (layer, expert) in self.lru:
                self.lru.move_to_end((layer, expert))
                self.stats.hits += 1
        slots = torch.zeros(self.num_experts, dtype=torch.long)
        for expert in experts:
            slot = self.lru.get((layer, expert))
            if slot is None:
                slot = self.free.pop() if self.free else self.lru.popitem(last=False)[1]
                self.pool[slot, : layout.nbytes].copy_(self.host[layer][expert], non_blocking=True)
                self.lru[(layer, expert)] = slot
                self.stats.misses += 1
                self.stats.staged_bytes += layout.nbytes
            slots[expert] = slot
        return ExpertBank(layout, self.pool, slots.to(self.device, non_blocking=True))
