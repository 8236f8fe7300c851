"""Shared memory, registers and spills of the Triton kernels' tuned launch configurations, compiled for a GPU
architecture on any machine: Triton compiles to a cubin without a GPU (its bundled ptxas), so a kernel change can
be checked against the profiles' cards (sm_120: RTX 5090, RTX 5060 Ti, RTX PRO 6000) before device time.

    python bench/kernel_resources.py --arch 120 --out bench/results/kernel_resources_sm120.json

Each configuration is a kernel with the constexprs and launch options the engine uses at the full model's shapes
(Q8, the largest row-split codes, and NVFP4 where a kernel reads expert records), its pointers and integers
specialized as a real launch's where they are multiples of 16 (the software pipeline then stages its loads through
shared memory, as on the device; every one taken as aligned, so the figures are upper bounds). Reported per
configuration: dynamic shared memory (Triton's metadata), registers and stack per thread (`cuobjdump -res-usage`
of the cubin; stack is spilled registers), and whether the shared memory fits a block of the architecture
(`--shared-limit`, default sm_120's 101,376 bytes; launches through `kernels/fitting.py` then take fewer stages).
"""

from __future__ import annotations

import argparse
import inspect
import json
import re
import subprocess
import tempfile
from pathlib import Path

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from ninfer_offload.kernels import attention, moe, quant_linear
from provenance import gpu_report_header

HIDDEN, INTER, HEAD_DIM, QUERY_HEADS, KV_HEADS = 2048, 512, 256, 16, 2
BF16 = "*bf16"
# Pointer parameters by name (every other parameter not a constexpr is an i32, `eps`/`scale` an fp32).
POINTERS = {
    **{name: BF16 for name in ("x", "x2", "norm_w", "routed", "score", "out", "total", "normed", "dense_w", "dense_out", "act",
                               "conv_states", "conv_weight", "q", "k_pool", "v_pool", "gate", "up", "weights")},
    **{name: "*u8" for name in ("w", "arena", "shared_down")},
    **{name: "*i64" for name in ("table", "block_expert", "block_pairs", "topk_ids", "slots", "lengths")},
    **{name: "*i32" for name in ("arrivals", "deferred", "use_counts", "shared_use_counts", "valid")},
    **{name: "*fp32" for name in ("partial", "weighted", "part_out", "part_max", "part_sum")},
}
FLOATS = {"eps", "scale"}
Q8 = {"NVFP4": False, "BITS": 8, "GROUP": 32}
NVFP4 = {"NVFP4": True, "BITS": 4, "GROUP": 16}


def configurations() -> list[tuple[str, object, dict, dict]]:
    """(name, kernel, constexprs, launch options) of the launches to compile."""
    out = []
    attend = dict(HQ=QUERY_HEADS, HKV=KV_HEADS, D=HEAD_DIM, D_PAD=HEAD_DIM, GROUP_PAD=16,
                  BLOCK_S=attention.DECODE_BLOCK_S, IEEE=False)
    for kv, dtype in (("bf16", BF16), ("fp8", "*fp8e4nv")):
        out.append((f"attention decode, {kv} KV", attention._decode_partial_kernel, attend,
                    {"num_warps": attention.DECODE_WARPS, "num_stages": attention.DECODE_STAGES,
                     "types": {"k_pool": dtype, "v_pool": dtype}}))
    tiled = dict(K_PAD=HIDDEN, BLOCK_N=quant_linear.DECODE_BLOCK_N, BLOCK_K=256, IEEE=False, SPLIT=4, EPILOGUE=0, DENSE=False,
                 SCALE_ORDER=quant_linear.TILED_SCALE_ORDER)
    for tokens in (16, 64):
        for name, fmt in (("Q8", Q8), ("NVFP4", NVFP4)):
            out.append((f"tiled product, {tokens} tokens, {name}", quant_linear._quantized_matmul_kernel,
                        {**tiled, **fmt, "BLOCK_M": tokens}, {"num_warps": quant_linear.DECODE_WARPS}))
    gemv = dict(K_PAD=HIDDEN, INPUT=0, NORM_D=1, EPILOGUE=0, ROW_BLOCK=1, DENSE=False, DENSE_BLOCK_N=2, DENSE_BLOCK_K=HIDDEN,
                CONV_C=0, IEEE=False, TAPS=1)
    for name, tiles, mma in (("one token", quant_linear.GEMV_TILES, False), ("tensor cores", quant_linear.MMA_GEMV_TILES, True),
                             ("head, tensor cores", quant_linear.WIDE_MMA_GEMV_TILES, True)):
        out.append((f"matrix-vector product, {name}", quant_linear._quantized_gemv_kernel,
                    {**gemv, **Q8, "BLOCK_T": 16 if mma else 1, "LOOP_T": 8 if mma else 1, "BLOCK_N": tiles.block_n,
                     "BLOCK_K": tiles.block_k, "MMA": mma}, {"num_warps": tiles.warps, "num_stages": tiles.stages}))
    for name, tiles in (("prefill", moe.PREFILL_TILES), ("prefill over host records", moe.HOST_PREFILL_TILES), ("batch", moe.DECODE_TILES)):
        for fmt_name, fmt in (("Q8", Q8), ("NVFP4", NVFP4)):
            common = {**fmt, "BLOCK_M": tiles.block_m, "IEEE": False, "PASS": 0, "WHERE": 0}
            options = {"num_warps": tiles.warps, "num_stages": tiles.stages}
            out.append((f"MoE gate/up, {name}, {fmt_name}", moe._gate_up_swiglu_kernel,
                        {**common, "TOP_K": 8, "WHOLE_TILES": fmt["NVFP4"], "K_PAD": HIDDEN, "BLOCK_N": tiles.gate_up_n,
                         "BLOCK_K": min(tiles.block_k, HIDDEN)}, options))
            out.append((f"MoE down, {name}, {fmt_name}", moe._down_kernel,
                        {**common, "K_PAD": INTER, "BLOCK_N": tiles.down_n, "BLOCK_K": min(tiles.block_k, INTER)}, options))
    out.append(("MoE gate/up matrix-vector, a program per pair", moe._gate_up_swiglu_gemv_kernel,
                {"TOP_K": 8, **Q8, "WHOLE_TILES": False, "K_PAD": HIDDEN, "BLOCK_N": moe.GEMV_TILES.block_n,
                 "BLOCK_K": moe.GEMV_TILES.block_k, "COUNT": False, "SHARED_READS": False, "COUNT_SHARED": False, "PAIRS_PAD": 64},
                {"num_warps": moe.GEMV_TILES.warps, "num_stages": moe.GEMV_TILES.stages}))
    out.append(("MoE split down with the shared expert", moe._down_split_gemv_kernel,
                {"TOP_K": 8, **Q8, "K_PAD": INTER, "BLOCK_N": moe.SPLIT_DOWN_N, "BLOCK_K": moe.SPLIT_DOWN_BLOCK_K, "SHARED_EXPERT": True,
                 "S_NVFP4": False, "S_BITS": 8, "S_GROUP": 32, "S_K_PAD": INTER, "S_BLOCK_K": moe.SPLIT_DOWN_BLOCK_K,
                 "SHARED_READS": False, "PAIRS_PAD": 64},
                {"num_warps": moe.SPLIT_DOWN_WARPS, "num_stages": moe.GEMV_TILES.stages}))
    return out


