"""Synthetic routing traces (marginals, reuse, determinism), Belady's bound and the cache replay."""

from __future__ import annotations

from functools import lru_cache

import numpy as np
import pytest

from ninfer_offload.errors import NinferError
from ninfer_offload.planner.cache_policy import LruPolicy, StaticPolicy, make_policy
from ninfer_offload.planner.routing import shipped_routing_stats
from ninfer_offload.planner.trace import (
    batch_trace, belady_hit_rate, calibrate_mixture, reuse_stats, routing_trace, simulate_cache,
)


@pytest.fixture(scope="module")
def shipped_hits() -> np.ndarray:
    return np.array(shipped_routing_stats().hits)


@pytest.fixture(scope="module")
def shipped_trace(shipped_hits) -> np.ndarray:
    return routing_trace(shipped_hits, 8, 4096, seed=1)


def single(*experts_per_token) -> np.ndarray:
    """A one-layer trace [tokens, 1, k] from each token's expert ids."""
    return np.array(experts_per_token, dtype=np.int16).reshape(len(experts_per_token), 1, -1)


def optimal_hits(items: tuple[int, ...], capacity: int) -> int:
    """Most hits any schedule gets (insert or bypass on each miss, evict anyone): exhaustive search."""

    @lru_cache(maxsize=None)
    def best(i: int, cache: frozenset) -> int:
        if i == len(items):
            return 0
        x = items[i]
        if x in cache:
            return 1 + best(i + 1, cache)
        options = [best(i + 1, cache)]
        if len(cache) < capacity:
            options.append(best(i + 1, cache | {x}))
        elif capacity:
            options.extend(best(i + 1, (cache - {y}) | {x}) for y in cache)
        return max(options)

    return best(0, frozenset())


def test_shape_and_distinct_experts_per_row(shipped_hits, shipped_trace):
    assert shipped_trace.shape == (4096, 40, 8) and shipped_trace.dtype == np.int16
    rows = np.sort(shipped_trace.reshape(-1, 8), axis=1)
    assert (np.diff(rows, axis=1) > 0).all()
    assert shipped_hits[np.arange(40)[None, :, None], shipped_trace].min() > 0  # experts never routed never appear


def test_reuse_hits_the_published_figures(shipped_trace):
    reuse_next, reuse_window = reuse_stats(shipped_trace, window=8)
    assert reuse_next == pytest.approx(0.45, abs=0.03)
    assert reuse_window == pytest.approx(0.80, abs=0.03)


def test_marginals_follow_the_routing_stats(shipped_hits, shipped_trace):
    tokens, layers, _ = shipped_trace.shape
    picks = np.stack([np.bincount(shipped_trace[:, layer].ravel(), minlength=256) / tokens for layer in range(layers)])
    assert np.corrcoef(picks.ravel(), shipped_hits.ravel())[0, 1] > 0.9
    np.testing.assert_allclose(picks.sum(axis=1), 8.0)


def test_other_targets_and_uniform_routing():
    hits = np.full((4, 64), 2 / 64)
    trace = routing_trace(hits, 2, 3000, seed=3, reuse_next=0.3, reuse_window=0.6)
    reuse_next, reuse_window = reuse_stats(trace)
    assert reuse_next == pytest.approx(0.3, abs=0.03) and reuse_window == pytest.approx(0.6, abs=0.03)


def test_calibration_leaves_room_for_the_reuse_of_hot_experts(shipped_hits):
    p_next, p_window = calibrate_mixture(shipped_hits, 8)
    assert 0.2 < p_next < 0.45 and 0.0 < p_window < 0.8 - p_next  # independent draws repeat hot experts on their own
    assert calibrate_mixture(shipped_hits, 8) == (p_next, p_window)


def test_seeded_and_deterministic(shipped_hits):
    a = routing_trace(shipped_hits, 8, 64, seed=5)
    np.testing.assert_array_equal(a, routing_trace(shipped_hits, 8, 64, seed=5))
    assert (a != routing_trace(shipped_hits, 8, 64, seed=6)).mean() > 0.5


def test_layers_need_top_k_routable_experts():
    hits = np.zeros((2, 8))
    hits[:, :3] = 1.0
    with pytest.raises(NinferError, match="at least top_k = 4"):
        routing_trace(hits, 4, 10, seed=0)


