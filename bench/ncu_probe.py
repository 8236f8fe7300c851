"""Decode kernels at full-size shapes, each launched once inside an NVTX range `probe`, for Nsight Compute.

    ncu --clock-control none --nvtx --nvtx-include "probe/" --section SpeedOfLight --section WarpStateStats \\
        python bench/ncu_probe.py --cases moe8 moe4 gdn_qkvz4 > ncu.txt
    python bench/ncu_probe.py --summarize ncu.txt --out ncu.json --commit <sha>

Every case is launched once first (compilation, warm-up), then once inside the range, so only that launch is
profiled. Weights are `kernel_sweeps`' valid random objects; the routed experts are routed at random (top 8 of 256
per token, as the random weights route: a batch of 8 reads ~57 distinct experts). The kernels' settings are the
shipped ones, or `--set MODULE.NAME=EXPRESSION`. `--summarize` turns ncu's printed sections into one JSON row per
profiled launch (`bench/gpu_suite.sh`'s `ncu` benchmark does both). ncu replays each launch with its caches
flushed and, with `--clock-control none`, unlocked clocks: durations are longer than in a graph replay; compare
them with each other.
"""

from __future__ import annotations

import argparse
import json
import re
from pathlib import Path

import torch

from ninfer_offload.kernels import moe, quant_linear
from kernel_settings import kernel_modules, parse_setting
from kernel_sweeps import EXPERTS, HIDDEN, TOP_K, expert_bank, quantized_object

PRODUCTS = {"gdn_qkvz": ("q8_g32_fp16", 12288, 2048), "mixer_out": ("q8_g32_fp16", 2048, 4096),
            "shared_gate_up": ("q8_g32_fp16", 1024, 2048), "head": ("q6_g64_fp16", 248320, 2048)}


def moe_case(tokens: int):
    """A call of the routed experts for `tokens` tokens, routed at random."""
    layout, records, table = expert_bank("q4_g64_fp16", "q5_g64_fp16")
    x = torch.randn(tokens, HIDDEN, device="cuda", dtype=torch.bfloat16)
    ids = torch.stack([torch.randperm(EXPERTS, device="cuda")[:TOP_K] for _ in range(tokens)])
    w = torch.softmax(torch.randn(tokens, TOP_K, device="cuda"), -1).to(torch.bfloat16)
    return lambda: moe.routed_experts(x, ids, w, records, table, layout)


def product_case(name: str, tokens: int):
    """A call of one quantized product for `tokens` tokens."""
    fmt, n, k = PRODUCTS[name]
    data, geometry = quantized_object(fmt, n, k)
    x = torch.randn(tokens, k, device="cuda", dtype=torch.bfloat16)
    return lambda: quant_linear.quantized_linear(x, data[0], geometry)


def case(name: str):
    """`moe<T>` or `<product><T>`, T the token count."""
    stem = name.rstrip("0123456789")
    tokens = int(name[len(stem):])
    return moe_case(tokens) if stem == "moe" else product_case(stem, tokens)


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
    parser.add_argument("--cases", nargs="+", default=["moe1", "moe4", "moe8", "gdn_qkvz4", "mixer_out4"])
    parser.add_argument("--set", nargs="*", default=[], metavar="SETTING")
    parser.add_argument("--summarize", type=Path, help="ncu's printed output of a probe run: write its JSON summary to --out")
    parser.add_argument("--out", type=Path)
    parser.add_argument("--commit", default=None)
    parser.add_argument("--gpu", help="the card the summarized output came from (default: this machine's)")
    args = parser.parse_args()
    if args.summarize is not None:
        from provenance import gpu_report_header

        cases, launches = summarize(args.summarize.read_text())
        report = {**gpu_report_header(args.commit), "cases": cases, "launches": launches}
        report["gpu"] = args.gpu or report["gpu"]
        args.out.write_text(json.dumps(report, indent=1) + "\n")
        return
    for module, attr, value in (parse_setting(text, kernel_modules()) for text in args.set):
        setattr(module, attr, value)
    torch.manual_seed(0)
    for name in args.cases:
        run = case(name)
        run()
        torch.cuda.synchronize()
        torch.cuda.nvtx.range_push("probe")
        run()
        torch.cuda.synchronize()
        torch.cuda.nvtx.range_pop()
        print(f"probed {name}", flush=True)


if __name__ == "__main__":
    main()
