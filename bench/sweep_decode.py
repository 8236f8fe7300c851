"""Launch-shape sweep of the decode step's products at Qwen3.6-35B-A3B shapes, from CUDA-graph replay.

Usage (on a CUDA machine): python bench/sweep_decode.py --out bench/results/sweeps/decode_<gpu>.json [--sweeps paths ...]

`paths`: each product at 1, 2, 4, 8 and 16 tokens through the matrix-vector kernel (up to 8 tokens) and
through the tiled tensor-core kernel (forced for every token count): what a step of several tokens (a
verification, a small batch) costs on each path. The other sweeps, for 1, 4 and 8 tokens: the quantized
matrix-vector products (their launch shape as the engine picks
it, and the output head under several shapes), the dense products (router + shared-expert score,
GDN a/b) under several rows per program, the routed experts (8 of 256 experts per token) under
several launch shapes, and attention decode at a fixed 32K capacity for growing lengths (what the
engine launches with its default context). Each entry: median microseconds, bytes read, fraction of
the device bandwidth measured in the same run. Weights are random valid bytes (bench/kernel_sweeps.py).
"""

from __future__ import annotations

import dataclasses
import json

import torch
from triton.testing import do_bench_cudagraph

from kernel_sweeps import EXPERTS, HIDDEN, INTER, TOP_K, quantized_object, start_run
from ninfer_offload.artifact.records import ExpertRecordLayout
from ninfer_offload.kernels import attention, dense_linear, moe, quant_linear

TOKENS = (1, 4, 8)
LINEAR = [("gdn_qkvz", "q8_g32_fp16", 12288, 2048), ("attn_qkgv", "q8_g32_fp16", 9216, 2048), ("mixer_out", "q8_g32_fp16", 2048, 4096),
          ("shared_gate_up", "q8_g32_fp16", 1024, 2048), ("shared_down", "q8_g32_fp16", 2048, 512)]
HEAD_TILES = [(32, 256, 4, 4), (64, 256, 8, 4), (16, 256, 4, 4), (32, 512, 4, 3), (16, 2048, 8, 3), (8, 2048, 8, 3), (32, 1024, 8, 3)]
DENSE = [("router_score", 257, 2048), ("gdn_ab", 64, 2048)]
DENSE_ROWS = (1, 2, 4, 8)
MOE_TILES = [quant_linear.GemvTiles(*tiles) for tiles in ((16, 2048, 8, 3), (8, 2048, 8, 3), (16, 2048, 4, 3), (32, 2048, 8, 3),
                                                           (8, 2048, 4, 3), (16, 1024, 4, 3))]
ATTENTION_CAPACITY = 32768
ATTENTION_LENGTHS = (1024, 8192, 32768)
ATTENTION_SPANS = (128, 256, 64)
# Launch shapes swept at the default span: (cached rows per K/V tile, warps, pipeline stages, merge dimensions per program).
ATTENTION_SHAPES = [(64, 4, 3, 256), (64, 4, 3, 64), (32, 4, 3, 64), (32, 4, 2, 64), (64, 8, 3, 64), (32, 8, 4, 64), (128, 8, 2, 64),
                    (64, 4, 2, 64)]


def replay_us(fn) -> float:
    torch.cuda.synchronize()
    return 1e3 * do_bench_cudagraph(fn, rep=50, return_mode="median")


def entry(op: str, us: float, moved: int, bandwidth: float, **fields) -> dict:
    return {"op": op, **fields, "us": us, "bytes": moved, "bandwidth_fraction": moved / (us * 1e-6) / bandwidth}


def sweep_linear(bandwidth: float, record) -> None:
    for name, fmt, n, k in LINEAR:
        data, geometry = quantized_object(fmt, n, k)
        for t in TOKENS:
            x = torch.randn(t, k, device="cuda", dtype=torch.bfloat16)
            us = replay_us(lambda: quant_linear.quantized_linear(x, data[0], geometry))
            record(entry(name, us, geometry.encoded_size, bandwidth, tokens=t, tile=list(dataclasses.astuple(quant_linear.gemv_tiles(n)))))
    data, geometry = quantized_object("q6_g64_fp16", 248320, 2048)
    default = quant_linear.WIDE_GEMV_TILES
    for tile in HEAD_TILES:
        quant_linear.WIDE_GEMV_TILES = quant_linear.GemvTiles(*tile)
        for t in TOKENS:
            x = torch.randn(t, 2048, device="cuda", dtype=torch.bfloat16)
            us = replay_us(lambda: quant_linear.quantized_linear(x, data[0], geometry))
            record(entry("output_head", us, geometry.encoded_size, bandwidth, tokens=t, tile=list(tile)))
    quant_linear.WIDE_GEMV_TILES = default


PATH_TOKENS = (1, 2, 4, 8, 16)
PATH_PRODUCTS = LINEAR + [("output_head", "q6_g64_fp16", 248320, 2048), ("gdn_qkvz_nvfp4", "nvfp4", 12288, 2048)]


def sweep_paths(bandwidth: float, record) -> None:
    default = quant_linear.GEMV_MAX_TOKENS
    for name, fmt, n, k in PATH_PRODUCTS:
        data, geometry = quantized_object(fmt, n, k)
        for t in PATH_TOKENS:
            x = torch.randn(t, k, device="cuda", dtype=torch.bfloat16)
            paths = ([("matrix-vector", default)] if t <= default else []) + [("tensor-core tiles", 0)]
            for path, limit in paths:
                quant_linear.GEMV_MAX_TOKENS = limit
                us = replay_us(lambda: quant_linear.quantized_linear(x, data[0], geometry))
                record(entry(name, us, geometry.encoded_size, bandwidth, format=fmt, tokens=t, path=path))
    quant_linear.GEMV_MAX_TOKENS = default


