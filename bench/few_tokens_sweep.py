"""Products of 1..16 tokens at Qwen3.6-35B-A3B shapes: the engine's path against `kernels/small_batch.py`.

Usage (on a CUDA machine): python bench/few_tokens_sweep.py --out bench/results/sweeps/few_tokens_<gpu>_<commit>.json

For each dense product of the decode step (q8, and the same shapes in q4) at T = 1, 2, 4, 8 and 16 tokens:
the engine's `quantized_linear` as it picks its path, the tensor-core kernel of `small_batch.few_tokens_linear`
under the launch shapes of SHAPES and the CUDA-core kernel of `small_batch.deferred_gemv` under GEMV_SHAPES and the
group-at-a-time tensor-core kernel of `small_batch.group_dot_linear` under GROUP_DOT_SHAPES (the best per product
and T kept in `best`). Each entry: median microseconds of a CUDA-graph replay cycling through enough copies of the weights
that they come from HBM (`kernel_sweeps.cold_copies`), the bytes read, the fraction of the device bandwidth
measured in the same run, and the time over the engine's one-token time of the same product (`vs_one_token`).
"""

from __future__ import annotations

import json

import torch
from triton.testing import do_bench_cudagraph

from kernel_sweeps import cold_copies, quantized_object, start_run
from ninfer_offload.kernels import quant_linear, small_batch

TOKENS = (1, 2, 4, 8, 16)
PRODUCTS = [("q8_g32_fp16", "gdn_qkvz", 12288, 2048), ("q8_g32_fp16", "mixer_out", 2048, 4096), ("q8_g32_fp16", "shared_down", 2048, 512),
            ("q4_g64_fp16", "gdn_qkvz", 12288, 2048)]
# (rows per program, K per tile, warps, pipeline stages, K splits (None: about two programs per SM), weights as the MMA's M)
SHAPES = [(64, 256, 4, 3, None, True), (128, 256, 8, 3, None, True), (64, 128, 4, 4, None, True), (64, 256, 4, 3, None, False)]
# `deferred_gemv` (CUDA cores, one reduction per program): (rows per program, K per tile, warps), those whose
# accumulators fit 128 float32 registers a thread at the token count
GEMV_SHAPES = [(8, 256, 4), (16, 256, 8), (8, 512, 8), (4, 512, 4), (16, 128, 4), (8, 128, 4)]
# `group_dot_linear` (one scale group per tensor-core product, the scale on its result): (rows per program, warps, stages)
GROUP_DOT_SHAPES = [(64, 4, 4), (128, 4, 4), (128, 8, 4), (64, 4, 6), (256, 8, 4), (32, 4, 4)]
KERNELS = ("few_tokens", "deferred_gemv", "group_dot")


def replay_us(fn, copies: int) -> float:
    torch.cuda.synchronize()
    return 1e3 * do_bench_cudagraph(fn, rep=40, return_mode="median") / copies


def main() -> None:
    def add_arguments(parser) -> None:
        parser.add_argument("--kernels", nargs="+", choices=KERNELS, default=list(KERNELS))
        parser.add_argument("--products", nargs="+", default=None, help="op:format pairs, e.g. gdn_qkvz:q8_g32_fp16 (default: all)")

    args, bandwidth, header = start_run(__doc__, add_arguments)
    report = {**header, "results": [], "best": []}
    args.out.parent.mkdir(parents=True, exist_ok=True)

    def record(result: dict) -> None:
        report["results"].append(result)
        args.out.write_text(json.dumps(report, indent=1))

    chosen = [p for p in PRODUCTS if args.products is None or f"{p[1]}:{p[0]}" in args.products]
    for fmt, name, n, k in chosen:
        data, geometry = quantized_object(fmt, n, k, 1)
        copies = cold_copies(geometry.encoded_size, True)
        data = data.expand(copies, -1).contiguous()
        moved = geometry.encoded_size
        one_token = None
        for t in TOKENS:
            x = torch.randn(t, k, device="cuda", dtype=torch.bfloat16)
            engine_us = replay_us(lambda: [quant_linear.quantized_linear(x, data[c], geometry) for c in range(copies)], copies)
            one_token = engine_us if t == 1 else one_token
            base = {"op": name, "format": fmt, "shape": [n, k], "tokens": t, "bytes": moved}
            record({**base, "kernel": "engine", "us": engine_us, "bandwidth_fraction": moved / (engine_us * 1e-6) / bandwidth,
                    "vs_one_token": engine_us / one_token})
            best = None
            launches = [("few_tokens", shape) for shape in SHAPES] if "few_tokens" in args.kernels else []
            if "deferred_gemv" in args.kernels:
                bt = 1 << (t - 1).bit_length()
                launches += [("deferred_gemv", (bn, bk, w, 3, None, None)) for bn, bk, w in GEMV_SHAPES if bt * bn * bk <= 128 * 32 * w]
            if "group_dot" in args.kernels:
                launches += [("group_dot", (bn, None, w, st, None, None)) for bn, w, st in GROUP_DOT_SHAPES]
            for kernel, (block_n, block_k, warps, stages, split, as_m) in launches:
                def run(c: int, kernel=kernel, block_n=block_n, block_k=block_k, warps=warps, stages=stages, split=split, as_m=as_m):
                    if kernel == "group_dot":
                        return small_batch.group_dot_linear(x, data[c], geometry, block_n, split, warps, stages)
                    if kernel == "deferred_gemv":
                        return small_batch.deferred_gemv(x, data[c], geometry, block_n, block_k, warps, stages)
                    return small_batch.few_tokens_linear(x, data[c], geometry, block_n, block_k, split, warps, stages, as_m)

                try:
                    out = run(0)
                    expected = quant_linear.quantized_linear(x, data[0], geometry)
                    error = float((out.float() - expected.float()).norm() / expected.float().norm())
                    us = replay_us(lambda: [run(c) for c in range(copies)], copies)
                except Exception as exc:  # noqa: BLE001 - a shape that does not compile is recorded, the sweep goes on
                    launch = [block_n, block_k, warps, stages, split, as_m]
                    record({**base, "kernel": kernel, "launch": launch, "error": str(exc)[:300]})
                    continue
                entry = {**base, "kernel": kernel, "launch": [block_n, block_k, warps, stages, split, as_m], "us": us,
                         "bandwidth_fraction": moved / (us * 1e-6) / bandwidth, "vs_one_token": us / one_token,
                         "relative_error_vs_engine": error}
                record(entry)
                if best is None or us < best["us"]:
                    best = entry
            if best is not None:
                report["best"].append(best)
                print(f"{fmt:12s} {name:15s} T={t:2d} engine {engine_us:7.1f} us ({100 * moved / (engine_us * 1e-6) / bandwidth:5.1f}%)"
                      f" | {best['kernel']} {best['us']:7.1f} us ({100 * best['bandwidth_fraction']:5.1f}%) x{best['vs_one_token']:.2f}"
                      f" {best['launch']} err {best['relative_error_vs_engine']:.1e}", flush=True)
    args.out.write_text(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
