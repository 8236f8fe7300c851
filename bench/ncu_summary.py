"""Nsight Compute's printed sections of a `bench/ncu_probe.py` run as JSON: one row per profiled launch.

    python bench/ncu_summary.py ncu.txt --out ncu.json --commit <sha> [--gpu "NVIDIA H100 80GB HBM3"]

ncu replays each launch with its caches flushed and, with `--clock-control none`, unlocked clocks: durations are
longer than in a graph replay; compare them with each other.
"""

from __future__ import annotations

import argparse
import json
import re
from pathlib import Path

from provenance import gpu_report_header

# ncu's printed metrics kept per launch: (JSON key, metric name as printed); times in us, sizes in kB.
METRICS = (
    ("duration_us", "Duration"), ("dram_percent", "DRAM Throughput"), ("l1_percent", "L1/TEX Cache Throughput"),
    ("l2_percent", "L2 Cache Throughput"), ("issue_busy_percent", "Issue Slots Busy"), ("registers", "Registers Per Thread"),
    ("dynamic_shared_kb", "Dynamic Shared Memory Per Block"), ("waves", "Waves Per SM"),
    ("theoretical_occupancy_percent", "Theoretical Occupancy"), ("achieved_occupancy_percent", "Achieved Occupancy"),
    ("eligible_warps", "Eligible Warps Per Scheduler"), ("cycles_per_issue", "Warp Cycles Per Issued Instruction"),
)
SCALES = {"ns": 1e-3, "us": 1.0, "ms": 1e3, "byte/block": 1e-3, "Kbyte/block": 1.0, "Mbyte/block": 1e3}


def summarize(text: str) -> tuple[list[str], list[dict]]:
    """(the cases probed, one row per profiled launch of ncu's printed details: kernel, grid, block and METRICS)."""
    rows = []
    for block in re.split(r"\n  (?=\w+ \(\d+, \d+, \d+\)x\()", text)[1:]:
        head = re.match(r"(\w+) \(([\d, ]+)\)x\(([\d, ]+)\)", block)
        row = {"kernel": head[1], "grid": head[2], "block": head[3]}
        for key, name in METRICS:
            found = re.search(rf"^\s+{re.escape(name)}\s+(\S+\s+)?([\d,.]+)\s*$", block, flags=re.M)
            unit = (found[1] or "").strip() if found else ""
            row[key] = float(found[2].replace(",", "")) * SCALES.get(unit, 1.0) if found else None
        rows.append(row)
    return re.findall(r"^probed (\S+)$", text, flags=re.M), rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("output", type=Path, help="ncu's printed output of a probe run")
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--commit", default=None)
    parser.add_argument("--gpu", help="the card the output came from (default: this machine's)")
    args = parser.parse_args()
    cases, launches = summarize(args.output.read_text())
    report = {**gpu_report_header(args.commit), "cases": cases, "launches": launches}
    report["gpu"] = args.gpu or report["gpu"]
    args.out.write_text(json.dumps(report, indent=1) + "\n")


if __name__ == "__main__":
    main()
