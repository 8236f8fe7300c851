"""Expert-cache hit rates of batched decode on the simulator (CPU, no model): each cache policy against Belady's
bound on the batch's trace, for 1, 4 and 8 sequences.

    python bench/cache_batch.py --out bench/results/cache_batch_cpu_sim.json

The trace is `planner.trace.routing_trace` from the model's shipped routing counts (as bench/offload.py replays
it), one stretch per sequence (`planner.trace.batch_trace`: step t holds every sequence's token t, as
`runtime.trace_routing` routes a served batch). The VRAM holds the `--pinned` experts the plan ranks highest
(expected picks per token) and `--slots` cache slots: by default the H200's 15 GiB plan of
bench/results/offload_h200_15gib_miss_paths_00db0bc.json (4,631 pinned, 1,461 slots), the same for every batch
size (a plan for 8 sequences sets a little more VRAM aside for their state). `planner.trace.simulate_cache`
replays the steps with the runtime's mechanics: at most `--limit` promotions per step boundary, serving
`--lag` steps later. Belady (`planner.trace.belady_hit_rate`, MIN with bypass over pinned + slots entries) takes
the requests one by one, so a second sequence's pick of an expert in the same step hits once the first one
brought it in: a bound the runtime, which moves experts only between steps, cannot reach. Hit rates count the
steps after `--warmup`. The `batch` policy's prior weight was chosen on seed 0: report another seed (default 1).
The trace's marginals are the shipped counts the plan ranks by, which flatters any policy that leans on the
plan's ranking (static, batch) next to real traffic, whose routing drifts from those counts.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import numpy as np

from ninfer_offload.planner.cache_policy import POLICIES, make_policy
from ninfer_offload.planner.routing import SHIPPED_MODEL, shipped_routing_stats
from ninfer_offload.planner.trace import batch_trace, belady_hit_rate, routing_trace, simulate_cache
from provenance import git_commit


def pinned_by_rank(hits: np.ndarray, count: int) -> np.ndarray:
    """bool [layers, experts]: the `count` experts with the most expected picks per token (ties by index)."""
    flat = np.zeros(hits.size, dtype=bool)
    flat[np.argsort(-hits, axis=None, kind="stable")[:count]] = True
    return flat.reshape(hits.shape)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--sequences", type=int, nargs="+", default=[1, 4, 8])
    parser.add_argument("--steps", type=int, default=1024, help="decode steps per batch size (warm-up included)")
    parser.add_argument("--warmup", type=int, default=256, help="steps before the hit rates count")
    parser.add_argument("--pinned", type=int, default=4631)
    parser.add_argument("--slots", type=int, default=1461)
    parser.add_argument("--limit", type=int, default=16, help="promotions per step boundary (the runtime's DEFAULT_PROMOTIONS)")
    parser.add_argument("--lag", type=int, default=3, help="steps from the counts to the promoted experts serving")
    parser.add_argument("--seed", type=int, default=1)
    args = parser.parse_args()

    hits = np.array(shipped_routing_stats().hits)
    top_k, experts = SHIPPED_MODEL["num_experts_per_tok"], hits.shape[1]
    pinned = pinned_by_rank(hits, args.pinned)
    report = {
        "result": "CPU simulation (planner.trace.simulate_cache), no model run",
        "commit": git_commit(),
        "trace": {"generator": "planner.trace.routing_trace (shipped counts)", "seed": args.seed, "steps": args.steps},
        "pinned": args.pinned, "slots": args.slots, "limit": args.limit, "lag": args.lag, "warmup": args.warmup,
        "levels": [],
    }
    for sequences in args.sequences:
        trace = batch_trace(routing_trace(hits, top_k, sequences * args.steps, args.seed), sequences)
        level = {"sequences": sequences, "distinct_experts_per_layer_step": float(np.mean([
            len(np.unique(trace[t, layer])) for t in range(0, args.steps, 16) for layer in range(trace.shape[1])
        ]))}
        for name in POLICIES:
            run = simulate_cache(trace, make_policy(name, hits), pinned, args.slots, args.limit, args.lag, args.warmup)
            level[name] = {"hit_rate": run["hit_rate"], "promotions_per_step": run["promotions_per_token"]}
        level["belady_hit_rate"] = belady_hit_rate(trace, args.pinned + args.slots, experts, args.warmup)
        report["levels"].append(level)
        print(json.dumps(level), flush=True)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=2) + "\n")


if __name__ == "__main__":
    main()
