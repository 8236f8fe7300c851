"""What a decode product would gain if its weights were already in L2: each one-token product and the
routed experts timed with weights read from HBM (a graph cycling through copies, as `kernel_sweeps` does) and
with the same weights L2-resident (one copy replayed).

Then whether asking L2 for a product's weights before the routed experts that precede it in a step captures that
gain: a chain of 40 layers, each the routed experts of one token (8 random experts of a 256-expert bank) and then
the product on its own copy of the weights, timed plainly, with a launch that asks L2 for the product's weights
(`launch.prefetch_to_l2`, a program per 16 KB) before the routed experts, and with the product on one L2-resident copy.

Usage (on a CUDA machine): python bench/l2_residency.py --out bench/results/l2_residency_<gpu>.json
"""

from __future__ import annotations

import json

import torch
import triton
import triton.language as tl

from ninfer_offload.artifact.formats import runtime_geometry
from ninfer_offload.kernels import launch, moe, quant_linear
from kernel_sweeps import EXPERTS, HIDDEN, INTER, TOP_K, cold_copies, expert_bank, median_ms, quantized_object, start_run

PRODUCTS = (  # name, format, rows, columns
    ("gdn_qkvz", "q8_g32_fp16", 12288, HIDDEN),
    ("attn_qkgv", "q8_g32_fp16", 9216, HIDDEN),
    ("mixer_out", "q8_g32_fp16", HIDDEN, 4096),
    ("shared_gate_up", "q8_g32_fp16", 2 * INTER, HIDDEN),
    ("shared_down", "q8_g32_fp16", HIDDEN, INTER),
)

LAYERS = 40
SHARE = 1 << 14  # bytes each program of the prefetch launch asks for


@triton.jit
def _prefetch_kernel(data, SHARE: tl.constexpr):
    launch.prefetch_to_l2(data + tl.program_id(0).to(tl.int64) * SHARE, SHARE, SHARE // 128)


def prefetch(data: torch.Tensor) -> None:
    """Ask L2 for the bytes of `data` (a multiple of SHARE), one program per SHARE bytes."""
    _prefetch_kernel[(data.numel() // SHARE,)](data, SHARE=SHARE, num_warps=1)


def chain_us(products, routed, warm_product, ahead: bool) -> float:
    """Microseconds per layer of LAYERS layers of routed experts then a product (`warm_product` for every layer
    instead, if given), with a prefetch of each layer's product weights before its routed experts (`ahead`)."""

    def run() -> None:
        for layer in range(LAYERS):
            weights, product = products[layer]
            if ahead:
                prefetch(weights)
            routed(layer)
            (warm_product or product)()

    return 1e3 * median_ms(run, True) / LAYERS


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
    layout, records, table = expert_bank("q4_g64_fp16", "q5_g64_fp16")
    x = torch.randn(1, HIDDEN, device="cuda", dtype=torch.bfloat16)
    w = torch.softmax(torch.randn(1, TOP_K, device="cuda"), -1).to(torch.bfloat16)
    copies = EXPERTS // TOP_K
    routings = [torch.arange(c * TOP_K, (c + 1) * TOP_K, device="cuda")[None] for c in range(copies)]
    cold = median_ms(lambda: [moe.routed_experts(x, ids, w, records, table, layout) for ids in routings], True) / copies
    warm = median_ms(lambda: moe.routed_experts(x, routings[0], w, records, table, layout), True)
    row = {"op": "routed_experts", "bytes": TOP_K * layout.nbytes, "hbm_us": 1e3 * cold, "l2_us": 1e3 * warm}
    results.append(row)
    print(json.dumps(row), flush=True)
    layer_ids = [torch.randperm(EXPERTS, device="cuda")[:TOP_K][None] for _ in range(LAYERS)]

    def routed(layer: int) -> None:
        moe.routed_experts(x, layer_ids[layer], w, records, table, layout)

    for name, fmt, n, k in PRODUCTS[:3]:
        geometry = runtime_geometry(fmt, n, k)
        if geometry.encoded_size % SHARE:
            continue
        data, _ = quantized_object(fmt, n, k, LAYERS)
        xk = torch.randn(1, k, device="cuda", dtype=torch.bfloat16)
        products = [(data[c], lambda c=c: quant_linear.quantized_linear(xk, data[c], geometry)) for c in range(LAYERS)]
        row = {"op": f"routed_experts then {name}", "layers": LAYERS, "plain_us": chain_us(products, routed, None, False),
               "prefetched_us": chain_us(products, routed, None, True), "l2_resident_us": chain_us(products, routed, products[0][1], False)}
        results.append(row)
        print(json.dumps(row), flush=True)
    args.out.write_text(json.dumps({**header, "results": results}, indent=1))


if __name__ == "__main__":
    main()
