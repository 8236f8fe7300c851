"""gemlite's low-bit Triton kernels on the engine's dense decode products: time at 1-16 tokens against the byte roofline.

Usage (on a CUDA machine, with gemlite importable, e.g. from the wheels in .whl/):
    python bench/gemlite_eval.py --out results/gemlite.json [--commit SHA] [--variants q8_u8z q8_i8 q4_u8z] [--rep 50]
(default variants: q8_u8z q4_u8z, ~5 min on an H100, most of it gemlite's autotuning, which compiles each
config for each shape since N and K are compile-time constants of its kernels; q8_i8 adds ~2 min.)

Evaluates whether gemlite (PyPI) can carry the products of several tokens (a verification, a small batch)
at about the one-token time, the target being <= 1.15x the one-token time at 2..16 tokens. Each dense
product of the official recipe (Q8, one fp16 scale per 32 codes along K) and the same shapes in Q4 (one
fp16 scale per 64 codes) is built in gemlite's own layout through its public API (`GemLiteLinearTriton`
and `.pack`) from the engine's signed symmetric codes and scales:

- `q8_u8z`: codes + 128 as unsigned 8-bit codes with the integer zero point 128, packed four per int32
  word along K (gemlite's default packing): W = (q - 128) * scale, exactly the engine's values;
- `q8_i8`: the signed int8 codes unpacked (one per byte, gemlite's int8 path) with the scales and no zero
  point: W = q * scale, exactly the engine's values;
- `q4_u8z`: codes + 8 as unsigned 4-bit codes with the integer zero point 8, packed eight per int32 word:
  W = (q - 8) * scale, exactly the engine's values.

The scales stay fp16 as the engine stores them (gemlite dequantizes in the scales' dtype and casts the
weights to the bf16 activations' dtype for the product); a scalar integer zero point adds no per-group bytes,
so each layout reads the engine's bytes. Each product is timed at 1, 2, 4, 8 and 16 bf16 tokens from
CUDA-graph replay cycling through enough copies of the packed weights to read >= 1 GiB per replay
(`cold_copies`), so that they come from HBM as in a decode step. Each entry: median microseconds per
product, bytes (packed codes + scales + zero point as gemlite stores them + activations in and out),
the fraction of the device copy bandwidth measured in the same run, `vs_one_token` (time over the same
product's one-token time) and gemlite's kernel choice for that token count. Each product is checked once
at 4 tokens against an fp32 dequantize-and-matmul of the same codes (`max_abs_error` over the largest
output magnitude). A product that fails records an `error` entry and the others still run.
"""

from __future__ import annotations

import functools
import gc
import json
import time
import traceback

import torch
from triton.testing import do_bench, do_bench_cudagraph

from kernel_sweeps import cold_copies, start_run

PRODUCTS = [("gdn_qkvz", 12288, 2048), ("attn_qkgv", 9216, 2048), ("mixer_out", 2048, 4096),
            ("shared_gate_up", 1024, 2048), ("shared_down", 2048, 512)]
TOKENS = (1, 2, 4, 8, 16)
CHECK_TOKENS = 4
TARGET_VS_ONE_TOKEN = 1.15


def variant_spec(name: str) -> dict:
    """The engine format a variant stands for and how it is written in gemlite's layout."""
    specs = {
        "q8_u8z": {"engine_format": "q8_g32_fp16", "bits": 8, "group_size": 32, "qmin": -127, "qmax": 127,
                   "codes": "uint8 (q + 128)", "zero_point": 128, "packing_bitwidth": 32},
        "q8_i8": {"engine_format": "q8_g32_fp16", "bits": 8, "group_size": 32, "qmin": -127, "qmax": 127,
                  "codes": "int8 (q)", "zero_point": None, "packing_bitwidth": None},
        "q4_u8z": {"engine_format": "q4_g64_fp16", "bits": 4, "group_size": 64, "qmin": -8, "qmax": 7,
                   "codes": "uint8 (q + 8)", "zero_point": 8, "packing_bitwidth": 32},
    }
    return specs[name]


