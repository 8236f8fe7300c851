"""Kernel microbenchmark at Qwen3.6-35B-A3B shapes: achieved HBM bandwidth of each decode kernel.

Usage (on a CUDA machine): python bench/kernel_sweeps.py --out bench/results/kernels_<gpu>.json [--sweeps formats] [--set SETTING ...]

`--sweeps formats` measures only the products the nvfp4 recipe stores as nvfp4 (the shared expert's gate/up and
down, the routed experts), each in the official recipe's row-split formats and in nvfp4 at 1, 4 and 8 tokens, the
shared expert's products (Q8 in the official recipe) also in Q4, the row-split format of nvfp4's size; each nvfp4
entry records `fraction_of_row_split`, its bandwidth fraction over the row-split entry just before it (Q4 for the
shared products: latency-bound at 1-2 MB, they take about the same time in any format, so a fraction over Q8's
would mostly count nvfp4's smaller size).

Weights are random but valid row-split bytes (random planes, finite fp16 scales), so the kernels
read exactly the bytes a real artifact would make them read. Each entry reports the median time
(triton.testing.do_bench), the bytes it must read, the resulting GB/s and the fraction of the
device bandwidth measured in the same run (a large device-to-device copy, read + write bytes).
Decode-sized calls are replayed from a CUDA graph that cycles through enough copies of the weights
(products) or routings (routed experts) to read at least COLD_BYTES per replay, several times the
L2 cache, so the weights come from HBM as in a decode step, where every layer reads its own
(`cold_copies` in each entry; replaying one small matrix would read it from L2).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import platform
from pathlib import Path

import torch
import triton
from triton.testing import do_bench, do_bench_cudagraph

from ninfer_offload.artifact.formats import NVFP4, BlockScaleGeometry, RowSplitGeometry, runtime_geometry
from ninfer_offload.artifact.records import ExpertRecordLayout
from ninfer_offload.kernels import attention, gdn, moe, quant_linear
from provenance import gpu_report_header
from kernel_settings import describe, kernel_modules, parse_setting

HIDDEN, INTER, EXPERTS, TOP_K = 2048, 512, 256, 8
COLD_BYTES = 4 << 28  # 1 GiB: 20x the H200's 50 MB L2


def cold_copies(nbytes: int, graph: bool) -> int:
    """Copies of an object of `nbytes` a graph replay cycles through (one for launched, prefill-sized calls)."""
    return max(1, -(-COLD_BYTES // nbytes)) if graph else 1


def random_object(geometry: RowSplitGeometry, count: int = 1) -> torch.Tensor:
    """`count` valid row-split objects back to back: random code planes, fp16 scales ~ 1/(qmax*sqrt(k))."""
    size = geometry.encoded_size
    data = torch.randint(0, 256, (count, size), dtype=torch.uint8, device="cuda")
    scales = torch.empty(count, geometry.scale_bytes // 2, dtype=torch.float16, device="cuda")
    scales.uniform_(0.5, 1.5).mul_(1.0 / (geometry.fmt.qmax * geometry.k**0.5))
    data[:, geometry.scale_offset :] = scales.view(torch.uint8)
    return data


def median_ms(fn, graph: bool) -> float:
    """Median milliseconds of fn: replayed from a CUDA graph (decode-sized calls, as the engine runs them) or launched."""
    torch.cuda.synchronize()  # the inputs were written on the default stream; the graph bench runs on its own
    if graph:
        return do_bench_cudagraph(fn, rep=100, return_mode="median")
    return do_bench(fn, warmup=25, rep=200, return_mode="median")


def device_bandwidth() -> float:
    """Bytes/s of a 4 GiB device-to-device copy (read + write)."""
    src = torch.empty(1 << 31, dtype=torch.uint8, device="cuda").random_()
    dst = torch.empty_like(src)
    ms = do_bench(lambda: dst.copy_(src), warmup=50, rep=300, return_mode="median")
    return 2 * src.numel() / (ms * 1e-3)


def random_nvfp4(geometry: BlockScaleGeometry, count: int = 1) -> torch.Tensor:
    """`count` valid nvfp4 objects back to back: random codes, E4M3FN scales 0.5..2, divisors ~ sqrt(k)."""
    data = torch.randint(0, 256, (count, geometry.encoded_size), dtype=torch.uint8, device="cuda")
    scales = torch.randint(0x30, 0x41, (count, geometry.divisor_offset - geometry.scale_offset), dtype=torch.uint8, device="cuda")
    data[:, geometry.scale_offset : geometry.divisor_offset] = scales
    divisors = torch.full((count, geometry.divisors), float(geometry.k) ** 0.5, dtype=torch.float32, device="cuda")
    data[:, geometry.divisor_offset :] = divisors.view(torch.uint8)
    return data


def quantized_object(fmt: str, n: int, k: int, count: int = 1) -> tuple[torch.Tensor, object]:
    geometry = runtime_geometry(fmt, n, k)
    return (random_nvfp4(geometry, count) if fmt == NVFP4 else random_object(geometry, count)), geometry


def bench_linear(name: str, fmt: str, n: int, k: int, tokens: int, bandwidth: float) -> dict:
    graph = tokens <= 8
    copies = cold_copies(runtime_geometry(fmt, n, k).encoded_size, graph)
    data, geometry = quantized_object(fmt, n, k, copies)
    x = torch.randn(tokens, k, device="cuda", dtype=torch.bfloat16)
    ms = median_ms(lambda: [quant_linear.quantized_linear(x, data[c], geometry) for c in range(copies)], graph) / copies
    moved = geometry.encoded_size + x.numel() * 2 + tokens * n * 2
    flops = 2 * tokens * n * k
    return {"op": name, "format": fmt, "shape": [n, k], "tokens": tokens, "ms": ms, "bytes": moved, "cold_copies": copies,
            "GBps": moved / ms / 1e6, "bandwidth_fraction": moved / (ms * 1e-3) / bandwidth, "TFLOPs": flops / ms / 1e9}


def expert_bank(gate_up_fmt: str, down_fmt: str) -> tuple[ExpertRecordLayout, torch.Tensor, torch.Tensor]:
    """(layout, records [EXPERTS, nbytes], offset table) of a bank of EXPERTS valid random expert records."""
    layout = ExpertRecordLayout.create(gate_up_fmt, down_fmt, HIDDEN, INTER)
    records = torch.randint(0, 256, (EXPERTS, layout.nbytes), dtype=torch.uint8, device="cuda")
    records[:, : layout.gate_up.encoded_size] = quantized_object(gate_up_fmt, 2 * INTER, HIDDEN, EXPERTS)[0]
    records[:, layout.down_offset : layout.down_offset + layout.down.encoded_size] = quantized_object(down_fmt, HIDDEN, INTER, EXPERTS)[0]
    return layout, records, moe.record_table(torch.arange(EXPERTS, device="cuda"), layout.nbytes)


def bench_moe(tokens: int, down_fmt: str, bandwidth: float, gate_up_fmt: str = "q4_g64_fp16") -> dict:
    layout, records, table = expert_bank(gate_up_fmt, down_fmt)
    x = torch.randn(tokens, HIDDEN, device="cuda", dtype=torch.bfloat16)
    graph = tokens <= 8
    copies = cold_copies(TOP_K * layout.nbytes, graph)  # routings of one bank: 460 MB, each reads its own experts
    routings = [torch.stack([torch.randperm(EXPERTS, device="cuda")[:TOP_K] for _ in range(tokens)]) for _ in range(copies)]
    w = torch.softmax(torch.randn(tokens, TOP_K, device="cuda"), -1).to(torch.bfloat16)
    ms = median_ms(lambda: [moe.routed_experts(x, ids, w, records, table, layout) for ids in routings], graph) / copies
    distinct = sum(int(torch.unique(ids).numel()) for ids in routings) / copies
    moved = distinct * (layout.gate_up.encoded_size + layout.down.encoded_size)
    out = moe.routed_experts(x, routings[0], w, records, table, layout)
    return {"op": "routed_experts", "gate_up_format": gate_up_fmt, "down_format": down_fmt, "tokens": tokens,
            "distinct_experts": distinct, "ms": ms, "bytes": moved, "cold_copies": copies, "GBps": moved / ms / 1e6,
            "bandwidth_fraction": moved / (ms * 1e-3) / bandwidth,
            "TFLOPs": 2 * tokens * TOP_K * 3 * INTER * HIDDEN / ms / 1e9, "finite": bool(torch.isfinite(out).all())}


def bench_attention(context: int, kv_dtype: torch.dtype, bandwidth: float) -> dict:
    kc = torch.randn(context, 2, 256, device="cuda").to(kv_dtype)
    vc = torch.randn(context, 2, 256, device="cuda").to(kv_dtype)
    q = torch.randn(1, 16, 256, device="cuda", dtype=torch.bfloat16)
    slots = torch.zeros(1, dtype=torch.int64, device="cuda")
    length = torch.tensor([context], dtype=torch.int64, device="cuda")
    ms = median_ms(lambda: attention.attention_decode(q, kc, vc, slots, length, 1, context), graph=True)
    moved = 2 * kc.numel() * kc.element_size()
    return {"op": "attention_decode", "kv_dtype": str(kv_dtype), "context": context, "ms": ms, "bytes": moved,
            "GBps": moved / ms / 1e6, "bandwidth_fraction": moved / (ms * 1e-3) / bandwidth}


def bench_gdn(bandwidth: float) -> dict:
    q = torch.randn(1, 16, 128, device="cuda", dtype=torch.bfloat16)
    k = torch.randn(1, 16, 128, device="cuda", dtype=torch.bfloat16)
    v = torch.randn(1, 32, 128, device="cuda", dtype=torch.bfloat16)
    a, b = torch.randn(2, 1, 32, device="cuda", dtype=torch.bfloat16)
    a_log, dt_bias = torch.randn(2, 32, device="cuda")
    state = torch.randn(1, 32, 128, 128, device="cuda")
    slots, valid = torch.zeros(1, dtype=torch.int64, device="cuda"), torch.ones(1, dtype=torch.int64, device="cuda")
    ms = median_ms(lambda: gdn.gdn_decode(q, k, v, a, b, a_log, dt_bias, state, slots, valid, 1, None), graph=True)
    moved = 2 * state.numel() * 4
    return {"op": "gdn_decode", "ms": ms, "bytes": moved, "GBps": moved / ms / 1e6, "bandwidth_fraction": moved / (ms * 1e-3) / bandwidth}


# Products the nvfp4 recipe stores as nvfp4, in the official recipe's formats (the routed experts: Q4 gate/up, Q5 down),
# and the row-split format of nvfp4's size.
NVFP4_PRODUCTS = [("shared_gate_up", "q8_g32_fp16", 1024, 2048), ("shared_down", "q8_g32_fp16", 2048, 512)]
SAME_SIZE_ROW_SPLIT = "q4_g64_fp16"
FORMAT_TOKENS = (1, 4, 8)


def compare_formats(results: list[dict], bandwidth: float, save) -> None:
    """Each product of NVFP4_PRODUCTS in its official format, in SAME_SIZE_ROW_SPLIT and in nvfp4, and the routed
    experts in their row-split formats and in nvfp4, per token count; each nvfp4 entry gets `fraction_of_row_split`
    over the entry before it."""
    for tokens in FORMAT_TOKENS:
        for name, fmt, n, k in NVFP4_PRODUCTS:
            for each in (fmt, SAME_SIZE_ROW_SPLIT, NVFP4):
                record(results, lambda: bench_linear(name, each, n, k, tokens, bandwidth), save)
            _ratio_to_previous(results, save)
        record(results, lambda: bench_moe(tokens, "q5_g64_fp16", bandwidth), save)
        record(results, lambda: bench_moe(tokens, NVFP4, bandwidth, gate_up_fmt=NVFP4), save)
        _ratio_to_previous(results, save)


def _ratio_to_previous(results: list[dict], save) -> None:
    """The last entry's bandwidth fraction over the one before it (both measured), as `fraction_of_row_split`."""
    base, last = results[-2], results[-1]
    if "bandwidth_fraction" in base and "bandwidth_fraction" in last:
        last["fraction_of_row_split"] = last["bandwidth_fraction"] / base["bandwidth_fraction"]
        save()
        print(f"{'':60s} nvfp4 at {100 * last['fraction_of_row_split']:.0f} % of the row-split fraction", flush=True)


