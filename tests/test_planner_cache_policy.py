"""Cache policies and the promotion decision: recency, frequency, the static plan, slots, pins, limits, margins."""

from __future__ import annotations

import numpy as np
import pytest

from ninfer_offload.errors import NinferError
from ninfer_offload.planner.cache_policy import (
    BatchPolicy,
    POLICIES,
    DecayedFrequencyPolicy,
    LruPolicy,
    StaticPolicy,
    make_policy,
    plan_promotions,
)


def uses_of(*experts: int, layers: int = 1, num_experts: int = 6) -> np.ndarray:
    uses = np.zeros((layers, num_experts), dtype=np.int64)
    for e in experts:
        uses[0, e] += 1
    return uses


def mask(*experts: int, num_experts: int = 6) -> np.ndarray:
    m = np.zeros((1, num_experts), dtype=bool)
    m[0, list(experts)] = True
    return m


def naive_promotions(scores, cached, pinned, free_slots, limit, margin):
    """The decision spelled out item by item: the oracle for `plan_promotions`."""
    experts = scores.shape[1]
    cells = [(layer, e) for layer in range(scores.shape[0]) for e in range(experts)]
    candidates = sorted(
        (c for c in cells if not cached[c] and not pinned[c] and scores[c] > -np.inf), key=lambda c: (-scores[c], c[0] * experts + c[1])
    )
    victims = sorted((c for c in cells if cached[c] and not pinned[c]), key=lambda c: (scores[c], c[0] * experts + c[1]))
    promote, evict, free = [], [], max(free_slots, 0)
    for c in candidates[:limit]:
        if free:
            free -= 1
        elif len(evict) < len(victims) and scores[c] > scores[victims[len(evict)]] + margin:
            evict.append(victims[len(evict)])
        else:
            break
        promote.append(c)
    return promote, evict


def test_make_policy_names_and_unknown_name():
    initial = np.ones((2, 4))
    assert POLICIES == ("static", "lru", "decayed", "batch")
    assert [type(make_policy(n, initial)) for n in POLICIES] == [StaticPolicy, LruPolicy, DecayedFrequencyPolicy, BatchPolicy]
    with pytest.raises(NinferError, match="unknown cache policy 'fifo': choose one of static, lru, decayed, batch"):
        make_policy("fifo", initial)


def test_static_policy_never_moves():
    initial = np.array([[0.5, 0.2, 0.0, 0.1]])
    policy = make_policy("static", initial)
    before = policy.scores()
    policy.observe(np.array([[0, 0, 9, 9]]))
    assert policy.adaptive is False
    np.testing.assert_array_equal(policy.scores(), before)
    assert before[0, 2] == -np.inf and before[0, 0] == 0.5


def test_lru_evicts_the_least_recently_used():
    policy = make_policy("lru", np.full((1, 6), 0.1))
    for experts in ((0, 1), (2,), (3,), (0,)):  # expert 1 was last used longest ago, then 2, then 3
        policy.observe(uses_of(*experts))
    policy.observe(uses_of(4))
    promote, evict = plan_promotions(policy.scores(), mask(0, 1, 2, 3), mask(), 0, 8)
    assert promote == [(0, 4)] and evict == [(0, 1)]


def test_lru_cold_start_and_ties_follow_the_plan():
    policy = LruPolicy(np.array([[0.3, 0.0, 0.1, 0.2]]))
    scores = policy.scores()
    assert scores[0, 0] > scores[0, 3] > scores[0, 2] > scores[0, 1] == -np.inf
    policy.observe(np.array([[1, 1, 1, 1]]))
    scores = policy.scores()
    assert scores.min() >= 1.0  # used in observation 1 beats every unused expert
    assert scores[0, 0] > scores[0, 3] > scores[0, 2] > scores[0, 1]


def test_decayed_frequency_prefers_the_frequent():
    initial = np.full((1, 6), 0.01)
    decayed, lru = DecayedFrequencyPolicy(initial, decay=0.9), LruPolicy(initial)
    for policy in (decayed, lru):
        for _ in range(5):
            policy.observe(uses_of(0))
        policy.observe(uses_of(1))
    # Expert 0: five uses, then one step of decay; expert 1: one use, the latest.
    assert decayed.scores()[0, 0] > decayed.scores()[0, 1]
    assert lru.scores()[0, 1] > lru.scores()[0, 0]
    expected = 0.01 / 0.1 * 0.9**6 + sum(0.9**k for k in range(1, 6))
    assert decayed.scores()[0, 0] == pytest.approx(expected)


def test_decayed_counts_every_use_of_an_observation():
    policy = DecayedFrequencyPolicy(np.zeros((1, 3)), decay=0.5)
    assert (policy.scores() == -np.inf).all()
    policy.observe(np.array([[4, 1, 0]]))  # one observation covering several steps
    np.testing.assert_allclose(policy.scores(), [[4.0, 1.0, -np.inf]])
    with pytest.raises(NinferError, match="decay"):
        DecayedFrequencyPolicy(np.zeros((1, 3)), decay=1.0)


