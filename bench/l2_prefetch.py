"""Does an L2 prefetch of the next product's weights, issued before the current one, hide their reads?

    python bench/l2_prefetch.py --out bench/results/l2_prefetch_h200.json

A chain of 40 cold products (each its own copy of the weights, as 40 layers are), replayed from a CUDA
graph, with and without `kernels.prefetch.L2Prefetch` of the next copy launched before each product,
and with a gap of small latency-bound launches after each product (as routing, recurrences and short
attention leave the memory idle in a decode step). Per product: us, and the ratio with / without.
"""

from __future__ import annotations

import json

import torch
from triton.testing import do_bench_cudagraph

from ninfer_offload.kernels import prefetch, quant_linear
from kernels import quantized_object, start_run

LAYERS = 40


def chain_us(products, prefetches, gap: int, ahead: int) -> float:
    """Microseconds per product of the chain: each preceded by the prefetch of the product `ahead` on (if any) and
    followed by `gap` tiny launches."""
    small = torch.zeros(64, device="cuda")

    def run() -> None:
        for i, product in enumerate(products):
            if prefetches is not None:
                prefetches[(i + ahead) % len(products)]()
            product()
            for _ in range(gap):
                small.add_(1.0)

    torch.cuda.synchronize()
    return do_bench_cudagraph(run, rep=200, return_mode="median") * 1e3 / len(products)


def main() -> None:
    args, bandwidth, header = start_run(__doc__)
    results = []
    shapes = [("gdn_qkvz", "q8_g32_fp16", 12288, 2048), ("mixer_out", "q8_g32_fp16", 2048, 4096), ("attn_qkgv", "q8_g32_fp16", 9216, 2048)]
    for name, fmt, n, k in shapes:
        data, geometry = quantized_object(fmt, n, k, LAYERS)
        x = torch.randn(1, k, device="cuda", dtype=torch.bfloat16)
        products = [lambda c=c: quant_linear.quantized_linear(x, data[c], geometry) for c in range(LAYERS)]
        for chunk, per_program in ((1 << 16, 32), (1 << 14, 32), (1 << 12, 32)):
            prefetch.CHUNK, prefetch.CHUNKS_PER_PROGRAM = chunk, per_program
            prefetches = [prefetch.L2Prefetch([data[c]]) for c in range(LAYERS)]
            for gap in (0, 3):
                plain = chain_us(products, None, gap, 1)
                for ahead in (1, 2):
                    with_prefetch = chain_us(products, prefetches, gap, ahead)
                    row = {"op": name, "format": fmt, "shape": [n, k], "bytes": geometry.encoded_size, "chunk": chunk,
                           "chunks_per_program": per_program, "programs": prefetches[0].programs, "gap_launches": gap, "ahead": ahead,
                           "plain_us": plain, "prefetched_us": with_prefetch, "ratio": with_prefetch / plain,
                           "plain_bandwidth_fraction": geometry.encoded_size / (plain * 1e-6) / bandwidth}
                    results.append(row)
                    print(json.dumps(row), flush=True)
        prefetch_alone = chain_us([lambda: None] * LAYERS, prefetches, 0, 0)
        results.append({"op": name, "prefetch_launch_us": prefetch_alone})
        print(name, "prefetch launch alone", prefetch_alone, flush=True)
        args.out.write_text(json.dumps({**header, "results": results}, indent=1))


if __name__ == "__main__":
    main()
