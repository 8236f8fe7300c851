"""Expert cache policies and the promotion decision, shared by the runtime cache and the simulator.

A policy turns routing observations into scores, float [layers, experts]: higher means more worth
a VRAM cache slot. Every policy starts from the plan's ranking (expected hits per token of each
(layer, expert)), so cold start and ties follow the plan. A score of `-inf` means "never used and
never ranked": such an expert is never promoted, not even into a free slot.

`plan_promotions` compares the best uncached experts with the coldest cached ones and returns
what to copy in and what to drop; pinned experts (resident per the plan) are never touched.
"""

from __future__ import annotations

import numpy as np

from ninfer_offload.errors import NinferError

POLICIES = ("static", "lru", "decayed", "batch")


class CachePolicy:
    """Scores of every (layer, expert); `adaptive` is False for a policy that never promotes."""

    adaptive = True
    name = ""

    def __init__(self, initial: np.ndarray) -> None:
        self.initial = np.asarray(initial, dtype=np.float64).copy()

    def observe(self, uses: np.ndarray) -> None:
        """Takes the routing counts [layers, experts] since the previous observation."""
        raise NotImplementedError

    def scores(self) -> np.ndarray:
        raise NotImplementedError


class StaticPolicy(CachePolicy):
    """The plan's ranking, forever: nothing is ever promoted."""

    adaptive = False
    name = "static"

    def observe(self, uses: np.ndarray) -> None:
        pass

    def scores(self) -> np.ndarray:
        return np.where(self.initial > 0, self.initial, -np.inf)


class LruPolicy(CachePolicy):
    """Score = index (from 1) of the last observation that used the expert, plus a tie-break in [0, 1)
    from the plan's ranking; experts never used score their tie-break alone (-inf when unranked)."""

    name = "lru"

    def __init__(self, initial: np.ndarray) -> None:
        super().__init__(initial)
        rank = np.maximum(self.initial, 0.0)
        self._tiebreak = rank / (1.0 + rank)
        self._cold = np.where(rank > 0, self._tiebreak, -np.inf)
        self._last = np.zeros(self.initial.shape, dtype=np.int64)
        self._clock = 0

    def observe(self, uses: np.ndarray) -> None:
        self._clock += 1
        self._last[np.asarray(uses) > 0] = self._clock

    def scores(self) -> np.ndarray:
        return np.where(self._last > 0, self._last + self._tiebreak, self._cold)


class DecayedFrequencyPolicy(CachePolicy):
    """Score = score * decay + uses, per observation; it starts at the plan's steady state,
    initial / (1 - decay), the value one observation per token at the planned rate converges to."""

    name = "decayed"

    def __init__(self, initial: np.ndarray, decay: float = 0.9) -> None:
        super().__init__(initial)
        if not 0.0 <= decay < 1.0:
            raise NinferError(f"cache policy decay must be in [0, 1), got {decay}")
        self.decay = decay
        self._score = np.maximum(self.initial, 0.0) / (1.0 - decay)
        self._seen = self.initial > 0

    def observe(self, uses: np.ndarray) -> None:
        uses = np.asarray(uses)
        self._score *= self.decay
        self._score += uses
        self._seen |= uses > 0

    def scores(self) -> np.ndarray:
        return np.where(self._seen, self._score, -np.inf)


class BatchPolicy(DecayedFrequencyPolicy):
    """Decayed frequency of each step's uses blended with what the plan expects of a step that size: per
    observation score = score * decay + uses + prior * rows * initial, where uses counts, per expert, the rows
    (in a decode step, the sequences) of the step that routed to it and rows = the step's uses / the plan's
    picks per token. The plan's share grows with the batch, so the rarely seen experts of a wide step are
    ranked by the plan's rate more than by the few steps the decay remembers; one sequence gets the same blend
    (prior 2: the best of 1, 2, 4, 8 on the simulator's seed-0 batch traces of 1 and 8 sequences)."""

    name = "batch"

    def __init__(self, initial: np.ndarray, decay: float = 0.9, prior: float = 2.0) -> None:
        super().__init__(initial, decay)
        self.prior = prior
        self._rate = np.maximum(self.initial, 0.0)
        self._picks = self._rate.sum()  # picks per token of every layer together, as the plan expects them

    def observe(self, uses: np.ndarray) -> None:
        uses = np.asarray(uses)
        rows = uses.sum() / self._picks if self._picks > 0 else 0.0
        super().observe(uses + self.prior * rows * self._rate)


def make_policy(name: str, initial: np.ndarray) -> CachePolicy:
    """The policy called `name` (one of POLICIES), starting from the plan's ranking `initial`."""
    kinds = {"static": StaticPolicy, "lru": LruPolicy, "decayed": DecayedFrequencyPolicy, "batch": BatchPolicy}
    if name not in kinds:
        raise NinferError(f"unknown cache policy {name!r}: choose one of {', '.join(POLICIES)}")
    return kinds[name](initial)


def _best_first(flat_scores: np.ndarray, candidates: np.ndarray, count: int, descending: bool) -> np.ndarray:
    """The `count` best (or coldest) flat indices among `candidates`, in order, ties by index."""
    if count <= 0 or candidates.size == 0:
        return candidates[:0]
    keys = -flat_scores[candidates] if descending else flat_scores[candidates]
    if count < candidates.size:
        keep = keys <= np.partition(keys, count - 1)[count - 1]  # every tie at the boundary, for the index order
        candidates, keys = candidates[keep], keys[keep]
    return candidates[np.lexsort((candidates, keys))[:count]]


def plan_promotions(
    scores: np.ndarray, cached: np.ndarray, pinned: np.ndarray, free_slots: int, limit: int, margin: float = 0.0
) -> tuple[list[tuple[int, int]], list[tuple[int, int]]]:
    """(promote, evict): at most `limit` (layer, expert) pairs to copy in, best score first, and the
    cached victims they replace, coldest first.

    Candidates are neither cached nor pinned and score above -inf. The first `free_slots` of them
    take free slots; each further one replaces the coldest remaining unpinned cached expert if its
    score beats the victim's by more than `margin`. So len(evict) == max(0, len(promote) - free_slots).
    """
    experts = scores.shape[1]
    flat = scores.ravel()
    cached, pinned = np.asarray(cached, dtype=bool).ravel(), np.asarray(pinned, dtype=bool).ravel()
    candidates = np.flatnonzero(~cached & ~pinned & (flat > -np.inf))
    evictable = np.flatnonzero(cached & ~pinned)
    free = max(free_slots, 0)
    # Beyond the free slots, only a candidate that beats the coldest victim can get in.
    floor = flat[evictable].min() + margin if evictable.size else np.inf
    useful = free + int(np.count_nonzero(flat[candidates] > floor))
    promote = _best_first(flat, candidates, min(limit, useful), descending=True)
    free = min(free, promote.size)
    victims = _best_first(flat, evictable, promote.size - free, descending=False)
    contenders = promote[free : free + victims.size]
    # Both lists are sorted (contenders hottest first, victims coldest first): the swaps that pay are a prefix.
    wins = flat[contenders] > flat[victims] + margin
    swaps = int(np.argmin(wins)) if not wins.all() else wins.size
    promote, evict = promote[: free + swaps], victims[:swaps]
    return _pairs(promote, experts), _pairs(evict, experts)


def _pairs(flat_indices: np.ndarray, experts: int) -> list[tuple[int, int]]:
    return [(int(i) // experts, int(i) % experts) for i in flat_indices]
