"""Plot a `bench/offload.py` result: decode tokens/s against the VRAM budget, measured and predicted.

    python bench/plot_offload.py bench/results/offload_h200.json bench/results/offload_h200.png
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

GiB = 2**30


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("result", type=Path)
    parser.add_argument("out", type=Path)
    args = parser.parse_args()
    report = json.loads(args.result.read_text())
    runs = sorted(report["runs"], key=lambda run: run["vram_budget_bytes"])
    budgets = [run["vram_budget_bytes"] / GiB for run in runs]

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 5))
    ax.plot(budgets, [run["decode_tok_s"] for run in runs], "o-", label="measured decode (replayed trace)")
    ax.plot(budgets, [run["planner_decode_tok_s"] for run in runs], "s--", label="planner prediction")
    ax.axhline(report["resident"]["decode_tok_s"], color="grey", linestyle=":", label="all experts in VRAM")
    for run, budget in zip(runs, budgets):
        ax.annotate(f"hit {run['hit_rate']:.0%}", (budget, run["decode_tok_s"]), textcoords="offset points", xytext=(4, -14), fontsize=8)
    ax.set_xlabel("VRAM budget (GiB)")
    ax.set_ylabel("decode tokens/s (batch 1)")
    ax.set_ylim(bottom=0)
    ax.set_title(f"Offloaded decode on {report['gpu']} (commit {report['commit'][:7]})")
    ax.legend(loc="lower right")
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(args.out, dpi=110)


if __name__ == "__main__":
    main()