def engine_weights(spec: dict, n: int, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Signed codes [n, k] (int8) and fp16 scales [n, k / group] ~ 1/(qmax*sqrt(k)), as the engine's random objects."""
    codes = torch.randint(spec["qmin"], spec["qmax"] + 1, (n, k), dtype=torch.int8, device="cuda")
    scales = torch.empty(n, k // spec["group_size"], dtype=torch.float16, device="cuda")
    scales.uniform_(0.5, 1.5).mul_(1.0 / (spec["qmax"] * k**0.5))
    return codes, scales


def gemlite_layer(gemlite, spec: dict, codes: torch.Tensor, scales: torch.Tensor):
    """The codes and scales packed by gemlite for bf16 activations and outputs."""
    n, k = codes.shape
    layer = gemlite.GemLiteLinearTriton(spec["bits"], group_size=spec["group_size"], in_features=k, out_features=n,
                                        input_dtype=gemlite.DType.BF16, output_dtype=gemlite.DType.BF16)
    if spec["zero_point"] is None:
        layer.pack(codes, scales, zeros=None, bias=None)
    else:
        unsigned = (codes.to(torch.int16) + spec["zero_point"]).to(torch.uint8)
        layer.pack(unsigned, scales, zeros=spec["zero_point"], bias=None, packing_bitwidth=spec["packing_bitwidth"])
    return layer


def stored_bytes(tensors: list[torch.Tensor]) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


def reference(codes: torch.Tensor, scales: torch.Tensor, group: int, x: torch.Tensor) -> torch.Tensor:
    """fp32 x @ (codes * scales)^T: the engine's dequantized weights."""
    weights = codes.float() * scales.float().repeat_interleave(group, dim=1)
    return x.float() @ weights.t()


def correctness(forward, tensor_args: list[torch.Tensor], codes: torch.Tensor, scales: torch.Tensor, group: int) -> dict:
    """gemlite's product at CHECK_TOKENS against the fp32 dequantize-and-matmul of the same codes."""
    try:
        x = torch.randn(CHECK_TOKENS, codes.shape[1], device="cuda", dtype=torch.bfloat16)
        out = forward(x, tensor_args)
        ref = reference(codes, scales, group, x)
        check = {"tokens": CHECK_TOKENS, "output_dtype": str(out.dtype).removeprefix("torch."), "finite": bool(torch.isfinite(out).all()),
                 "max_abs_error": float((out.float() - ref).abs().max()), "output_scale": float(ref.abs().max())}
        check["relative_error"] = check["max_abs_error"] / check["output_scale"]
        return check
    except Exception as failure:  # the timings still run
        return {"tokens": CHECK_TOKENS, "error": f"{type(failure).__name__}: {failure}", "traceback": traceback.format_exc(limit=4)}


def layer_config(gemlite, layer, spec: dict) -> dict:
    import gemlite.triton_kernels.config as tuning

    w_q, layer_scales, zeros, _ = layer.get_tensor_args()
    return {"bits": spec["bits"], "group_size": spec["group_size"], "activations": "bfloat16", "outputs": "bfloat16",
            "codes": spec["codes"], "zero_point": spec["zero_point"], "W_q_dtype": str(w_q.dtype).removeprefix("torch."),
            "W_q_shape": list(w_q.shape), "W_q_contiguous": bool(w_q.is_contiguous()),
            "codes_per_word": int(layer.elements_per_sample), "scales_dtype": str(layer_scales.dtype).removeprefix("torch."),
            "zeros_stored": list(zeros.shape), "W_group_mode": int(layer.W_group_mode),
            "channel_scale_mode": int(layer.channel_scale_mode), "autotune": getattr(tuning.AUTOTUNE, "GEMM_SPLITK", None)}


def bench_product(gemlite, variant: str, op: str, n: int, k: int, bandwidth: float, rep: int) -> list[dict]:
    spec = variant_spec(variant)
    codes, scales = engine_weights(spec, n, k)
    layer = gemlite_layer(gemlite, spec, codes, scales)
    tensor_args, meta_args = layer.get_tensor_args(), layer.get_meta_args()
    config = layer_config(gemlite, layer, spec)
    weight_bytes = stored_bytes(tensor_args[:3])
    engine_bytes = n * k * spec["bits"] // 8 + n * (k // spec["group_size"]) * 2
    base = {"op": op, "variant": variant, "engine_format": spec["engine_format"], "shape": [n, k], "gemlite": config,
            "weight_bytes": weight_bytes, "engine_weight_bytes": engine_bytes}

    def forward(x: torch.Tensor, args: list[torch.Tensor]) -> torch.Tensor:
        return gemlite.forward_functional(x, None, args, meta_args)

    check = correctness(forward, tensor_args, codes, scales, spec["group_size"])
    del codes, scales

    copies = cold_copies(weight_bytes, graph=True)
    copy_args = [tensor_args] + [[t.clone() for t in tensor_args[:3]] + [tensor_args[3]] for _ in range(copies - 1)]
    assert all(c[0].stride() == tensor_args[0].stride() for c in copy_args), "a copy lost the packed layout's strides"
    entries, one_token_us = [], None
    for tokens in TOKENS:
        entry = {**base, "tokens": tokens, "matmul_type": gemlite.core.get_matmul_type(tokens, spec["bits"])}
        try:
            x = torch.randn(tokens, k, device="cuda", dtype=torch.bfloat16)
            tuning = time.perf_counter()
            forward(x, tensor_args)  # autotunes this token count outside the graph capture
            torch.cuda.synchronize()
            timing = time.perf_counter()
            ms = replay_ms(forward, x, copy_args, rep)
            entry["wall_s"] = {"autotune": timing - tuning, "replay": time.perf_counter() - timing}
            us = ms * 1e3
            one_token_us = us if tokens == 1 else one_token_us
            moved = weight_bytes + tokens * k * 2 + tokens * n * 2
            entry.update({"us": us, "bytes": moved, "cold_copies": copies, "GBps": moved / ms / 1e6,
                          "bandwidth_fraction": moved / (ms * 1e-3) / bandwidth,
                          "vs_one_token": us / one_token_us if one_token_us else None})
        except Exception as failure:  # one token count's failure is recorded, the others still run
            entry.update({"error": f"{type(failure).__name__}: {failure}", "traceback": traceback.format_exc(limit=4)})
        if tokens == CHECK_TOKENS:
            entry["check"] = check
        entries.append(entry)
    return entries


def replay_ms(forward, x: torch.Tensor, copy_args: list[list[torch.Tensor]], rep: int) -> float:
    """Median milliseconds of one product: a CUDA graph replay of it over every copy, divided by the copies."""
    torch.cuda.synchronize()  # the inputs were written on the default stream; the graph bench runs on its own
    return do_bench_cudagraph(lambda: [forward(x, args) for args in copy_args], rep=rep, return_mode="median") / len(copy_args)


def shorten_autotuning(gemlite, warmup_ms: int, rep_ms: int) -> int:
    """Benchmark each config gemlite's autotuners try for `rep_ms` (Triton's default: 100 ms) so that 75 tunings fit
    the run; the kernels they pick are timed as usual. Returns how many autotuners it set."""
    bench = functools.partial(do_bench, warmup=warmup_ms, rep=rep_ms)
    count = 0
    for kernels in gemlite.core.GEMLITE_TRITON_MAPPING.values():
        for kernel in kernels.kernel:
            if hasattr(kernel, "_do_bench"):
                kernel._do_bench = bench
                count += 1
    return count


def print_table(results: list[dict]) -> None:
    print(f"{'op':<15}{'variant':<8}{'T':>3}{'kernel':>16}{'us':>9}{'bw frac':>9}{'vs T=1':>8}  check")
    for r in results:
        if "us" not in r:
            print(f"{r['op']:<15}{r['variant']:<8}{r.get('tokens', '-'):>3}  ERROR {r['error'][:90]}")
            continue
        vs = f"{r['vs_one_token']:.2f}" if r["vs_one_token"] else "-"
        check = r.get("check", {})
        check = f"rel err {check['relative_error']:.1e}" if "relative_error" in check else check.get("error", "")[:60]
        print(f"{r['op']:<15}{r['variant']:<8}{r['tokens']:>3}{r['matmul_type']:>16}{r['us']:>9.2f}"
              f"{r['bandwidth_fraction']:>9.3f}{vs:>8}  {check}")


def summarize(results: list[dict]) -> list[dict]:
    """Per product: its one-token time and bandwidth fraction, the worst `vs_one_token` over 2..16 tokens, the target met."""
    summary = []
    for key in dict.fromkeys((r["variant"], r["op"]) for r in results):
        timed = {r["tokens"]: r for r in results if (r["variant"], r["op"]) == key and "us" in r}
        several = [timed[t]["vs_one_token"] for t in TOKENS[1:] if t in timed and timed[t]["vs_one_token"]]
        check = next((r["check"] for r in results if (r["variant"], r["op"]) == key and "check" in r), {})
        summary.append({"variant": key[0], "op": key[1], "one_token_us": timed[1]["us"] if 1 in timed else None,
                        "bandwidth_fraction": {t: timed[t]["bandwidth_fraction"] for t in timed},
                        "worst_vs_one_token": max(several) if several else None,
                        "meets_target": bool(several) and len(several) == len(TOKENS) - 1 and max(several) <= TARGET_VS_ONE_TOKEN,
                        "relative_error": check.get("relative_error")})
    return summary


def main() -> None:
    def add_arguments(parser) -> None:
        parser.add_argument("--variants", nargs="+", choices=("q8_u8z", "q8_i8", "q4_u8z"), default=["q8_u8z", "q4_u8z"],
                            help="layouts to time (each ~2-4 min on an H100: gemlite compiles every config per shape)")
        parser.add_argument("--rep", type=int, default=50, help="milliseconds of graph replay per measurement")
        parser.add_argument("--autotune-rep", type=int, default=20,
                            help="milliseconds per config in gemlite's autotuning (0: Triton's default, 100)")

    args, bandwidth, header = start_run(__doc__, add_arguments)
    began = time.perf_counter()
    import gemlite  # after the bandwidth: importing it loads its tuned configs for this GPU

    tuned = shorten_autotuning(gemlite, 5, args.autotune_rep) if args.autotune_rep > 0 else 0
    header.update({"gemlite": gemlite.__version__, "tokens": list(TOKENS), "target_vs_one_token": TARGET_VS_ONE_TOKEN,
                   "autotune": f"gemlite's 'fast' configs, {args.autotune_rep} ms each ({tuned} autotuners)" if tuned else "gemlite's",
                   "timing": f"do_bench_cudagraph median, rep={args.rep} ms, per product over cold copies",
                   "bytes": "packed codes + scales + zero point as gemlite stores them + bf16 activations in and out"})
    results: list[dict] = []
    args.out.parent.mkdir(parents=True, exist_ok=True)

    def save() -> None:
        args.out.write_text(json.dumps({**header, "wall_s": time.perf_counter() - began, "summary": summarize(results),
                                        "results": results}, indent=1))

    for variant in args.variants:
        for op, n, k in PRODUCTS:
            try:
                results.extend(bench_product(gemlite, variant, op, n, k, bandwidth, args.rep))
            except Exception as failure:  # one product's failure is recorded, the others still run
                results.append({"op": op, "variant": variant, "shape": [n, k], "error": f"{type(failure).__name__}: {failure}",
                                "traceback": traceback.format_exc(limit=6)})
            gc.collect()
            torch.cuda.empty_cache()
            save()
            spent = [r["wall_s"] for r in results if (r["variant"], r["op"]) == (variant, op) and "wall_s" in r]
            print(f"{variant} {op}: done at {time.perf_counter() - began:.0f} s (autotune {sum(w['autotune'] for w in spent):.1f} s,"
                  f" replay {sum(w['replay'] for w in spent):.1f} s)", flush=True)
    print(f"device copy bandwidth {bandwidth / 1e9:.0f} GB/s")
    print_table(results)
    for row in summarize(results):
        worst = f"{row['worst_vs_one_token']:.2f}x" if row["worst_vs_one_token"] else "-"
        print(f"{row['variant']:<8}{row['op']:<15} worst T=2..16 {worst:>6}  target {'met' if row['meets_target'] else 'missed'}")


if __name__ == "__main__":
    main()
