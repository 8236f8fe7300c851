"""The adaptive GPU expert cache: the arena's uniform slots, refilled between steps with hot experts.

Inside a step the store counts uses per (layer, expert) on the device. Around each step the
cache never waits for the device's work:
1. before launching a step it switches in finished promotions (their table entries now point at
   their slots) and marks the end of the steps queued so far;
2. right after launching it, once the steps before the previous one are done (a decode loop that
   reads each token one step behind has waited for them), it reads the counts (80 KB for the full
   model, on a side stream) and updates the stats (hits, PCIe bytes) and the policy
   (`planner.cache_policy`); when no promotion is in flight it picks up to `limit` hot experts to
   bring in and the cold ones they replace;
3. it evicts those: their table entries go back to their host records, in stream order after the
   step just launched; then the copy stream, once the compute stream passes that point, copies the
   promoted records into the freed slots while the following step runs.
All of this host work overlaps the step just launched. A step only ever reaches a slot through the
table after its copy completed, and a slot is overwritten only after every step that could read
its old record. Counts up to step N promote experts that serve from step N+3 or N+4 on. On the CPU all
of it happens at once, after each forward.
"""

from __future__ import annotations

from collections import deque

import numpy as np
import torch

from ninfer_offload.planner.cache_policy import make_policy, plan_promotions
from ninfer_offload.planner.cache_split import PROMOTIONS_PER_STEP as DEFAULT_PROMOTIONS
from ninfer_offload.planner.request import DEFAULT_CACHE_POLICY as DEFAULT_POLICY


