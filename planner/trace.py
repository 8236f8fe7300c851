"""Synthetic routing traces, Belady's optimal expert-cache hit rate, and a replay of the runtime cache.

`routing_trace` models a decode stream of a top-k MoE: per token and text layer, `top_k` distinct
experts. Marginally, expert `e` of layer `l` is picked `hits[l, e]` times per token (the routing
stats of `planner.routing`); temporally, consecutive tokens share experts. Measurements of
routing locality for this model class report that about 45 % of a token's experts (per layer)
were already used by the previous token and about 80 % within the previous 8 tokens; those are
the default targets (`reuse_next`, `reuse_window`).

Each of the k picks of (token t, layer l) is, with probability `p_next`, a copy of a random pick of
token t-1; with probability `p_window`, a copy of a random pick of a token in t-2 .. t-window; else
a fresh draw from hits[l] / top_k. A pick already chosen for (t, l) is drawn again. Copies of
random picks keep the marginals, up to the flattening that distinct picks impose (on the shipped
counts, an expert's pick rate comes out about 0.93 x its hits + 0.002). Independent draws of hot
experts already repeat, so (p_next, p_window) are calibrated on measured values: a deterministic
fixed-point iteration on a 1024-token trial trace (`calibrate_mixture`). Targets below what the
independent draws give on their own are out of reach: p clips at 0.

`belady_hit_rate` is the clairvoyant bound for a cache pooled across layers; `simulate_cache`
replays a trace through a `CachePolicy` with the runtime's mechanics (pinned experts, slots,
promotions per step, copy lag).
"""

from __future__ import annotations

import numpy as np
from numba import njit

from ninfer_offload.errors import NinferError
from ninfer_offload.planner.cache_policy import CachePolicy, plan_promotions

CALIBRATION_TOKENS = 1024
CALIBRATION_SEED = 0x5EED
CALIBRATION_STEPS = 40
CALIBRATION_TOLERANCE = 0.002


@njit(cache=True)
def _generate(cdf: np.ndarray, top_k: int, tokens: int, window: int, p_next: float, p_window: float, seed: int) -> np.ndarray:
    layers = cdf.shape[0]
    out = np.empty((tokens, layers, top_k), dtype=np.int16)
    np.random.seed(seed)
    for t in range(tokens):
        older = min(window, t) - 1  # tokens t-2 .. t-window that exist
        for layer in range(layers):
            chosen = 0
            while chosen < top_k:
                u = np.random.random()
                if t >= 1 and u < p_next:
                    e = out[t - 1, layer, np.random.randint(top_k)]
                elif older >= 1 and u < p_next + p_window:
                    e = out[t - 2 - np.random.randint(older), layer, np.random.randint(top_k)]
                else:
                    e = np.searchsorted(cdf[layer], np.random.random() * cdf[layer, -1], side="right")
                duplicate = False
                for j in range(chosen):
                    if out[t, layer, j] == e:
                        duplicate = True
                        break
                if not duplicate:
                    out[t, layer, chosen] = e
                    chosen += 1
    return out


def _hits_cdf(hits: np.ndarray, top_k: int) -> np.ndarray:
    hits = np.asarray(hits, dtype=np.float64)
    if hits.ndim != 2 or (hits < 0).any():
        raise NinferError("routing hits must be a non-negative [layers, experts] array")
    if ((hits > 0).sum(axis=1) < top_k).any():
        raise NinferError(f"routing hits: every layer needs at least top_k = {top_k} experts with hits")
    if hits.shape[1] > np.iinfo(np.int16).max:
        raise NinferError(f"routing traces hold expert ids as int16, {hits.shape[1]} experts is too many")
    return np.cumsum(hits, axis=1)


def calibrate_mixture(
    hits: np.ndarray, top_k: int, reuse_next: float = 0.45, reuse_window: float = 0.80, window: int = 8
) -> tuple[float, float]:
    """(p_next, p_window) whose trial trace measures (reuse_next, reuse_window), to within the tolerance."""
    cdf = _hits_cdf(hits, top_k)
    p_next, p_window = reuse_next, max(reuse_window - reuse_next, 0.0)
    for _ in range(CALIBRATION_STEPS):
        trial = _generate(cdf, top_k, CALIBRATION_TOKENS, window, p_next, p_window, CALIBRATION_SEED)
        got_next, got_window = reuse_stats(trial, window)
        miss_next, miss_window = reuse_next - got_next, reuse_window - got_window
        if max(abs(miss_next), abs(miss_window)) < CALIBRATION_TOLERANCE:
            break
        # p_next moves both statistics, p_window the windowed one only.
        p_next = min(max(p_next + miss_next, 0.0), 0.99)
        p_window = min(max(p_window + miss_window - miss_next, 0.0), 0.99 - p_next)
    return p_next, p_window