def sweep_dense(bandwidth: float, record) -> None:
    default = dense_linear.GEMV_BLOCK_N
    for name, n, k in DENSE:
        w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16)
        for rows in DENSE_ROWS:
            dense_linear.GEMV_BLOCK_N = rows
            for t in TOKENS:
                x = torch.randn(t, k, device="cuda", dtype=torch.bfloat16)
                us = replay_us(lambda: dense_linear.dense_linear(x, w))
                record(entry(name, us, w.numel() * 2, bandwidth, tokens=t, rows_per_program=rows))
    dense_linear.GEMV_BLOCK_N = default


def sweep_moe(bandwidth: float, record) -> None:
    layout = ExpertRecordLayout.create("q4_g64_fp16", "q5_g64_fp16", HIDDEN, INTER)
    records = torch.randint(0, 256, (EXPERTS, layout.nbytes), dtype=torch.uint8, device="cuda")
    records[:, : layout.gate_up.encoded_size] = quantized_object("q4_g64_fp16", 2 * INTER, HIDDEN, EXPERTS)[0]
    down = slice(layout.down_offset, layout.down_offset + layout.down.encoded_size)
    records[:, down] = quantized_object("q5_g64_fp16", HIDDEN, INTER, EXPERTS)[0]
    table = moe.record_table(torch.arange(EXPERTS, device="cuda"), layout.nbytes)
    per_expert = layout.gate_up.encoded_size + layout.down.encoded_size

    def measure(t: int, shared: int, **fields) -> None:
        """t tokens routed to 8 random experts each, the first `shared` of them the same for every token."""
        x = torch.randn(t, HIDDEN, device="cuda", dtype=torch.bfloat16)
        ids = torch.stack([torch.randperm(EXPERTS, device="cuda")[:TOP_K] for _ in range(t)])
        ids[1:, :shared] = ids[0, :shared]
        w = torch.softmax(torch.randn(t, TOP_K, device="cuda"), -1).to(torch.bfloat16)
        us = replay_us(lambda: moe.routed_experts(x, ids, w, records, table, layout))
        distinct = int(torch.unique(ids).numel())
        record(entry("routed_experts", us, distinct * per_expert, bandwidth, tokens=t, distinct_experts=distinct, **fields))

    default = moe.GEMV_TILES
    for tiles in MOE_TILES:
        moe.GEMV_TILES = tiles
        for t in TOKENS:
            measure(t, 0, tile=list(dataclasses.astuple(tiles)))
        for t in TOKENS[1:]:
            # half of each token's experts shared, as consecutive tokens share them
            measure(t, TOP_K // 2, tile=list(dataclasses.astuple(tiles)), shared_experts=TOP_K // 2)
    moe.GEMV_TILES = default


def sweep_attention(bandwidth: float, record) -> None:
    k_pool = torch.randn(ATTENTION_CAPACITY, 2, 256, device="cuda").to(torch.bfloat16)
    v_pool = torch.randn(ATTENTION_CAPACITY, 2, 256, device="cuda").to(torch.bfloat16)
    q = torch.randn(1, 16, 256, device="cuda", dtype=torch.bfloat16)
    slots = torch.zeros(1, dtype=torch.int64, device="cuda")

    def measure(**fields) -> None:
        for length in ATTENTION_LENGTHS:
            lengths = torch.tensor([length], dtype=torch.int64, device="cuda")
            us = replay_us(lambda: attention.attention_decode(q, k_pool, v_pool, slots, lengths, 1, ATTENTION_CAPACITY))
            moved = 2 * length * 2 * 256 * 2  # K and V rows of both KV heads, bf16
            record(entry("attention_decode", us, moved, bandwidth, length=length, capacity=ATTENTION_CAPACITY, **fields))

    default = attention.SPAN
    for span in ATTENTION_SPANS:
        attention.SPAN = span
        measure(span=span)
    attention.SPAN = default
    knobs = ("DECODE_BLOCK_S", "DECODE_WARPS", "DECODE_STAGES", "MERGE_DIMS")
    defaults = [getattr(attention, knob) for knob in knobs]
    for shape in ATTENTION_SHAPES:
        for knob, value in zip(knobs, shape):
            setattr(attention, knob, value)
        measure(span=default, shape=dict(zip(knobs, shape)))
    for knob, value in zip(knobs, defaults):
        setattr(attention, knob, value)

SWEEPS = {"linear": sweep_linear, "moe": sweep_moe, "attention": sweep_attention, "dense": sweep_dense, "paths": sweep_paths}


def main() -> None:
    def add_arguments(parser) -> None:
        parser.add_argument("--sweeps", nargs="+", choices=tuple(SWEEPS), default=["linear", "moe", "attention", "dense"])

    args, bandwidth, header = start_run(__doc__, add_arguments)
    report = {**header, "results": []}
    args.out.parent.mkdir(parents=True, exist_ok=True)

    def record(result: dict) -> None:
        report["results"].append(result)
        args.out.write_text(json.dumps(report, indent=1))
        keys = ("tokens", "tile", "shared_down_min_tokens", "rows_per_program", "length", "span", "path", "shape")
        shape = {k: result[k] for k in keys if k in result}
        print(f"{result['op']:18s} {json.dumps(shape):48s} {result['us']:9.1f} us ({100 * result['bandwidth_fraction']:5.1f}%)", flush=True)

    for name in args.sweeps:
        SWEEPS[name](bandwidth, record)


if __name__ == "__main__":
    main()
