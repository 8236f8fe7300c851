"""Where each routed expert's record lives, and how the MoE layers reach it.

Mode "resident": every layer's records sit on the compute device; the bank's slot table is the
identity. Mode "host": records stay in host memory (pinned on CUDA) and the experts a call needs
are copied into a small device slot pool shared by all layers, least recently used evicted, with
hit/miss counts. Records are one contiguous span per expert, so staging an expert is one copy.

Staging needs the routing on the host (one sync per MoE layer); a call whose distinct experts do
not fit the pool is split into token chunks that do. Both modes run the same backend op on the
same record bytes, so they produce identical outputs.

`host_output` is the seam of the CPU miss path: the routed output of selected assignments,
computed on the host straight from the host records.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass

import torch

from ninfer_offload.errors import NinferError
from ninfer_offload.model.backend import ReferenceBackend
from ninfer_offload.model.experts import ExpertBank, RecordLayout

MODES = ("resident", "host")
MISS_PATHS = (None, "cpu")


@dataclass
class StoreStats:
    hits: int = 0
    misses: int = 0
    staged_bytes: int = 0
    cpu_assignments: int = 0


class ExpertStore:
    """Routed-expert records of every MoE layer (text layers first, then the MTP layer if loaded)."""

    def __init__(
        self,
        layouts: list[RecordLayout],
        records: list[torch.Tensor],
        backend,
        device: torch.device,
        mode: str = "resident",
        num_slots: int | None = None,
        miss_path: str | None = None,
        top_k: int = 1,
    ):
        if mode not in MODES:
            raise NinferError(f"experts must be one of {', '.join(MODES)}, got {mode!r}")
        if miss_path not in MISS_PATHS:
            raise NinferError(f"miss path must be one of None, 'cpu', got {miss_path!r}")
        if miss_path is not None and mode != "host":
            raise NinferError("a miss path needs host-resident experts (experts='host')")
        self.layouts = layouts
        self.backend = backend
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
        self.host_backend = ReferenceBackend()
        self.num_slots = max(top_k, num_slots if num_slots is not None else self.num_experts // 4)
        width = max(layout.nbytes for layout in layouts)
        self.pool = torch.zeros(self.num_slots, width, dtype=torch.uint8, device=device)
        self.lru: OrderedDict[tuple[int, int], int] = OrderedDict()  # (layer, expert) -> slot, oldest first
        self.free = list(range(self.num_slots - 1, -1, -1))

    @property
    def nbytes(self) -> int:
        """Bytes of all records (whatever memory holds them)."""
        return sum(layout.nbytes for layout in self.layouts) * self.num_experts

    # ------------------------------------------------------------------ compute
    def routed(self, layer: int, x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor) -> torch.Tensor:
        """sum_j w[t, j] * expert_{ids[t, j]}(x[t]) for layer `layer` -> [T, H]."""
        if self.mode == "resident":
            return self.backend.routed_experts(x, topk_ids, topk_weights, self.banks[layer])
        if self.miss_path == "cpu":
            return self._routed_cpu_misses(layer, x, topk_ids, topk_weights)
        t = x.shape[0]
        distinct = int(torch.unique(topk_ids).numel())
        chunk = t if distinct <= self.num_slots else max(1, self.num_slots // self.top_k)
        outputs = []
        for t0 in range(0, t, chunk):
            ids = topk_ids[t0 : t0 + chunk]
            bank = self._stage(layer, sorted(set(ids.reshape(-1).tolist())))
            outputs.append(self.backend.routed_experts(x[t0 : t0 + chunk], ids, topk_weights[t0 : t0 + chunk], bank))
        return torch.cat(outputs)

    def _routed_cpu_misses(self, layer: int, x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor) -> torch.Tensor:
        """Experts already in a slot run on the device; the others run on the host (not staged)."""
        ids = topk_ids.cpu()
        in_slot = torch.zeros(self.num_experts, dtype=torch.bool)
        in_slot[[expert for (lyr, expert) in self.lru if lyr == layer]] = True
        hit = in_slot[ids]
        self.stats.misses += int(torch.unique(ids[~hit]).numel())
        self.stats.cpu_assignments += int((~hit).sum())
        out = self.host_output(layer, x, topk_ids, topk_weights, ~hit)
        if bool(hit.any()):
            bank = self._stage(layer, sorted(set(ids[hit].tolist())))
            on_device = topk_weights * hit.to(device=x.device, dtype=topk_weights.dtype)
            out = out + self.backend.routed_experts(x, topk_ids, on_device, bank)
        return out

    def host_output(
        self, layer: int, x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor, selected: torch.Tensor
    ) -> torch.Tensor:
        """Routed output [T, H] (on x's device) of the assignments where `selected` [T, k] is true,
        computed on the host from the host records (the CPU miss path)."""
        bank = ExpertBank(self.layouts[layer], self.host[layer], torch.arange(self.num_experts))
        weights = topk_weights.cpu() * selected.cpu().to(topk_weights.dtype)
        return self.host_backend.routed_experts(x.cpu(), topk_ids.cpu(), weights, bank).to(x.device)

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