def compile_for(kernel, constexprs: dict, options: dict, arch: int):
    """The kernel compiled for sm_`arch`, its pointers and integers taken as multiples of 16 (as a launch on the device
    specializes aligned ones; with every one aligned the pipeline stages the most: an upper bound)."""
    params = list(inspect.signature(kernel.fn).parameters)
    if "PDL" in params:  # launched plainly (`launch.launch_options`): the same resources up to two instructions
        plain = {"PREFETCH": False, "L2_CODE_ROW": 1, "L2_CODE_LINES": 0, "L2_SCALE_ROW": 1, "L2_SCALE_LINES": 0}
        constexprs = {"PDL": False, **{name: value for name, value in plain.items() if name in params}, **constexprs}
    types = {**POINTERS, **options.get("types", {})}
    signature = {
        name: "constexpr" if name in constexprs else types.get(name, "fp32" if name in FLOATS else "i32") for name in params
    }
    aligned = {(params.index(name),): [["tt.divisibility", 16]] for name in params if signature[name][0] in "*i"}
    source = ASTSource(fn=kernel, signature=signature, constexprs={(params.index(k),): v for k, v in constexprs.items()}, attrs=aligned)
    launch = {key: value for key, value in options.items() if key != "types"}
    return triton.compile(source, target=GPUTarget("cuda", arch, 32), options=launch)


def resource_usage(cubin: bytes) -> dict:
    """Registers and stack bytes per thread of a cubin (`cuobjdump -res-usage`, bundled with Triton)."""
    tool = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump"
    with tempfile.NamedTemporaryFile(suffix=".cubin") as file:
        file.write(cubin)
        file.flush()
        text = subprocess.run([str(tool), "-res-usage", file.name], capture_output=True, text=True, check=True).stdout
    found = re.search(r"REG:(\d+) STACK:(\d+)", text)
    return {"registers": int(found[1]), "stack_bytes": int(found[2])}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--arch", type=int, default=120, help="compute capability as one number (90: H200, 120: the RTX 50 cards)")
    parser.add_argument("--shared-limit", type=int, default=101_376, help="shared memory per block of that architecture, bytes")
    parser.add_argument("--out", type=Path, help="write the JSON report here")
    parser.add_argument("--commit", default=None, help="commit compiled (where the tree has no .git)")
    args = parser.parse_args()
    rows = []
    for name, kernel, constexprs, options in configurations():
        compiled = compile_for(kernel, constexprs, options, args.arch)
        row = {"launch": name, "kernel": kernel.fn.__name__, "num_stages": options.get("num_stages"), "num_warps": options["num_warps"],
               "shared_bytes": compiled.metadata.shared, **resource_usage(compiled.asm["cubin"])}
        row["fits"] = row["shared_bytes"] <= args.shared_limit
        rows.append(row)
        print(f"{name:58s} shared {row['shared_bytes']:7d}  registers {row['registers']:3d}  stack {row['stack_bytes']:4d}"
              f"{'' if row['fits'] else '  OVER THE LIMIT'}")
    if args.out:
        report = {**gpu_report_header(args.commit), "arch": args.arch, "shared_limit": args.shared_limit, "triton": triton.__version__}
        report["launches"] = rows
        args.out.write_text(json.dumps(report, indent=1) + "\n")


if __name__ == "__main__":
    main()