def test_batch_policy_blends_each_step_with_the_plans_rate_for_its_rows():
    """Score = score x 0.9 + uses + 2 x rows x plan rate: over wide steps an expert the plan ranks high keeps its
    place against one a single sequence of each step picks, where plain decayed frequency forgets the plan."""
    initial = np.array([[1.0, 0.6, 0.4, 0.0]])  # 2 picks per token
    batch, decayed = make_policy("batch", initial), make_policy("decayed", initial)
    step = np.array([[7, 0, 1, 0]])  # 8 picks: a step of 4 rows (sequences) of 2
    start = batch.scores().copy()
    batch.observe(step)
    assert np.allclose(batch.scores(), start * 0.9 + step + 2 * 4 * initial)
    for _ in range(40):
        batch.observe(step)
        decayed.observe(step)
    assert batch.scores()[0, 1] > batch.scores()[0, 2] and decayed.scores()[0, 1] < decayed.scores()[0, 2]
    assert batch.scores()[0, 3] == -np.inf  # never used, never ranked


def test_promotions_respect_the_limit_best_first():
    scores = np.array([[5.0, 4.0, 3.0, 2.0, 1.0, 0.5]])
    promote, evict = plan_promotions(scores, mask(5), mask(), 0, 2)
    assert promote == [(0, 0)] and evict == [(0, 5)]  # one victim only
    promote, evict = plan_promotions(scores, mask(4, 5), mask(), 0, 1)
    assert promote == [(0, 0)] and evict == [(0, 5)]
    promote, evict = plan_promotions(scores, mask(4, 5), mask(), 10, 3)
    assert promote == [(0, 0), (0, 1), (0, 2)] and evict == []
    assert plan_promotions(scores, mask(4, 5), mask(), 10, 0) == ([], [])


def test_pinned_experts_are_never_promoted_nor_evicted():
    scores = np.array([[9.0, 8.0, 0.1, 0.2, 7.0, 0.0]])
    promote, evict = plan_promotions(scores, mask(2, 3), mask(0, 1), 0, 8)
    assert promote == [(0, 4)] and evict == [(0, 2)]
    # A pinned expert marked cached is still not a victim.
    promote, evict = plan_promotions(scores, mask(0, 2), mask(0), 0, 8)
    assert (0, 0) not in evict and evict == [(0, 2)]


def test_free_slots_need_no_victim_but_a_used_or_ranked_expert():
    scores = np.array([[-np.inf, 0.0, 3.0, -np.inf, 1.0, 2.0]])
    promote, evict = plan_promotions(scores, mask(5), mask(), 3, 8)
    assert promote == [(0, 2), (0, 4), (0, 1)] and evict == []  # -inf experts never fill a slot
    promote, evict = plan_promotions(scores, mask(5), mask(), 1, 8)
    assert promote == [(0, 2)] and evict == []  # 1.0 and 0.0 do not beat the cached 2.0


def test_margin_blocks_small_gains():
    scores = np.array([[1.0, 1.4, 2.0, 0.0, 0.0, 0.0]])
    assert plan_promotions(scores, mask(0), mask(), 0, 8, margin=0.5) == ([(0, 2)], [(0, 0)])
    assert plan_promotions(scores, mask(0), mask(), 0, 8, margin=1.0) == ([], [])
    assert plan_promotions(scores, mask(0, 1), mask(), 0, 8, margin=0.3) == ([(0, 2)], [(0, 0)])  # 0.0 does not beat 1.4


def test_evicts_exactly_what_the_free_slots_do_not_cover():
    rng = np.random.default_rng(7)
    for _ in range(200):
        layers, experts = rng.integers(1, 4), rng.integers(2, 12)
        scores = rng.choice([-np.inf, 0.0, 1.0, 2.0, 3.5, 5.0], size=(layers, experts)) + rng.random((layers, experts)) * rng.integers(0, 2)
        cached, pinned = rng.random((layers, experts)) < 0.4, rng.random((layers, experts)) < 0.2
        cached &= ~pinned
        free, limit, margin = int(rng.integers(-1, 4)), int(rng.integers(0, 6)), float(rng.choice([0.0, 0.5]))
        promote, evict = plan_promotions(scores, cached, pinned, free, limit, margin)
        assert (promote, evict) == naive_promotions(scores, cached, pinned, free, limit, margin)
        assert len(promote) <= limit and len(evict) == max(0, len(promote) - max(free, 0))
        assert not any(pinned[c] or cached[c] for c in promote) and all(cached[c] and not pinned[c] for c in evict)


def test_full_size_decision_is_vectorised():
    rng = np.random.default_rng(0)
    scores = rng.random((40, 256))
    cached = rng.random((40, 256)) < 0.3
    promote, evict = plan_promotions(scores, cached, np.zeros_like(cached), 0, 10240)
    top = np.sort(scores[~cached])[::-1]
    low = np.sort(scores[cached])
    swaps = int(np.sum(top[: low.size] > low[: top.size]))
    assert len(promote) == len(evict) == swaps
