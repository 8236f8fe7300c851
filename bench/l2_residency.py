"""What a decode product would gain if its weights were already in L2: each one-token product and the
routed experts timed with weights read from HBM (a graph cycling through copies, as `kernel_sweeps` does) and
with the same weights L2-resident (one copy replayed).

Usage (on a CUDA machine): python bench/l2_residency.py --out bench/results/l2_residency_<gpu>.json
"""

from __future__ import annotations

import json

import torch
from ninfer_offload.artifact.formats import runtime_geometry
from ninfer_offload.artifact.records import ExpertRecordLayout
from ninfer_offload.kernels import moe, quant_linear
from kernel_sweeps import EXPERTS, HIDDEN, INTER, TOP_K, cold_copies, median_ms, quantized_object, start_run

PRODUCTS = (  # name, format, rows, columns
    ("gdn_qkvz", "q8_g32_fp16", 12288, HIDDEN),
    ("attn_qkgv", "q8_g32_fp16", 9216, HIDDEN),
    ("mixer_out", "q8_g32_fp16", HIDDEN, 4096),
    ("shared_gate_up", "q8_g32_fp16", 2 * INTER, HIDDEN),
    ("shared_down", "q8_g32_fp16", HIDDEN, INTER),
)


def main() -> None:
    args, _, header = start_run(__doc__)
    results = []
    for name, fmt, n, k in PRODUCTS:
        geometry = runtime_geometry(fmt, n, k)
        copies = cold_copies(geometry.encoded_size, True)
        data, _ = quantized_object(fmt, n, k, copies)
        x = torch.randn(1, k, device="cuda", dtype=torch.bfloat16)
        cold = median_ms(lambda: [quant_linear.quantized_linear(x, data[c], geometry) for c in range(copies)], True) / copies
        warm = median_ms(lambda: quant_linear.quantized_linear(x, data[0], geometry), True)
        row = {"op": name, "format": fmt, "shape": [n, k], "bytes": geometry.encoded_size, "hbm_us": 1e3 * cold, "l2_us": 1e3 * warm}
        results.append(row)
        print(json.dumps(row), flush=True)
    layout = ExpertRecordLayout.create("q4_g64_fp16", "q5_g64_fp16", HIDDEN, INTER)
    records = torch.randint(0, 256, (EXPERTS, layout.nbytes), dtype=torch.uint8, device="cuda")
    records[:, : layout.gate_up.encoded_size] = quantized_object("q4_g64_fp16", 2 * INTER, HIDDEN, EXPERTS)[0]
    down = quantized_object("q5_g64_fp16", HIDDEN, INTER, EXPERTS)[0]
    records[:, layout.down_offset : layout.down_offset + layout.down.encoded_size] = down
    table = moe.record_table(torch.arange(EXPERTS, device="cuda"), layout.nbytes)
    x = torch.randn(1, HIDDEN, device="cuda", dtype=torch.bfloat16)
    w = torch.softmax(torch.randn(1, TOP_K, device="cuda"), -1).to(torch.bfloat16)
    copies = EXPERTS // TOP_K
    routings = [torch.arange(c * TOP_K, (c + 1) * TOP_K, device="cuda")[None] for c in range(copies)]
    cold = median_ms(lambda: [moe.routed_experts(x, ids, w, records, table, layout) for ids in routings], True) / copies
    warm = median_ms(lambda: moe.routed_experts(x, routings[0], w, records, table, layout), True)
    row = {"op": "routed_experts", "bytes": TOP_K * layout.nbytes, "hbm_us": 1e3 * cold, "l2_us": 1e3 * warm}
    results.append(row)
    print(json.dumps(row), flush=True)
    args.out.write_text(json.dumps({**header, "results": results}, indent=1))


if __name__ == "__main__":
    main()