def routing_trace(
    hits: np.ndarray, top_k: int, tokens: int, seed: int, reuse_next: float = 0.45, reuse_window: float = 0.80, window: int = 8
) -> np.ndarray:
    """Expert ids int16 [tokens, layers, top_k], distinct per (token, layer); see the module docstring."""
    if window < 2:
        raise NinferError(f"routing trace window must be at least 2 tokens, got {window}")
    p_next, p_window = calibrate_mixture(hits, top_k, reuse_next, reuse_window, window)
    return _generate(_hits_cdf(hits, top_k), top_k, tokens, window, p_next, p_window, seed)


def batch_trace(trace: np.ndarray, sequences: int) -> np.ndarray:
    """The requests of decode steps over `sequences` sequences that route as consecutive stretches of `trace`
    (sequence s as its tokens s * n .. (s + 1) * n - 1, n = tokens // sequences): [n, layers, sequences * top_k],
    step t's picks of every sequence side by side, so `simulate_cache` and `belady_hit_rate` take it as a
    trace whose tokens are the batch's steps (an expert that several sequences pick counts once per sequence)."""
    steps = trace.shape[0] // sequences
    if steps < 1:
        raise NinferError(f"a trace of {trace.shape[0]} tokens cannot give {sequences} sequences a step each")
    return np.concatenate([trace[s * steps : (s + 1) * steps] for s in range(sequences)], axis=2)


def _items(trace: np.ndarray, num_experts: int) -> np.ndarray:
    """Flat (layer, expert) id of every request, in request order (token, layer, pick)."""
    layers = trace.shape[1]
    return (np.arange(layers, dtype=np.int64)[None, :, None] * num_experts + trace).ravel()


def _previous_use(items: np.ndarray) -> np.ndarray:
    """Per request, the index of the previous request of the same item, -1 for the first."""
    order = np.argsort(items, kind="stable")
    previous = np.full(items.size, -1, dtype=np.int64)
    same = items[order[1:]] == items[order[:-1]]
    previous[order[1:][same]] = order[:-1][same]
    return previous


def _next_use(items: np.ndarray) -> np.ndarray:
    """Per request, the index of the next request of the same item, len(items) for the last."""
    order = np.argsort(items, kind="stable")
    following = np.full(items.size, items.size, dtype=np.int64)
    same = items[order[1:]] == items[order[:-1]]
    following[order[:-1][same]] = order[1:][same]
    return following