def test_reuse_stats_on_hand_made_traces():
    assert reuse_stats(single(*[(0, 1)] * 12), window=4) == (1.0, 1.0)
    assert reuse_stats(single(*[(2 * t, 2 * t + 1) for t in range(12)]), window=4) == (0.0, 0.0)
    assert reuse_stats(single(*[(0, 1) if t % 2 else (2, 3) for t in range(12)]), window=4) == (0.0, 1.0)
    # Expert 0 every token; expert 99 at tokens 0, 3, 6, 9, 12 (3 tokens back: inside the window, not next).
    trace = single(*[(0, 99 if t % 3 == 0 else 10 + t) for t in range(13)])
    assert reuse_stats(trace, window=4) == (9 / 18, pytest.approx((9 + 3) / 18))
    with pytest.raises(NinferError, match="more than 4 tokens"):
        reuse_stats(single(*[(0, 1)] * 4), window=4)


def test_belady_hand_computed():
    a, b, c, d = 0, 1, 2, 3
    trace = single(a, b, c, a, b, d, a, b)
    # Capacity 2: keep a and b, bypass c and d (never used again) -> a, b, a, b hit.
    assert belady_hit_rate(trace, 2, 4) == 4 / 8
    # Capacity 1: a is needed sooner than b each time, so a stays: it hits at 3 and 6.
    assert belady_hit_rate(trace, 1, 4) == 2 / 8
    assert belady_hit_rate(trace, 0, 4) == 0.0
    # Counting from request 4 on (a warm cache): of b, d, a, b, three hit.
    assert belady_hit_rate(trace, 2, 4, count_from=4) == 3 / 4


