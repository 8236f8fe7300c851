"""Products of 1..16 tokens at Qwen3.6-35B-A3B shapes: the engine's path against `kernels/small_batch.py`.

Usage (on a CUDA machine): python bench/few_tokens_sweep.py --out bench/results/sweeps/few_tokens_<gpu>_<commit>.json

For each dense product of the decode step (q8, and the same shapes in q4) at T = 1, 2, 4, 8 and 16 tokens:
the engine's `quantized_linear` as it picks its path, and the weights-as-M tensor-core kernel of
`small_batch.few_tokens_linear` under the launch shapes of SHAPES (the best per product and T kept in
`best`). Each entry: median microseconds of a CUDA-graph replay cycling through enough copies of the weights
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


def replay_us(fn, copies: int) -> float:
    torch.cuda.synchronize()
    return 1e3 * do_bench_cudagraph(fn, rep=40, return_mode="median") / copies


def main() -> None:
    args, bandwidth, header = start_run(__doc__)
    report = {**header, "results": [], "best": []}
    args.out.parent.mkdir(parents=True, exist_ok=True)

    def record(result: dict) -> None:
        report["results"].append(result)
        args.out.write_text(json.dumps(report, indent=1))

    for fmt, name, n, k in PRODUCTS:
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
            for block_n, block_k, warps, stages, split, as_m in SHAPES:
                try:
                    out = small_batch.few_tokens_linear(x, data[0], geometry, block_n, block_k, split, warps, stages, as_m)
                    expected = quant_linear.quantized_linear(x, data[0], geometry)
                    error = float((out.float() - expected.float()).norm() / expected.float().norm())
                    us = replay_us(
                        lambda: [small_batch.few_tokens_linear(x, data[c], geometry, block_n, block_k, split, warps, stages, as_m)
                                 for c in range(copies)], copies,
                    )
                except Exception as exc:  # noqa: BLE001 - a shape that does not compile is recorded, the sweep goes on
                    launch = [block_n, block_k, warps, stages, split, as_m]
                    record({**base, "kernel": "few_tokens", "launch": launch, "error": str(exc)[:300]})
                    continue
                entry = {**base, "kernel": "few_tokens", "launch": [block_n, block_k, warps, stages, split, as_m], "us": us,
                         "bandwidth_fraction": moved / (us * 1e-6) / bandwidth, "vs_one_token": us / one_token,
                         "relative_error_vs_engine": error}
                record(entry)
                if best is None or us < best["us"]:
                    best = entry
            if best is not None:
                report["best"].append(best)
                print(f"{fmt:12s} {name:15s} T={t:2d} engine {engine_us:7.1f} us ({100 * moved / (engine_us * 1e-6) / bandwidth:5.1f}%)"
                      f" | few_tokens {best['us']:7.1f} us ({100 * best['bandwidth_fraction']:5.1f}%) x{best['vs_one_token']:.2f}"
                      f" {best['launch']} err {best['relative_error_vs_engine']:.1e}", flush=True)
    args.out.write_text(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