class ExpertCache:
    """Cache slots of one `ExpertStore` and the policy that fills them."""

    def __init__(self, store, policy: str = DEFAULT_POLICY, limit: int = DEFAULT_PROMOTIONS):
        self.store = store
        self.policy = make_policy(policy, store.placement.scores)
        self.limit = limit
        layers, experts = store.pinned.shape
        self.cached = np.zeros((layers, experts), dtype=bool)
        self.owner: list[tuple[int, int] | None] = [None] * store.cache_slots
        self.free = list(range(store.cache_slots - 1, -1, -1))
        self.nbytes = np.array([layout.nbytes for layout in store.layouts], dtype=np.int64)
        self._seen = np.zeros((4, layers, experts), dtype=np.int64)  # the store's counts: uses, shared uses, CPU uses, staged records
        self._cuda = store.device.type == "cuda"
        self._inflight: tuple[list[tuple[int, int, int]], object] | None = None  # ((layer, expert, slot)...), done event
        self._boundaries: deque = deque(maxlen=2)  # events at the last two step boundaries (after the steps queued by then)
        if self._cuda:
            self._copy_stream = torch.cuda.Stream(store.device)
            self._count_stream = torch.cuda.Stream(store.device)
            self._snapshot = torch.empty(4, layers, experts, dtype=torch.int32, pin_memory=True)

    @property
    def in_vram(self) -> np.ndarray:
        """bool [layers, experts]: pinned or in a cache slot now."""
        return self.store.pinned | self.cached

    # ------------------------------------------------------------------ loading
    def fill_initial(self) -> None:
        """Fill the slots with the highest-scoring experts that are not pinned (the plan's ranking)."""
        scores = np.where(self.store.pinned, -np.inf, self.store.placement.scores)
        order = np.argsort(-scores, axis=None, kind="stable")[: len(self.free)]
        moves = []
        for flat in order:
            layer, expert = divmod(int(flat), scores.shape[1])
            if not np.isfinite(scores[layer, expert]):
                break
            moves.append((layer, expert, self.free.pop()))
        self._copy(moves)
        self._switch_in(moves)

    # ------------------------------------------------------------------ step boundary
    def before_step(self) -> None:
        """Switch in finished promotions and mark where the steps queued so far end."""
        if not self._cuda:
            return
        if self._inflight is not None and self._inflight[1].query():
            moves, self._inflight = self._inflight[0], None
            self._switch_in(moves)
        self._boundaries.append(torch.cuda.Event())
        self._boundaries[-1].record()

    def after_launch(self) -> None:
        """With the next step launched, read the counts (an 80 KB copy on a side stream) once the steps before
        the previous one are done (a loop reading each token one step behind has waited for them) and act on
        them, while the device runs the steps queued."""
        if not self._cuda:
            self.refresh()
            return
        if not self._boundaries or not self._boundaries[0].query():
            return  # the host is further ahead of the device: catch up at a later boundary
        with torch.cuda.stream(self._count_stream):
            self._snapshot.copy_(self.store.counts, non_blocking=True)
            done = torch.cuda.Event()
            done.record()
        done.synchronize()
        self._observe(self._snapshot.numpy().astype(np.int64))

    def refresh(self) -> None:
        """Fold the counts of every step run so far into the stats (waits for the device)."""
        self._observe(self.store.counts.cpu().numpy().astype(np.int64))

    def _observe(self, total: np.ndarray) -> None:
        """Fold the store's counts `total` [4, layers, experts] (uses, uses that read no record of their own, CPU uses,
        staged records) into the stats and the policy."""
        (delta, shared, on_host, records), self._seen = total - self._seen, total
        if not delta.any() and not records.any():
            return
        stats, in_vram = self.store.counters, self.in_vram
        stats.tokens += int(delta[0].sum()) // self.store.top_k
        stats.uses += int(delta.sum())
        stats.hits += int(delta[in_vram].sum())
        stats.cpu_assignments += int(on_host.sum())
        # one read per assignment of an expert not in VRAM that reads its record (not staged, not computed by the host,
        # not following another in a prefill block), one per staged record
        reads = np.where(in_vram, 0, delta - shared - on_host) + records
        stats.pcie_bytes += int((reads.sum(axis=1) * self.nbytes).sum())
        stats.staged += int(records.sum())
        self.policy.observe(delta)
        if self.policy.adaptive and self._inflight is None and self.limit > 0:
            promote, evict = plan_promotions(self.policy.scores(), self.cached, self.store.pinned, len(self.free), self.limit)
            if promote:
                self._start(promote, evict)

    def _start(self, promote: list[tuple[int, int]], evict: list[tuple[int, int]]) -> None:
        """Evict `evict` (table back to host records), then copy `promote` into the freed slots."""
        self.store.counters.promotions += len(promote)
        slots = []
        for layer, expert in evict:
            slot = self.owner.index((layer, expert))
            self.owner[slot] = None
            self.cached[layer, expert] = False
            slots.append(slot)
        self.store.write_table([(layer, expert, self.store.host_offset(layer, expert)) for layer, expert in evict])
        while len(slots) < len(promote):
            slots.append(self.free.pop())
        moves = [(layer, expert, slot) for (layer, expert), slot in zip(promote, slots)]
        if not self._cuda:
            self._copy(moves)
            self._switch_in(moves)
            return
        evicted = torch.cuda.Event()
        evicted.record()
        with torch.cuda.stream(self._copy_stream):
            self._copy_stream.wait_event(evicted)
            self._copy(moves)
            done = torch.cuda.Event()
            done.record(self._copy_stream)
        self._inflight = (moves, done)

    def _copy(self, moves: list[tuple[int, int, int]]) -> None:
        store = self.store
        for layer, expert, slot in moves:
            at, nbytes = store.slot_offset(slot), int(self.nbytes[layer])
            store.arena[at : at + nbytes].copy_(store.host[layer][expert], non_blocking=True)

    def _switch_in(self, moves: list[tuple[int, int, int]]) -> None:
        for layer, expert, slot in moves:
            self.owner[slot] = (layer, expert)
            self.cached[layer, expert] = True
        self.store.write_table([(layer, expert, self.store.slot_offset(slot)) for layer, expert, slot in moves])

    def close(self) -> None:
        if self._cuda and self._inflight is not None:
            self._inflight[1].synchronize()