def test_belady_only_compulsory_misses_when_everything_fits(shipped_trace):
    trace = shipped_trace[:256]
    _, counts = np.unique(np.arange(40)[None, :, None] * 256 + trace, return_counts=True)
    bound = 1 - counts.size / trace.size
    assert belady_hit_rate(trace, counts.size, 256) == pytest.approx(bound)
    assert belady_hit_rate(trace, 10 * counts.size, 256) == pytest.approx(bound)
    reused = int(np.count_nonzero(counts > 1))  # experts requested once are bypassed: they need no entry
    assert belady_hit_rate(trace, reused, 256) == pytest.approx(bound)
    assert belady_hit_rate(trace, reused // 2, 256) < bound


def test_belady_matches_exhaustive_search():
    rng = np.random.default_rng(11)
    for _ in range(40):
        layers, experts, top_k, tokens = int(rng.integers(1, 3)), 3, int(rng.integers(1, 3)), int(rng.integers(2, 7))
        trace = np.stack([np.stack([rng.choice(experts, top_k, replace=False) for _ in range(layers)]) for _ in range(tokens)])
        items = tuple(int(x) for x in (np.arange(layers)[None, :, None] * experts + trace).ravel())
        for capacity in range(0, 4):
            assert belady_hit_rate(trace, capacity, experts) * len(items) == pytest.approx(optimal_hits(items, capacity))


def test_belady_bounds_lru():
    rng = np.random.default_rng(2)
    for seed in range(4):
        hits = rng.pareto(1.5, size=(3, 16)) + 0.05
        hits *= 2 / hits.sum(axis=1, keepdims=True)
        hits = np.minimum(hits, 0.9)
        trace = routing_trace(hits, 2, 300, seed=seed)
        for capacity in (0, 3, 8, 20, 48):
            lru = simulate_cache(trace, LruPolicy(np.zeros((3, 16))), np.zeros((3, 16), bool), capacity, limit=48)
            assert belady_hit_rate(trace, capacity, 16) >= lru["hit_rate"]


def test_simulated_lru_on_a_hand_sequence():
    trace = single(0, 1, 2, 0, 1, 3, 0, 1)
    result = simulate_cache(trace, LruPolicy(np.zeros((1, 4))), np.zeros((1, 4), bool), 2, limit=4)
    assert (result["hit_rate"], result["promotions_per_token"]) == (0.0, 1.0)  # LRU thrashes where Belady gets 4 of 8
    assert list(result["misses_per_layer"]) == [1.0] and result["layers_missing_per_token"] == 1.0


def test_promotions_arrive_after_the_lag():
    trace = single(0, 0, 0, 0)
    none = np.zeros((1, 4), bool)
    assert simulate_cache(trace, LruPolicy(np.zeros((1, 4))), none, 1, limit=1, lag=1)["hit_rate"] == 3 / 4
    assert simulate_cache(trace, LruPolicy(np.zeros((1, 4))), none, 1, limit=1, lag=2)["hit_rate"] == 2 / 4
    with pytest.raises(NinferError, match="lag"):
        simulate_cache(trace, LruPolicy(np.zeros((1, 4))), none, 1, limit=1, lag=0)


def test_static_replay_is_the_plan_and_pins_always_hit(shipped_hits, shipped_trace):
    trace = shipped_trace[:512]
    result = simulate_cache(trace, StaticPolicy(shipped_hits), np.zeros((40, 256), bool), 2000, limit=64)
    top = np.argsort(-shipped_hits, axis=None, kind="stable")[:2000]
    resident = np.isin(np.arange(40)[None, :, None] * 256 + trace, top)
    assert result["hit_rate"] == pytest.approx(resident.mean()) and result["promotions_per_token"] == 0.0
    # Misses counted per layer and per token: the requests outside the static set, and the layers with any.
    np.testing.assert_allclose(result["misses_per_layer"], (~resident).sum(axis=(0, 2)) / len(trace))
    assert result["layers_missing_per_token"] == pytest.approx((~resident).any(axis=2).sum() / len(trace))
    pinned = shipped_hits > 0
    assert simulate_cache(trace, LruPolicy(shipped_hits), pinned, 0, limit=64)["hit_rate"] == 1.0


def test_adaptive_beats_static_on_a_local_trace(shipped_hits, shipped_trace):
    trace, none = shipped_trace[:512], np.zeros((40, 256), bool)
    static = simulate_cache(trace, StaticPolicy(shipped_hits), none, 2000, limit=64)["hit_rate"]
    lru = simulate_cache(trace, LruPolicy(shipped_hits), none, 2000, limit=64)
    assert lru["hit_rate"] > static + 0.1 and 0 < lru["promotions_per_token"] <= 64
    # With every used expert promoted at once, LRU fetches on demand: Belady bounds it, up to its warm start of 2000 entries.
    demand = simulate_cache(trace, LruPolicy(shipped_hits), none, 2000, limit=320)["hit_rate"]
    assert lru["hit_rate"] <= demand <= belady_hit_rate(trace, 2000, 256) + 2000 / trace.size


def test_belady_grows_with_capacity(shipped_trace):
    rates = [belady_hit_rate(shipped_trace[:256], capacity, 256) for capacity in (0, 500, 1000, 2000, 4000)]
    assert rates[0] == 0.0 and (np.diff(rates) > 0).all()


def test_a_batch_trace_holds_each_sequences_token_of_the_step(shipped_trace):
    batch = batch_trace(shipped_trace[:90], 3)
    assert batch.shape == (30, 40, 24)
    for step in (0, 17, 29):
        for sequence in range(3):
            assert np.array_equal(batch[step, :, sequence * 8 : (sequence + 1) * 8], shipped_trace[sequence * 30 + step])
    with pytest.raises(NinferError, match="cannot give 4 sequences a step each"):
        batch_trace(shipped_trace[:3], 4)


def test_hits_count_from_a_token_on():
    trace, none = single(0, 0, 0, 0), np.zeros((1, 4), bool)
    result = simulate_cache(trace, LruPolicy(np.zeros((1, 4))), none, 1, limit=1, lag=2, count_from=2)
    # the miss and the promotion were in the warm-up
    assert (result["hit_rate"], result["promotions_per_token"], result["misses_per_layer"].tolist()) == (1.0, 0.0, [0.0])


def test_the_batch_policy_beats_decayed_frequency_on_a_batch(shipped_hits, shipped_trace):
    """Four sequences of the calibrated trace (seed 1; the policy's prior weight was picked on seed 0), the 15 GiB
    plan's pinned experts and slots (bench/cache_batch.py's defaults): more hits with the plan's rate blended in."""
    trace = batch_trace(shipped_trace[: 4 * 320], 4)
    pinned = np.zeros(shipped_hits.size, dtype=bool)
    pinned[np.argsort(-shipped_hits, axis=None, kind="stable")[:4631]] = True
    pinned = pinned.reshape(shipped_hits.shape)
    rates = {
        name: simulate_cache(trace, make_policy(name, shipped_hits), pinned, 1461, limit=16, lag=3, count_from=64)["hit_rate"]
        for name in ("decayed", "batch")
    }
    assert rates["batch"] > rates["decayed"] + 0.005, rates
    assert rates["batch"] < belady_hit_rate(trace, 4631 + 1461, 256, 64)
