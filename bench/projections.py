"""What `ninfer plan` projects for the profiled cards (no GPU needed): the README's projection table.

    python bench/projections.py --out bench/results/projections_<commit>.json

For each card (`--profiles`, default the three RTX cards) and the official Qwen3.6-35B-A3B inventory, the plan's
predictions as a load would make them (`--spec auto`, context 32768, bf16 KV): decode at 1K and 32K context, the
MTP projection and the `--spec auto` decision, a 4K prefill, 8 sequences decoded together at 8K context each, and
the same at a 15 GiB VRAM budget (the RTX 5060 Ti's share). These are projections of the cost model
(`planner/cost.py`, its assumptions listed in each plan), not measurements.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from dataclasses import replace
from pathlib import Path

from ninfer_offload.artifact.contract import official_directory
from ninfer_offload.artifact.inventory import Inventory
from ninfer_offload.planner import PlanOptions
from ninfer_offload.planner.speculation import plan_load
from ninfer_offload.profiles import load_profile
from provenance import git_commit

GiB = 2**30
CASES = {
    "card": {},
    "card, 15 GiB budget": {"vram_budget": 15 * GiB},
}


def project(inventory: Inventory, profile_name: str, options: dict) -> dict:
    """One card's projections at the options of a case."""
    profile = load_profile(profile_name)
    base = PlanOptions(max_context=32768, kv_dtype="bf16", speculative="mtp", proposal_head=False, **options)
    chosen = plan_load(inventory, profile, replace(base, at_context=1024), auto=True)
    long = plan_load(inventory, profile, replace(base, at_context=32768), auto=True)
    batch = plan_load(inventory, profile, replace(base, speculative="none", concurrency=8, max_context=8192, at_context=1024))
    if not chosen.feasible:
        return {"feasible": False, "reason": chosen.reason}
    p = chosen.predicted
    return {
        "feasible": True,
        "speculation": chosen.options.speculative,
        "decode_tok_s_1k": p.decode_tok_s,
        "decode_tok_s_32k": long.predicted.decode_tok_s if long.feasible else None,
        "decode_tok_s_mtp": p.decode_tok_s_mtp,
        "speculation_speedup": p.speculation_speedup,
        "notes": chosen.notes,
        "prefill_4k_tok_s": p.prefill_tok_s,
        "batch8_tok_s": batch.predicted.decode_tok_s_batch if batch.feasible else None,
        "cache_hit_rate": p.cache_hit_rate,
        "vram_used_bytes": chosen.vram_used_bytes,
        "assumptions": list(p.assumptions),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--profiles", nargs="+", default=["rtx5060ti", "rtx5090", "rtxpro6000"])
    parser.add_argument("--commit", default=None)
    args = parser.parse_args()
    inventory = Inventory.from_directory(official_directory())
    report = {
        "command": " ".join(["python", f"bench/{Path(sys.argv[0]).name}", *sys.argv[1:]]),
        "commit": args.commit or git_commit(), "machine": "none (the planner's projections)",
        "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "cards": {},
    }
    for name in args.profiles:
        report["cards"][name] = {case: project(inventory, name, options) for case, options in CASES.items()}
        for case, result in report["cards"][name].items():
            if result["feasible"]:
                print(f"{name}, {case}: decode {result['decode_tok_s_1k']:.1f} tok/s (MTP {result['decode_tok_s_mtp'] or 0:.1f}, "
                      f"{result['speculation']}), prefill {result['prefill_4k_tok_s']:,.0f}, "
                      f"8 sequences {result['batch8_tok_s'] or 0:,.0f}")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=1) + "\n")


if __name__ == "__main__":
    main()