def record(results: list[dict], measure, save) -> None:
    """Append and print one measurement (a configuration that cannot run is recorded with its error),
    then save the report so far (a run cut short keeps what it measured)."""
    try:
        r = measure()
    except Exception as err:  # e.g. a tile sweep entry needing more shared memory than the GPU has
        results.append({"error": repr(err)[:300]})
        print("error:", results[-1]["error"], flush=True)
        save()
        return
    results.append(r)
    save()
    label = " ".join(str(r[k]) for k in ("op", "format", "down_format", "kv_dtype", "shape", "context", "tokens", "tile") if k in r)
    print(f"{label:60s} {r['ms'] * 1e3:9.1f} us {r['GBps']:8.0f} GB/s ({100 * r['bandwidth_fraction']:5.1f}%)"
          + (f" {r['TFLOPs']:.0f} TFLOP/s" if "TFLOPs" in r else ""), flush=True)


def start_run(doc: str, add_arguments=None) -> tuple[argparse.Namespace, float, dict]:
    """A kernel benchmark's command line (--out, --commit, and what `add_arguments(parser)` adds), seed,
    device bandwidth and report header."""
    parser = argparse.ArgumentParser(description=doc.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--commit", default=None, help="commit measured (when the tree has no .git)")
    if add_arguments is not None:
        add_arguments(parser)
    args = parser.parse_args()
    torch.manual_seed(0)
    bandwidth = device_bandwidth()
    header = {**gpu_report_header(args.commit), "triton": triton.__version__, "host": platform.node(),
              "device_bandwidth_GBps": bandwidth / 1e9}
    return args, bandwidth, header


def main() -> None:
    def add_arguments(parser) -> None:
        parser.add_argument("--sweeps", choices=("all", "formats"), default="all", help="every kernel and launch shape, or formats only")
        parser.add_argument("--set", nargs="+", default=[], metavar="SETTING",
                            help="kernel settings MODULE.NAME=EXPRESSION for the whole run (bench/kernel_settings.py)")

    args, bandwidth, header = start_run(__doc__, add_arguments)
    settings = [parse_setting(text, kernel_modules()) for text in args.set]
    for module, attr, value in settings:
        setattr(module, attr, value)
    header["settings"] = describe(settings)
    results = []
    args.out.parent.mkdir(parents=True, exist_ok=True)

    def save() -> None:
        args.out.write_text(json.dumps({**header, "results": results}, indent=1))

    if args.sweeps == "formats":
        compare_formats(results, bandwidth, save)
        return

    shapes = [("gdn_qkvz", "q8_g32_fp16", 12288, 2048), ("attn_qkgv", "q8_g32_fp16", 9216, 2048), ("mixer_out", "q8_g32_fp16", 2048, 4096),
              ("shared_gate_up", "q8_g32_fp16", 1024, 2048), ("shared_down", "q8_g32_fp16", 2048, 512),
              ("output_head", "q6_g64_fp16", 248320, 2048)]
    for name, fmt, n, k in shapes:
        for tokens in (1, 8):
            record(results, lambda: bench_linear(name, fmt, n, k, tokens, bandwidth), save)
    for name, fmt, n, k in shapes[:3]:
        record(results, lambda: bench_linear(name, fmt, n, k, 4096, bandwidth), save)
    for name, _, n, k in shapes[:5]:  # the same products with nvfp4 weights (the nvfp4 recipe's experts are nvfp4)
        for tokens in (1, 8):
            record(results, lambda: bench_linear(name, NVFP4, n, k, tokens, bandwidth), save)
    for tokens in (1, 4):
        record(results, lambda: bench_moe(tokens, NVFP4, bandwidth, gate_up_fmt=NVFP4), save)
    defaults = quant_linear.GEMV_TILES, quant_linear.SMALL_GEMV_TILES, quant_linear.WIDE_GEMV_TILES
    for tile in ((8, 2048, 8, 3), (4, 1024, 4, 3), (8, 1024, 4, 3), (16, 512, 4, 3), (8, 512, 4, 4), (8, 256, 4, 4),
                 (16, 256, 4, 5), (4, 512, 4, 4), (8, 512, 8, 5), (32, 256, 4, 4), (16, 1024, 8, 3), (2, 2048, 4, 3),
                 (16, 2048, 8, 3), (4, 2048, 4, 3), (8, 1024, 8, 4), (16, 512, 8, 4)):
        # one token, a 3-draft verification; every product takes the tile as listed
        quant_linear.GEMV_TILES = quant_linear.SMALL_GEMV_TILES = quant_linear.WIDE_GEMV_TILES = quant_linear.GemvTiles(*tile)
        for name, fmt, n, k in (shapes[0], shapes[2], shapes[4], shapes[5]):
            for tokens in (1, 4):
                record(results, lambda: dict(bench_linear(name, fmt, n, k, tokens, bandwidth), tile=list(tile)), save)
    quant_linear.GEMV_TILES, quant_linear.SMALL_GEMV_TILES, quant_linear.WIDE_GEMV_TILES = defaults
    defaults = quant_linear.MMA_GEMV_TILES, quant_linear.WIDE_MMA_GEMV_TILES
    for tile in ((32, 256, 4, 4), (64, 256, 4, 3), (64, 128, 4, 4), (32, 128, 4, 4), (128, 128, 4, 3), (16, 256, 2, 4), (16, 512, 4, 3)):
        quant_linear.MMA_GEMV_TILES = quant_linear.WIDE_MMA_GEMV_TILES = quant_linear.GemvTiles(*tile)  # tensor cores: a decode batch
        for name, fmt, n, k in (shapes[0], shapes[2], shapes[3], shapes[5]):
            record(results, lambda: dict(bench_linear(name, fmt, n, k, quant_linear.MMA_MIN_TOKENS + 1, bandwidth), tile=list(tile)), save)
    quant_linear.MMA_GEMV_TILES, quant_linear.WIDE_MMA_GEMV_TILES = defaults
    defaults = moe.GEMV_TILES
    for shape in ((16, 2048, 8, 3), (16, 1024, 4, 3), (8, 512, 4, 4), (16, 512, 4, 4), (32, 256, 4, 4), (16, 256, 4, 5),
                  (8, 512, 2, 3), (4, 2048, 4, 3), (8, 2048, 4, 3), (32, 2048, 8, 3)):
        tiles = quant_linear.GemvTiles(*shape)
        moe.GEMV_TILES = tiles  # matrix-vector tile sweep: one token, a 3-draft verification, a batch of 8
        for tokens in (1, 4, 8):
            record(results, lambda: dict(bench_moe(tokens, "q5_g64_fp16", bandwidth), tile=list(dataclasses.astuple(tiles))), save)
    moe.GEMV_TILES = defaults
    defaults = moe.PREFILL_TILES
    for tiles in (moe.Tiles(64, 32, 64, 4, 256, 3), moe.Tiles(64, 64, 64, 4, 64, 3), moe.Tiles(64, 64, 64, 4, 64, 4),
                  moe.Tiles(128, 64, 64, 4, 64, 4), moe.Tiles(16, 64, 64, 4, 64, 4)):
        moe.PREFILL_TILES = tiles
        for tokens in (512, 4096):
            record(results, lambda: dict(bench_moe(tokens, "q5_g64_fp16", bandwidth), tile=dataclasses.astuple(tiles)), save)
    moe.PREFILL_TILES = defaults
    record(results, lambda: bench_moe(1, "q6_g64_fp16", bandwidth), save)
    for context in (1024, 8192, 32768):
        for kv in (torch.bfloat16, torch.float8_e4m3fn):
            record(results, lambda: bench_attention(context, kv, bandwidth), save)
    record(results, lambda: bench_gdn(bandwidth), save)
    print(f"device copy bandwidth {bandwidth / 1e9:.0f} GB/s")


if __name__ == "__main__":
    main()
