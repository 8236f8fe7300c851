"""Where each routed expert's record lives, and how the MoE layers reach it.

One device arena holds the records in VRAM: first the pinned experts (the plan's, never moved),
packed per layer, then `cache_slots` uniform slots of the adaptive cache (`runtime.expert_cache`),
then, when experts are offloaded, `staging_slots` slots for prefill (below).
Every expert that is not pinned also has a record in the host pool (pinned host memory on CUDA,
mapped into the device's address space). Per layer a device table maps expert -> byte offset from
the arena's start: into the arena for an expert in VRAM, to its host record otherwise, which the
MoE kernels then read over PCIe (zero-copy). Routing never leaves the device, so an offloaded step
is one CUDA graph like a resident one; "resident" (everything pinned) and "host" (nothing pinned)
are the two ends of the same mechanism.

Inside a step only uses per (layer, expert) are counted, on the device, by the op that computes the
experts (`ExpertBank.uses`: the decode MoE kernel in its own launch); between steps the cache reads the
counts and moves records (`around_step`).

A prefill chunk of the target (a step context with `StepContext.staged`, never captured) copies the
host experts its layers need into the staging slots first (`runtime.prefill_staging`). Decode steps
never stage. The step's context is the one place the store reads what kind of step it is in: the
compute (`routed`) and the bookkeeping around the step (`around_step`) both take it.

With a miss path ("cpu" or "auto", `cpu_experts.CpuMissPath`), a forward of at most
`miss_handoff.HANDOFF_TOKENS` tokens that is not staged hands the assignments of experts not in
VRAM (those the path's `take` mask gives the host and at most its `host_max_uses` rows use) to a
host worker through a mailbox in pinned memory and computes the others on the device meanwhile
(a batch's experts many rows use cross the link once); the host's rows are added after. Routing
still never goes to the host, so these steps are captured too. Each host expert counts on the
device as a CPU assignment, not a PCIe read; a host assignment becomes a zero-weight use of the
layer's `anchor`, an expert in VRAM.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field

import numpy as np
import torch

from ninfer_offload.artifact.records import ExpertRecordLayout, RecordLayout
from ninfer_offload.errors import NinferError
from ninfer_offload.model.backend import SharedExpert
from ninfer_offload.model.context import StepContext
from ninfer_offload.model.experts import RECORD_ALIGN, ExpertBank, count_uses
from ninfer_offload.runtime.expert_cache import DEFAULT_POLICY, ExpertCache
from ninfer_offload.runtime.host_pool import HostPool
from ninfer_offload.runtime.memory_check import host_tensor
from ninfer_offload.runtime.prefill_staging import PrefillStaging
from ninfer_offload.runtime.step_inputs import upload
from ninfer_offload.runtime.trace_routing import SequenceTraceRouting

MISS_PATHS = (None, "cpu", "auto")
ALIGN = RECORD_ALIGN  # record offsets are multiples of this (the MoE kernels' 16-byte vector loads rely on it)


@dataclass(frozen=True)
class ExpertPlacement:
    """Which experts of each MoE layer are pinned in VRAM, and the size of the adaptive cache."""

    pinned: list[list[int]]  # per layer, expert ids kept in VRAM for good
    cache_slots: int  # uniform VRAM slots the cache fills and refills
    scores: np.ndarray  # float [layers, experts]: expected uses per token (the plan's ranking)
    staging_slots: int = 0  # VRAM slots a prefill chunk copies its host experts into (`ExpertStore.routed`)

    @classmethod
    def resident(cls, layers: int, experts: int) -> "ExpertPlacement":
        return cls([list(range(experts)) for _ in range(layers)], 0, np.ones((layers, experts)))

    @property
    def offloaded(self) -> bool:
        return any(len(ids) < self.scores.shape[1] for ids in self.pinned)


@dataclass
class StoreStats:
    tokens: int = 0  # tokens routed (each through every MoE layer)
    steps: int = 0  # forwards of the target launched (prompt pieces and decode steps)
    uses: int = 0  # (token, expert) assignments routed
    hits: int = 0  # of them to an expert in VRAM
    pcie_bytes: int = 0  # record bytes read from host memory by the device (per assignment, per prefill block, per staged record)
    promotions: int = 0
    staged: int = 0  # records copied into the prefill staging slots
    cpu_assignments: int = 0  # assignments the host computed (CPU miss path)
    miss_path: dict = field(default_factory=dict)  # the CPU miss path's work and its tuner

    @property
    def hit_rate(self) -> float:
        return self.hits / self.uses if self.uses else 1.0

    def to_json(self) -> dict:
        per_token, per_step = max(self.tokens, 1), max(self.steps, 1)
        return {
            "hit_rate": round(self.hit_rate, 6),
            "pcie_bytes_per_token": round(self.pcie_bytes / per_token),
            "pcie_bytes_per_step": round(self.pcie_bytes / per_step),
            "cpu_assignments_per_step": round(self.cpu_assignments / per_step, 3),
            "promotions_per_token": round(self.promotions / per_token, 3),
            "tokens": self.tokens,
            "steps": self.steps,
            "uses": self.uses,
            "hits": self.hits,
            "pcie_bytes": self.pcie_bytes,
            "promotions": self.promotions,
            "staged": self.staged,
            "cpu_assignments": self.cpu_assignments,
            **({"miss_path": self.miss_path} if self.miss_path else {}),
        }


HOST_REMEDY = "give a larger --vram-budget (fewer experts on the host)"


def _align(n: int) -> int:
    return -(-n // ALIGN) * ALIGN


class ExpertStore:
    """Routed-expert records of every MoE layer (text layers first, then the MTP layer if loaded).

    Built empty; the loader hands each layer's records to `fill` (host records [E, nbytes] in the
    buffer `host_buffer(layer)` gave it), which copies the pinned ones into the arena and keeps the
    buffer as the layer's host records when experts are offloaded.
    """

    def __init__(
        self,
        layouts: list[RecordLayout],
        hidden: int,
        num_experts: int,
        top_k: int,
        placement: ExpertPlacement,
        device: torch.device,
        miss_path: str | None = None,
        cache_policy: str = DEFAULT_POLICY,
        *,
        text_layers: int,
    ):
        if miss_path not in MISS_PATHS:
            raise NinferError(f"miss path must be pcie, cpu or auto (--miss-path; miss_path=None, 'cpu' or 'auto'), got {miss_path!r}")
        if miss_path is not None and not placement.offloaded:
            raise NinferError(f"--miss-path {miss_path}: a miss path needs host-resident experts; add --experts host or a --vram-budget")
        self.layouts = layouts
        self.text_layers = text_layers  # the layers a prefill chunk runs (the MTP layer, after them, never does)
        self.num_experts = num_experts
        self.top_k = top_k
        self.placement = placement
        self.device = device
        self.miss_path = miss_path
        self.counters = StoreStats()  # updated at step boundaries; `stats` brings them up to date
        layers = len(layouts)
        self.pinned = np.zeros((layers, num_experts), dtype=bool)
        self.pinned_offset = np.full((layers, num_experts), -1, dtype=np.int64)
        at = 0
        for layer, ids in enumerate(placement.pinned):
            for e in sorted(ids):  # ascending, so that `fill` copies a layer's pinned records as one span
                self.pinned[layer, e] = True
                self.pinned_offset[layer, e] = at
                at += _align(layouts[layer].nbytes)
        self.slot_bytes = _align(max(layout.nbytes for layout in layouts))
        self.cache_start = at
        self.cache_slots = placement.cache_slots
        self.staging_slots = placement.staging_slots
        slots = self.cache_slots + self.staging_slots
        self.arena = torch.empty(at + slots * self.slot_bytes, dtype=torch.uint8, device=device)
        self.host: list[torch.Tensor] = []  # per layer, every expert's record, when experts are offloaded (filled by `fill`)
        sizes = [num_experts * layout.nbytes for layout in layouts]
        self._pool = HostPool(sizes, device.type == "cuda", HOST_REMEDY) if placement.offloaded else None  # pinned on CUDA
        self.table = torch.zeros(layers, num_experts, dtype=torch.int64, device=device)
        self.table_host = np.zeros((layers, num_experts), dtype=np.int64)  # what `table` holds after the work queued so far
        # Per (layer, expert): assignments routed, those of them that read no record of their own (served from a
        # staging slot, or after the first of a prefill block's assignments of a host expert: the block reads the
        # record once), those computed by the host, and records staged.
        self.counts = torch.zeros(4, layers, num_experts, dtype=torch.int32, device=device)
        self.uses, self.shared_uses, self.cpu_uses, self.staged_records = self.counts
        self.anchor = torch.zeros(layers, 1, dtype=torch.int64, device=device)  # per layer an expert in VRAM (`set_anchors`)
        self._stale_anchors = False  # cache moves not yet reflected in `anchor` (`tables_changed`)
        # Benchmark hook (`replay_routing`): routing ids replayed instead of the router's. Not a step's mode: it holds
        # for every step from when it is set, and a captured step reads the tensor it had at capture.
        self.replayed: torch.Tensor | None = None
        self.trace_routing: SequenceTraceRouting | None = None  # benchmark hook (`route_by_trace`): each row by its sequence
        self.cpu_path = None
        if miss_path is not None:
            from ninfer_offload.runtime.cpu_experts import CpuMissPath

            self.cpu_path = CpuMissPath(miss_path, layouts, num_experts, top_k, hidden, device, self.host, placement.scores)
        self.cache = ExpertCache(self, cache_policy) if placement.offloaded else None
        if self.cpu_path is not None:
            self.set_anchors(self.pinned, range(layers))
        self.staging = PrefillStaging(self) if self.staging_slots else None

    @property
    def capturable(self) -> bool:
        """Whether a step can be captured as a CUDA graph: lossless records (computed by the reference
        op, which indexes records) cannot be read from host memory."""
        return not self.offloaded or all(isinstance(x, ExpertRecordLayout) for x in self.layouts)

    @property
    def graph_variant(self) -> tuple:
        """What distinguishes the captured steps of this store: whether they hand misses to the host
        (a CPU miss path whose host share is not zero records the hand-off kernels; with share zero the
        step is the plain one)."""
        return ("handoff",) if self.cpu_path is not None and self.cpu_path.active else ()

    def set_anchors(self, in_vram: np.ndarray, layers) -> None:
        """Point `anchor[layer]` of `layers` at an expert in VRAM (`in_vram` [layers, experts]; expert 0
        where none is), in stream order after the queued steps."""
        index, values = self.upload(
            torch.tensor(list(layers), dtype=torch.int64),
            torch.tensor([[int(np.argmax(in_vram[layer]))] for layer in layers], dtype=torch.int64),
        )
        self.anchor.index_copy_(0, index, values)

    def tables_changed(self, layers: list[int]) -> None:
        """The cache moved experts of `layers`: with a CPU path, re-point their anchors now if it takes a
        share, else all of them before the next step that takes one (no host work per step while it takes none)."""
        if self.cpu_path is None:
            return
        if self.cpu_path.active:
            self.set_anchors(self.cache.in_vram, layers)
        else:
            self._stale_anchors = True

    def upload(self, *tensors: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """Small host tensors on the store's device, in stream order (through pinned memory, without a
        host sync, on CUDA): the table and anchor updates between steps."""
        return tuple(upload(t, self.device) for t in tensors)

    @property
    def stats(self) -> StoreStats:
        """Hit rate, PCIe bytes, promotions... up to the last step run (waits for it on CUDA)."""
        if self.cache is not None:
            self.cache.refresh()
        if self.cpu_path is not None:
            self.counters.miss_path = self.cpu_path.stats()
        return self.counters

    @property
    def offloaded(self) -> bool:
        return self.placement.offloaded

    @property
    def nbytes(self) -> int:
        """Bytes of all records (whatever memory holds them)."""
        return sum(layout.nbytes for layout in self.layouts) * self.num_experts

    # ------------------------------------------------------------------ loading
    def host_buffer(self, layer: int) -> torch.Tensor:
        """Host memory for the loader to pack layer `layer`'s records into (pinned on CUDA, so that `fill`
        copies to the device asynchronously): it becomes the layer's host records when experts are
        offloaded (inside the host pool). Allocated by the packing threads, so page-locking overlaps reading the file."""
        shape = (self.num_experts, self.layouts[layer].nbytes)
        if self._pool is not None:
            return self._pool.layer(layer).view(shape)
        return host_tensor(shape, torch.uint8, self.device.type == "cuda", "expert records", HOST_REMEDY)

    def fill(self, layer: int, records: torch.Tensor) -> None:
        """Copy the pinned experts of `layer` (layers in order) from its packed host records into the arena
        and point the table at them; every other expert at its host record, kept when experts are offloaded."""
        if self.offloaded:
            self.host.append(records)
        nbytes = self.layouts[layer].nbytes
        offsets = torch.empty(self.num_experts, dtype=torch.int64)
        ids = np.flatnonzero(self.pinned[layer])
        if ids.size:
            first, stride = int(self.pinned_offset[layer, ids[0]]), _align(nbytes)
            span = self.arena[first : first + ids.size * stride].view(ids.size, stride)[:, :nbytes]
            breaks = (np.flatnonzero(np.diff(ids) != 1) + 1).tolist()
            for start, end in zip([0, *breaks], [*breaks, ids.size]):  # one copy per run of consecutive ids
                e0 = int(ids[start])
                # the caching host allocator keeps the pinned records until the copy is done
                span[start:end].copy_(records[e0 : e0 + end - start], non_blocking=True)
        for e in range(self.num_experts):
            offsets[e] = self.pinned_offset[layer, e] if self.pinned[layer, e] else self.host_offset(layer, e)
        self.table[layer].copy_(offsets)
        self.table_host[layer] = offsets.numpy()

    def write_table(self, entries: list[tuple[int, int, int]]) -> None:
        """Point table entries (layer, expert) at new offsets, in stream order after the queued steps."""
        if not entries:
            return
        layers, experts, offsets = (np.array(column, dtype=np.int64) for column in zip(*entries))
        self.table_host[layers, experts] = offsets
        index, values = self.upload(torch.from_numpy(layers * self.num_experts + experts), torch.from_numpy(offsets))
        self.table.view(-1).index_copy_(0, index, values)
        self.tables_changed(sorted(set(layers.tolist())))

    def host_offset(self, layer: int, expert: int) -> int:
        """Offset from the arena's start of `expert`'s host record (an address difference)."""
        offset = self.host[layer][expert].data_ptr() - self.arena.data_ptr()
        if self.device.type == "cuda" and offset % ALIGN:
            raise NinferError(f"host records are not {ALIGN}-byte aligned (offset {offset}); cannot map them for the device")
        return offset

    def slot_offset(self, slot: int) -> int:
        return self.cache_start + slot * self.slot_bytes

    def staging_offset(self, slot: int) -> int:
        """Offset of prefill staging slot `slot` (after the cache slots)."""
        return self.slot_offset(self.cache_slots + slot)

    # ------------------------------------------------------------------ compute
    def bank(self, layer: int, counted: bool = False) -> ExpertBank:
        """Layer `layer`'s experts as the compute reaches them; `counted`: the op counts its assignments into the store's
        uses and shared uses (the cache's statistics)."""
        uses, shared_uses = (self.uses[layer], self.shared_uses[layer]) if counted else (None, None)
        host = self.host[layer] if self.offloaded else None
        return ExpertBank(self.layouts[layer], self.arena, self.table[layer], host, uses, shared_uses)

    def routed(
        self, backend, layer: int, x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor,
        shared: SharedExpert | None = None, ctx: StepContext | None = None,
    ) -> torch.Tensor:
        """sum_j w[t, j] * expert_{ids[t, j]}(x[t]) for layer `layer` -> [T, H], plus `shared`'s rows when given
        (with the routed experts where the backend can, after them otherwise). In a staged step (`ctx.staged`,
        inside `around_step` of that context) the layer's host experts are read from the staging slots."""
        if self.replayed is not None:
            first = 0 if ctx is None else ctx.span_row
            topk_ids = self.replayed[layer, first : first + topk_ids.shape[0]]
        elif self.trace_routing is not None and ctx is not None and layer < self.trace_routing.layers:
            topk_ids = self.trace_routing.ids(layer, ctx)
        staged = ctx is not None and ctx.staged
        span = (ctx.stage_tokens or topk_ids.shape[0]) if staged else 0
        if staged and self.staging is not None and self.staging.takes(span):
            bank, later = self.staging.bank(layer, topk_ids, span)  # (it counts the uses too)
            if self.staging.takes(topk_ids.shape[0]):
                out = backend.routed_experts_split(x, topk_ids, topk_weights, bank, later, self.staging.wait)
            else:  # a span's short last chunk: the span's first chunk waited for the layer's staged experts
                self.staging.wait()
                out = backend.routed_experts(x, topk_ids, topk_weights, bank)
            if ctx.span_row + topk_ids.shape[0] == span:  # the span's last chunk: the layer's buffer goes on
                self.staging.done(layer, span)
            return out if shared is None else shared.added_to(backend, out)
        counted = self.cache is not None  # counted by the op that computes the experts
        if self.cpu_path is not None and self.cpu_path.active and topk_ids.shape[0] <= self.cpu_path.tokens:
            if counted:  # here: the CPU path hands the GPU only some of the assignments (the op counts its shared reads)
                count_uses(self.uses[layer], topk_ids)
            bank = dataclasses.replace(self.bank(layer, counted), uses=None)
            anchor, cpu_uses = self.anchor[layer], self.cpu_uses[layer]
            out = self.cpu_path.routed(backend, bank, layer, x, topk_ids, topk_weights, anchor, cpu_uses)
            return out if shared is None else shared.added_to(backend, out)
        return backend.routed_experts(x, topk_ids, topk_weights, self.bank(layer, counted), shared)

    def replay_routing(self, ids: torch.Tensor) -> None:
        """Benchmarks and tests: route the next forwards' tokens to `ids` [layers, tokens, top_k] (int64)
        instead of the router's choice (the router's weights stay; a prefill span's chunks by their rows in the
        span, `StepContext.span_row`). Updated in place, so a captured step
        replays whatever was set last; the first call fixes the most tokens. Set it before the first step:
        graphs captured without it ignore it."""
        if self.replayed is None:
            self.replayed = torch.zeros_like(ids, device=self.device)
        self.replayed[:, : ids.shape[1]].copy_(ids, non_blocking=True)

    def route_by_trace(self, routing: SequenceTraceRouting) -> None:
        """Benchmarks and tests: route every later forward's rows by their own sequence's stretch of a routing trace
        (`runtime.trace_routing`) instead of the router's choice. Set it before the first step: graphs captured
        without it ignore it."""
        self.trace_routing = routing

    @contextmanager
    def around_step(self, tokens: int, ctx: StepContext | None = None) -> Iterator[None]:
        """Wraps the launch of one step of the target: cache bookkeeping due before it, then the part that
        overlaps it (see `expert_cache`). `tokens`: the step's token rows (a staged chunk's size for the staging;
        the CPU miss path times the other steps per token). `ctx`: an eager step's context, whose `staged`
        (a prompt chunk) stages its host experts; None for the replay of a captured step, never staged."""
        staged = ctx is not None and ctx.staged
        self.counters.steps += 1
        if self.cache is not None:
            self.cache.before_step()
        mark = None
        if self.cpu_path is not None:
            mark = self.cpu_path.step_started(None if staged else tokens, self.cache.in_vram)
            if self._stale_anchors and self.cpu_path.active:
                self.set_anchors(self.cache.in_vram, range(len(self.layouts)))
                self._stale_anchors = False
        if staged and self.staging is not None:
            self.staging.begin(tokens)
        try:
            yield
        finally:
            if self.staging is not None:
                self.staging.forget()
        if self.cpu_path is not None:
            self.cpu_path.step_finished(mark)
        if self.cache is not None:
            self.cache.after_launch()

    def close(self) -> None:
        if self.cache is not None:
            self.cache.close()
        if self.cpu_path is not None:
            self.cpu_path.close()