def reuse_stats(trace: np.ndarray, window: int = 8) -> tuple[float, float]:
    """(share of requests whose expert the previous token used, share used within the previous
    `window` tokens), over the tokens after the first `window`."""
    tokens, layers, top_k = trace.shape
    if tokens <= window:
        raise NinferError(f"reuse stats need more than {window} tokens, the trace has {tokens}")
    per_token = layers * top_k
    previous = _previous_use(_items(trace, int(trace.max()) + 1))
    token = np.arange(previous.size) // per_token
    gap = np.where(previous >= 0, token - previous // per_token, tokens)[window * per_token :]
    return float(np.mean(gap == 1)), float(np.mean(gap <= window))


@njit(cache=True)
def _heap_push(keys: np.ndarray, values: np.ndarray, size: int, key: int, value: int) -> int:
    i = size
    while i > 0:
        parent = (i - 1) // 2
        if keys[parent] >= key:
            break
        keys[i], values[i] = keys[parent], values[parent]
        i = parent
    keys[i], values[i] = key, value
    return size + 1


@njit(cache=True)
def _heap_pop(keys: np.ndarray, values: np.ndarray, size: int) -> int:
    size -= 1
    key, value = keys[size], values[size]
    i = 0
    while True:
        child = 2 * i + 1
        if child >= size:
            break
        if child + 1 < size and keys[child + 1] > keys[child]:
            child += 1
        if keys[child] <= key:
            break
        keys[i], values[i] = keys[child], values[child]
        i = child
    keys[i], values[i] = key, value
    return size


@njit(cache=True)
def _belady_hits(items: np.ndarray, following: np.ndarray, capacity: int, num_items: int, first: int) -> int:
    """MIN with bypass over a max-heap of next uses, stale entries skipped lazily; hits counted from
    request `first` on."""
    n = items.size
    cached = np.zeros(num_items, dtype=np.bool_)
    next_of = np.zeros(num_items, dtype=np.int64)
    keys = np.empty(n, dtype=np.int64)
    values = np.empty(n, dtype=np.int64)
    size = 0
    used = 0
    hits = 0
    for i in range(n):
        x, nx = items[i], following[i]
        if cached[x]:
            hits += i >= first
            next_of[x] = nx
            size = _heap_push(keys, values, size, nx, x)
            continue
        if capacity == 0 or nx == n:
            continue  # bypass: nothing to gain from keeping it
        if used == capacity:
            while not (cached[values[0]] and next_of[values[0]] == keys[0]):
                size = _heap_pop(keys, values, size)
            if keys[0] <= nx:
                continue  # every cached item is needed sooner: bypass
            cached[values[0]] = False
            size = _heap_pop(keys, values, size)
            used -= 1
        cached[x] = True
        next_of[x] = nx
        size = _heap_push(keys, values, size, nx, x)
        used += 1
    return hits


def belady_hit_rate(trace: np.ndarray, capacity: int, num_experts: int, count_from: int = 0) -> float:
    """Hit rate of Belady's MIN with bypass for `capacity` (layer, expert) entries pooled across layers.

    Requests go in trace order (token by token, every layer of a token). The cache starts empty, so
    the first request of every item is a compulsory miss; a miss is cached only when its next use
    comes before the furthest next use in the cache. Tokens before `count_from` only warm the cache:
    the rate counts the requests from that token on.
    """
    items = _items(trace, num_experts)
    first = count_from * trace.shape[1] * trace.shape[2]
    if items.size <= first:
        return 0.0
    hits = _belady_hits(items, _next_use(items), max(int(capacity), 0), trace.shape[1] * num_experts, first)
    return hits / (items.size - first)


def simulate_cache(
    trace: np.ndarray, policy: CachePolicy, pinned: np.ndarray, capacity: int, limit: int, lag: int = 1, count_from: int = 0
) -> dict:
    """Replays `trace` through the runtime cache: {"hit_rate", "promotions_per_token", "misses_per_layer" (float
    [layers], misses per token), "layers_missing_per_token" (layers with at least one miss, per token)}, of the
    tokens from `count_from` on (the ones before only warm the cache up).

    A request hits when its expert is pinned or in a cache slot. The slots start with the policy's
    highest-scoring unpinned experts. After each token the policy observes that token's uses and
    `plan_promotions` runs; a victim leaves at once, a promoted expert serves from token t + lag on
    (lag=1: the copy is made between two steps; more: it overlaps lag - 1 steps).
    """
    if lag < 1:
        raise NinferError(f"promotion lag must be at least 1 token, got {lag}")
    tokens, layers, _ = trace.shape
    experts = pinned.shape[1]
    pinned = np.asarray(pinned, dtype=bool)
    always = pinned.ravel()
    flat = policy.scores().ravel()
    unpinned = np.flatnonzero(~always & (flat > -np.inf))
    start = unpinned[np.lexsort((unpinned, -flat[unpinned]))][: max(capacity, 0)]
    claimed = np.zeros(layers * experts, dtype=bool)  # in a slot, or on its way to one
    claimed[start] = True
    ready_at = np.zeros(layers * experts, dtype=np.int64)
    offsets = np.arange(layers, dtype=np.int64)[:, None] * experts
    misses = np.zeros(layers, dtype=np.int64)
    missing_layers = promotions = 0
    for t in range(tokens):
        wanted = (offsets + trace[t]).ravel()
        hit = always[wanted] | (claimed[wanted] & (ready_at[wanted] <= t))
        if t >= count_from:
            missed = np.count_nonzero(~hit.reshape(layers, -1), axis=1)
            misses += missed
            missing_layers += int(np.count_nonzero(missed))
        policy.observe(np.bincount(wanted, minlength=layers * experts).reshape(layers, experts))
        if not policy.adaptive:
            continue
        free = capacity - int(np.count_nonzero(claimed))
        promote, evict = plan_promotions(policy.scores(), claimed.reshape(layers, experts), pinned, free, limit)
        for layer, expert in evict:
            claimed[layer * experts + expert] = False
        for layer, expert in promote:
            claimed[layer * experts + expert] = True
            ready_at[layer * experts + expert] = t + lag
        promotions += len(promote) if t >= count_from else 0
    counted = max(tokens - count_from, 1)
    return {
        "hit_rate": 1.0 - int(misses.sum()) / max((tokens - count_from) * layers * trace.shape[2], 1),
        "promotions_per_token": promotions / counted,
        "misses_per_layer": misses / counted,
        "layers_missing_per_token": missing_layers / counted,
    }
