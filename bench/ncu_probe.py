"""Decode kernels at full-size shapes, each launched once inside an NVTX range `probe`, for Nsight Compute.

    ncu --clock-control none --nvtx --nvtx-include "probe/" --section SpeedOfLight --section WarpStateStats \\
        python bench/ncu_probe.py --cases moe8 moe4 gdn_qkvz4 > ncu.txt
    python bench/ncu_summary.py ncu.txt --out ncu.json --commit <sha>

Every case is launched once first (compilation, warm-up), then once inside the range, so only that launch is
profiled. Weights are `kernel_sweeps`' valid random objects; the routed experts are routed at random (top 8 of 256
per token, as the random weights route: a batch of 8 reads ~57 distinct experts). The kernels' settings are the
shipped ones, or `--set MODULE.NAME=EXPRESSION`. `bench/ncu_summary.py` turns ncu's printed sections into one JSON
row per profiled launch (`bench/gpu_suite.sh`'s `ncu` benchmark does both).
"""

from __future__ import annotations

import argparse

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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cases", nargs="+", default=["moe1", "moe4", "moe8", "gdn_qkvz4", "mixer_out4"])
    parser.add_argument("--set", nargs="*", default=[], metavar="SETTING")
    args = parser.parse_args()
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
