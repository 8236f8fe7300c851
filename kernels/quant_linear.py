"""Quantized linear `y = x @ W^T` straight from the stored planes: row-split (q4/q5/q6/q8) or nvfp4.

Reference op: `ReferenceBackend.linear(x, w)` with `w` a `QuantizedMatrix` or `Nvfp4Matrix`, i.e.
`x @ w.dequantize().T`. Every path serves both formats, the `NVFP4` constexpr picking the tile
decoder (`kernels/tiles.py`). Three paths by token count:
* up to `GEMV_MAX_TOKENS` tokens (decode, verification of a few drafts, small decode batches) of
  the large products, up to `SMALL_GEMV_MAX_TOKENS` of the others (`on_matrix_vector`): a
  matrix-vector kernel. Each program owns a few rows and walks the whole row in wide tiles,
  decoding each tile once (`load_gemv_tile`); one token multiplies the codes by its x in registers
  (`dot_code_tile`); several tokens of a large product (`MMA_MIN_ROWS`) go through tensor cores
  with every token at once (`mma_code_tile`: the scaled codes, the token block padded to 16 rows),
  smaller products keep per-token multiply-adds: no split-K partial sums, one launch.
  `fused_gemv` is the same
  kernel with the elementwise step before or after a product folded in: its input computed as it
  is read (SwiGLU of gate/up, x * sigmoid(gate) for the attention output, the GDN output's gated
  RMSNorm per head: `gated_linear`, `gated_norm_linear`, `shared_expert.shared_expert`) and its
  rows added to another output, score-gated (the shared expert).
* up to `FUSED_MAX_TOKENS`: a tiled kernel: each program decodes a weight tile in registers
  (`load_tile`) and multiplies it with `tl.dot` (the token block is padded to 16 rows). Few-token
  products split K across programs so that even a [2048, 4096] projection fills the GPU; their
  partial sums are added in a fixed order by the last program of each tile to arrive, so results are
  deterministic and no reduction is launched. It adds the shared expert's gated add where it stores
  (`gated_add`); its inputs are computed before it (SwiGLU, gate, norm: slower inside it).
* above (prefill): the weight is dequantized once per call into a transient buffer (the same tile
  decoders) and multiplied with cuBLAS, which beats an in-kernel tile decode once the product is
  compute-bound.
The two in-kernel paths divide nvfp4 rows by their FP32 divisor in the fp32 accumulator; the
dequantize path divides each weight (correctly rounded, as the reference).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from ninfer_offload.artifact.formats import ObjectGeometry
from ninfer_offload.kernels import dense_linear, fitting
from ninfer_offload.kernels.arrivals import arrival_counts, last_to_arrive, rearm
from ninfer_offload.kernels.dense_linear import dense_gemv_rows
from ninfer_offload.kernels.elementwise import add_gated, swiglu
from ninfer_offload.kernels.gdn import conv_rows
from ninfer_offload.kernels.launch import await_producer, launch_options, prefetch_to_l2
from ninfer_offload.kernels.norm import (
    add_rmsnorm, add_rmsnorm_row, gated_rmsnorm, offset_normed, residual_inv_rms, residual_sum,
)
from ninfer_offload.kernels.nvfp4 import load_divisors, row_divisors
from ninfer_offload.kernels.reduce import sum_middle
from ninfer_offload.kernels.rowsplit import dot_code_tile, mma_code_tile
from ninfer_offload.kernels.tiles import TileGeometry, block_k_for, gemv_block_k, load_gemv_tile, load_tile, program_rows

# Token counts up to this use the matrix-vector kernel, up to FUSED_MAX_TOKENS the tiled
# one; above it, transient dequantization + cuBLAS.
GEMV_MAX_TOKENS = 8
FUSED_MAX_TOKENS = 64


@dataclass(frozen=True)
class GemvTiles:
    """Launch shape of the matrix-vector kernel: rows per program, widest column tile, warps, pipeline depth."""

    block_n: int
    block_k: int
    warps: int
    stages: int


# Launch shapes of the matrix-vector kernel, the fastest in the sweeps and the step (docs/performance.md, Kernels):
# 16 rows x 2048 columns on 8 warps for the layers' products; half the rows per program (twice the programs) for
# products of fewer than FEW_ROWS rows, also at 2-4 tokens; the output head (Q6, 248,320 rows) in 32 x 512 tiles.
# Module-level so benchmarks can sweep them.
GEMV_TILES = GemvTiles(16, 2048, 8, 3)
SMALL_GEMV_TILES = GemvTiles(8, 2048, 8, 3)  # products of fewer than FEW_ROWS rows
WIDE_GEMV_TILES = GemvTiles(32, 512, 4, 3)
WIDE_GEMV_MIN_ROWS = 65536
FEW_ROWS = 8192
# Products of at least MMA_MIN_ROWS rows multiply several tokens (from MMA_MIN_TOKENS) on tensor cores
# (every token at once, the token block padded to MMA_BLOCK_T rows) instead of per token on CUDA cores,
# whose work grows with every token; smaller products gain nothing there and keep the CUDA-core path up to
# GEMV_MAX_TOKENS (docs/performance.md, Kernels).
MMA_MIN_TOKENS = 2
MMA_MIN_ROWS = FEW_ROWS
MMA_BLOCK_T = 16
# Tensor-core launch shapes: 32 x 256 on 4 warps for the layers' products, 64 x 128 for the output head, the
# activations as the left operand (the fastest in the sweep: docs/performance.md, Kernels).
MMA_GEMV_TILES = GemvTiles(32, 256, 4, 4)
WIDE_MMA_GEMV_TILES = GemvTiles(64, 128, 4, 4)


# Products of fewer than MMA_MIN_ROWS rows take the matrix-vector kernel for up to SMALL_GEMV_MAX_TOKENS
# tokens and the tiled kernel beyond: its split-K tensor-core tiles fill the GPU whatever the token count, while
# the per-token multiply-adds grow with every token (at 8 tokens the tiled kernel wins on these products, at 4 the
# matrix-vector kernel leads or ties: docs/performance.md, Decode step settings).
SMALL_GEMV_MAX_TOKENS = 4
# A matrix-vector product computes its input step (a norm, a gate: `_input_value`) itself for up to this many tokens,
# every program for its own columns (the norm statistics in each program again); past it the elementwise kernels
# compute the input once before the product (`_unfolded_input`, `add_rmsnorm`), a launch more. Module-level so
# `bench/step_ab.py` can compare them.
FOLD_INPUT_MAX_TOKENS = GEMV_MAX_TOKENS


def on_matrix_vector(n: int, tokens: int) -> bool:
    """Whether `tokens` tokens of an n-row product take the matrix-vector kernel (else the tiled one)."""
    return tokens <= GEMV_MAX_TOKENS and (tokens <= SMALL_GEMV_MAX_TOKENS or n >= MMA_MIN_ROWS)


def on_tensor_cores(n: int, tokens: int) -> bool:
    """Whether the matrix-vector kernel multiplies `tokens` tokens of an n-row product on tensor cores."""
    return tokens >= MMA_MIN_TOKENS and n >= MMA_MIN_ROWS


def gemv_tiles(n: int, tokens: int = 1) -> GemvTiles:
    """The matrix-vector launch shape for a product with n output rows and `tokens` tokens."""
    if on_tensor_cores(n, tokens):
        return WIDE_MMA_GEMV_TILES if n >= WIDE_GEMV_MIN_ROWS else MMA_GEMV_TILES
    if n >= WIDE_GEMV_MIN_ROWS:
        return WIDE_GEMV_TILES
    if n < FEW_ROWS:
        return SMALL_GEMV_TILES
    return GEMV_TILES


# Fused kernel: weight rows per program and warps (module-level so benchmarks can sweep them), and its pipeline
# depth (Triton's default; 99,328 bytes of shared memory for 64 Q8 tokens, `bench/kernel_resources.py`: a launch
# takes fewer stages where the device has less, `fitting.launch`).
DECODE_BLOCK_N = 32
DECODE_WARPS = 4
TILED_STAGES = 3
# A few tokens' tiled product splits K across programs: the last program of each output tile to arrive sums
# the splits' float32 tiles (`arrivals`), or, turned off, a `sum_middle` launch after it does (slower: docs/performance.md,
# Decode step settings). Module-level so benchmarks can compare the two.
SUM_IN_PRODUCT = True
# The tiled kernel runs a layer's dense control rows beside its quantized product of one input (the router with the
# shared expert's gate/up) as more row blocks of its launch, or, turned off, `dense_linear` runs them apart (slower:
# docs/performance.md, Decode step settings). Module-level so benchmarks can compare the two.
PAIR_IN_TILED = True
# The tiled kernel adds the shared expert's rows score-gated into the routed output where it stores them, or, turned
# off, an `add_gated` launch after it does. It does not compute its input (SwiGLU, the sigmoid gate, the gated norm)
# as it reads it: that was slower than the product plus a launch computing the input (docs/performance.md, Decode
# step settings). Module-level so benchmarks can compare the two.
GATED_ADD_IN_TILED = True
# An nvfp4 tiled program takes its rows in `tiles.program_rows`' scale order (each scale tile's words of its rows
# contiguous) or, turned off, BLOCK_N consecutive rows (scale words 16 bytes apart, the outputs contiguous). The
# tiled kernel reads VRAM-resident matrices only (the shared expert's), where the sectors its scale reads leave are
# L2 hits for the neighbouring programs; consecutive rows measured slightly faster (docs/performance.md, NVFP4 against
# the official recipe). Module-level so benchmarks can compare the two.
TILED_SCALE_ORDER = False

# Matrix-vector products of one k tile and at least PREFETCH_MIN_TOKENS tokens read the tile before they wait for
# the kernel before them (`launch`), so its loads overlap that kernel's tail. One token does not: held across the
# wait, the tile raises the product's registers and fewer programs are resident per SM; nor do products of several
# tiles (docs/performance.md, Decode step settings).
PREFETCH_MIN_TOKENS = 2
# Products that do not read their tile before the wait ask L2 for their rows' row-split codes (the low plane) and
# scales there instead (`launch.prefetch_to_l2`: no register held).
L2_PREFETCH = False

# What the matrix-vector kernel multiplies (INPUT) and what it does with its rows (EPILOGUE).
# x; silu(x) * x2; x * sigmoid(x2); rmsnorm(x) per NORM_D columns * norm_w * silu(x2);
# (1 + norm_w) * rmsnorm(x + x2) over the whole row (`add_rmsnorm`'s offset form: a layer's input)
PLAIN, SWIGLU, SIGMOID_GATE, GATED_NORM = tl.constexpr(0), tl.constexpr(1), tl.constexpr(2), tl.constexpr(3)
ADD_NORM = tl.constexpr(4)
# the rows; routed + sigmoid(score) * rows; the first channels through GDN's conv (`gdn.conv_rows`), the rest as they are
STORE, ADD_GATED, CONV = tl.constexpr(0), tl.constexpr(1), tl.constexpr(2)


@triton.jit
def _input_value(xv, x2v, wv, inv_rms, INPUT: tl.constexpr):
    """A token's input from its x, x2 and norm-weight values (their dtypes, elementwise), as float32 rounded to the
    activation dtype where the reference rounds: the plain x, silu(x) * x2, x * sigmoid(x2), the gated RMSNorm of
    x (`ReferenceBackend.gated_rmsnorm`, gate x2; `inv_rms` of each column's group), or the offset RMSNorm of
    x + x2 (`inv_rms` of the token's row)."""
    xf = xv.to(tl.float32)
    if INPUT == ADD_NORM:
        xf = offset_normed(residual_sum(xv, x2v), inv_rms, wv).to(xv.dtype).to(tl.float32)
    if INPUT == GATED_NORM:
        normed = (xf * inv_rms).to(xv.dtype).to(tl.float32)
        weight = wv.to(xv.dtype).to(tl.float32)
        zf = x2v.to(tl.float32)
        gate = (zf / (1.0 + tl.exp(-zf))).to(xv.dtype).to(tl.float32)
        xf = ((weight * normed).to(xv.dtype).to(tl.float32) * gate).to(xv.dtype).to(tl.float32)
    if INPUT == SWIGLU:
        silu = (xf / (1.0 + tl.exp(-xf))).to(xv.dtype).to(tl.float32)
        xf = (silu * x2v.to(tl.float32)).to(xv.dtype).to(tl.float32)
    if INPUT == SIGMOID_GATE:
        gf = x2v.to(tl.float32)
        xf = (xf * (1.0 / (1.0 + tl.exp(-gf))).to(xv.dtype).to(tl.float32)).to(xv.dtype).to(tl.float32)
    return xf


@triton.jit
def input_columns(
    x, x2, row, row2, k0, K, norm_w, eps, INPUT: tl.constexpr, NORM_D: tl.constexpr, BLOCK_K: tl.constexpr, ROW_BLOCK: tl.constexpr
):
    """One token's input tile, columns [k0, k0 + BLOCK_K) in order, float32 (`_input_value`; 0 past K);
    GATED_NORM groups of NORM_D columns lie inside the tile; ADD_NORM reads the token's whole rows
    (ROW_BLOCK >= K columns) for its statistic."""
    cols = k0 + tl.arange(0, BLOCK_K)
    raw = tl.load(x + row + cols, mask=cols < K, other=0.0)
    raw2 = raw  # x2 and the norm weights: read by the fused inputs only
    if INPUT != PLAIN:
        raw2 = tl.load(x2 + row2 + cols, mask=cols < K, other=0.0)
    weights = raw2
    inv_rms = tl.full([BLOCK_K], 1.0, tl.float32)
    if INPUT == GATED_NORM:
        weights = tl.load(norm_w + cols % NORM_D)
        squares = raw.to(tl.float32) * raw.to(tl.float32)
        per_group = tl.sum(tl.reshape(squares, [BLOCK_K // NORM_D, NORM_D]), axis=1)
        inv_rms = tl.reshape(tl.broadcast_to(tl.rsqrt(per_group / NORM_D + eps)[:, None], [BLOCK_K // NORM_D, NORM_D]), [BLOCK_K])
    if INPUT == ADD_NORM:
        weights = tl.load(norm_w + cols, mask=cols < K, other=0.0)
        inv_rms = tl.full([BLOCK_K], 1.0, tl.float32) * residual_inv_rms(x + row, x2 + row2, K, eps, ROW_BLOCK)
    return _input_value(raw, raw2, weights, inv_rms, INPUT)


@triton.jit
def _token_input_columns(
    x, x2, toks, T, stride_x, stride_x2, k0, K, norm_w, eps,
    INPUT: tl.constexpr, NORM_D: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_K: tl.constexpr,
):
    """`input_columns` of every token at once, [BLOCK_T, BLOCK_K] in x's dtype (tokens `toks` past T read zeros;
    their rows are never stored). Every input but ADD_NORM, whose products take a normalised input on tensor cores
    (`residual_norm_gemv`)."""
    tok = toks[:, None].to(tl.int64)
    cols = k0 + tl.arange(0, BLOCK_K)[None, :]
    mask = (toks < T)[:, None] & (cols < K)
    raw = tl.load(x + tok * stride_x + cols, mask=mask, other=0.0)
    raw2 = raw
    if INPUT != PLAIN:
        raw2 = tl.load(x2 + tok * stride_x2 + cols, mask=mask, other=0.0)
    weights = raw2
    inv_rms = tl.full([BLOCK_T, BLOCK_K], 1.0, tl.float32)
    if INPUT == GATED_NORM:
        weights = tl.load(norm_w + (k0 + tl.arange(0, BLOCK_K)) % NORM_D)[None, :]
        squares = raw.to(tl.float32) * raw.to(tl.float32)
        per_group = tl.sum(tl.reshape(squares, [BLOCK_T, BLOCK_K // NORM_D, NORM_D]), axis=2)
        groups = tl.broadcast_to(tl.rsqrt(per_group / NORM_D + eps)[:, :, None], [BLOCK_T, BLOCK_K // NORM_D, NORM_D])
        inv_rms = tl.reshape(groups, [BLOCK_T, BLOCK_K])
    return _input_value(raw, raw2, weights, inv_rms, INPUT).to(x.dtype.element_ty)


@triton.jit
def gated_add(acc, routed, score, stride_score, toks, T, offsets, mask, out):
    """routed + sigmoid(score) * rows for float32 rows `acc` [BLOCK_T, BLOCK_N] at `offsets`: the rows, the gate and
    the scaled rows each rounded to the activations' dtype, as `ReferenceBackend.shared_expert` rounds."""
    shared = acc.to(out.dtype.element_ty).to(tl.float32)
    sv = tl.load(score + toks.to(tl.int64) * stride_score, mask=toks < T, other=0.0)
    gated = (1.0 / (1.0 + tl.exp(-sv.to(tl.float32)))).to(sv.dtype).to(tl.float32)
    scaled = (gated[:, None] * shared).to(sv.dtype).to(tl.float32)
    return tl.load(routed + offsets, mask=mask, other=0.0).to(tl.float32) + scaled


@triton.jit
def _accumulate_tile(
    acc, codes, scales, k0, x, x2, toks, T, stride_x, stride_x2, K, norm_w, eps,
    INPUT: tl.constexpr, NORM_D: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    ROW_BLOCK: tl.constexpr, GROUP: tl.constexpr, MMA: tl.constexpr, IEEE: tl.constexpr,
):
    """acc [BLOCK_T, BLOCK_N] plus every token's product with one decoded weight tile (columns from k0): on tensor
    cores for every token at once with MMA, else per token (rows past T repeat the last; they are never stored)."""
    if MMA:
        xt = _token_input_columns(x, x2, toks, T, stride_x, stride_x2, k0, K, norm_w, eps, INPUT, NORM_D, BLOCK_T, BLOCK_K)
        acc = mma_code_tile(codes, scales, xt, acc, GROUP, BLOCK_N, BLOCK_K, IEEE)
    else:
        for t in tl.static_range(BLOCK_T):  # the tile is decoded once for every token
            token = tl.minimum(t, T - 1).to(tl.int64)
            xt = input_columns(x, x2, token * stride_x, token * stride_x2, k0, K, norm_w, eps, INPUT, NORM_D, BLOCK_K, ROW_BLOCK)
            part = dot_code_tile(codes, scales, xt, GROUP, BLOCK_N, BLOCK_K)
            acc = tl.where(toks[:, None] == t, acc + part[None, :], acc)
    return acc


@triton.jit
def _quantized_gemv_kernel(
    x,
    x2,
    stride_x,
    stride_x2,
    norm_w,
    eps,
    w,
    routed,
    score,
    stride_score,
    out,
    total,
    normed,
    dense_w,
    dense_out,
    T,
    N,
    K,
    DENSE_N,
    QUANTIZED_PROGRAMS,
    high_offset,
    scale_offset,
    divisor_offset,
    NVFP4: tl.constexpr,
    BITS: tl.constexpr,
    GROUP: tl.constexpr,
    K_PAD: tl.constexpr,
    BLOCK_T: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    INPUT: tl.constexpr,
    NORM_D: tl.constexpr,
    EPILOGUE: tl.constexpr,
    ROW_BLOCK: tl.constexpr,
    DENSE: tl.constexpr,
    LOOP_T: tl.constexpr,
    DENSE_BLOCK_N: tl.constexpr,
    DENSE_BLOCK_K: tl.constexpr,
    conv_states,
    conv_weight,
    slots,
    valid,
    CONV_C,
    MMA: tl.constexpr,
    IEEE: tl.constexpr,
    TAPS: tl.constexpr,
    PDL: tl.constexpr,
    PREFETCH: tl.constexpr,
    L2_CODE_ROW: tl.constexpr,
    L2_CODE_LINES: tl.constexpr,
    L2_SCALE_ROW: tl.constexpr,
    L2_SCALE_LINES: tl.constexpr,
):
    """Programs [0, QUANTIZED_PROGRAMS): BLOCK_N rows each of every token's product with the quantized
    W, per token on CUDA cores or, with MMA (BLOCK_T >= 16), for every token at once on tensor cores;
    loops over the tokens themselves unroll LOOP_T (T's next power of two) times.
    With DENSE, the programs after them: DENSE_BLOCK_N rows each of the product with `dense_w`
    (`paired_gemv`). With ADD_NORM, program 0 also stores each token's x + x2 and its norm
    (`add_rmsnorm`'s outputs) in `total` and `normed`, for the ops after this one. With PREFETCH (PDL, a
    product of one k tile: `PREFETCH_MIN_TOKENS`) a program reads its weight tile before it waits for the kernel
    before this one; with L2_CODE_LINES (PDL, row-split, `L2_PREFETCH`) it asks L2 for its rows' codes (bytes per row
    L2_CODE_ROW) and scales (L2_SCALE_ROW) there instead."""
    tl.static_assert(not (MMA and INPUT == ADD_NORM), "tensor-core products take the residual's norm from add_rmsnorm")
    pid = tl.program_id(0)
    if DENSE and pid >= QUANTIZED_PROGRAMS:
        await_producer(PDL)
        dense_gemv_rows(
            pid - QUANTIZED_PROGRAMS, x, x2, stride_x, stride_x2, norm_w, eps, dense_w, dense_out, T, DENSE_N, K,
            LOOP_T, DENSE_BLOCK_N, DENSE_BLOCK_K, INPUT == ADD_NORM, ROW_BLOCK,
        )
    else:
        rows = program_rows(pid, BLOCK_N, NVFP4)
        row_mask = rows < N
        divisors = row_divisors(w, rows, row_mask, divisor_offset, NVFP4)
        toks = tl.arange(0, BLOCK_T)
        acc = tl.zeros([BLOCK_T, BLOCK_N], dtype=tl.float32)
        if PREFETCH:  # the one weight tile, read while the kernel before this one finishes (`launch.await_producer`)
            codes, scales = load_gemv_tile(w, rows, row_mask, 0, high_offset, scale_offset, NVFP4, BITS, GROUP, K_PAD, BLOCK_N, BLOCK_K)
            await_producer(PDL)
            acc = _accumulate_tile(
                acc, codes, scales, 0, x, x2, toks, T, stride_x, stride_x2, K, norm_w, eps,
                INPUT, NORM_D, BLOCK_T, BLOCK_N, BLOCK_K, ROW_BLOCK, GROUP, MMA, IEEE,
            )
        else:
            if L2_CODE_LINES > 0:  # the rows' codes and scales into L2 while the kernel before this one finishes
                first = pid.to(tl.int64) * BLOCK_N
                prefetch_to_l2(w + first * L2_CODE_ROW, BLOCK_N * L2_CODE_ROW, L2_CODE_LINES)
                prefetch_to_l2(w + scale_offset + first * L2_SCALE_ROW, BLOCK_N * L2_SCALE_ROW, L2_SCALE_LINES)
            await_producer(PDL)
            for k0 in range(0, K_PAD, BLOCK_K):
                codes, scales = load_gemv_tile(
                    w, rows, row_mask, k0, high_offset, scale_offset, NVFP4, BITS, GROUP, K_PAD, BLOCK_N, BLOCK_K
                )
                acc = _accumulate_tile(
                    acc, codes, scales, k0, x, x2, toks, T, stride_x, stride_x2, K, norm_w, eps,
                    INPUT, NORM_D, BLOCK_T, BLOCK_N, BLOCK_K, ROW_BLOCK, GROUP, MMA, IEEE,
                )
        if INPUT == ADD_NORM:
            if pid == 0:
                for t in tl.static_range(LOOP_T):
                    if t < T:
                        add_rmsnorm_row(
                            x + t * stride_x, x2 + t * stride_x2, total + t * K, normed + t * K, norm_w, K, eps, True, ROW_BLOCK
                        )
        if NVFP4:
            acc = acc / divisors[None, :]
        if EPILOGUE == CONV:
            acc = conv_rows(acc, toks, T, rows, row_mask, conv_states, conv_weight, slots, valid, CONV_C, TAPS, LOOP_T)
        offsets = toks[:, None].to(tl.int64) * N + rows[None, :]
        mask = (toks < T)[:, None] & row_mask[None, :]
        if EPILOGUE == ADD_GATED:
            acc = gated_add(acc, routed, score, stride_score, toks, T, offsets, mask, out)
        tl.store(out + offsets, acc.to(out.dtype.element_ty), mask=mask)


@triton.jit
def _quantized_matmul_kernel(
    x,
    stride_x,
    w,
    routed,
    score,
    stride_score,
    partial,
    out,
    arrivals,
    dense_w,
    dense_out,
    T,
    N,
    K,
    DENSE_N,
    QUANTIZED_BLOCKS,
    high_offset,
    scale_offset,
    divisor_offset,
    K_BLOCKS_PER_SPLIT,
    NVFP4: tl.constexpr,
    BITS: tl.constexpr,
    GROUP: tl.constexpr,
    K_PAD: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    IEEE: tl.constexpr,
    SPLIT: tl.constexpr,
    EPILOGUE: tl.constexpr,
    DENSE: tl.constexpr,
    SCALE_ORDER: tl.constexpr,
    PDL: tl.constexpr,
):
    """Programs (row block, token block, K split): a [BLOCK_M, BLOCK_N] tile of x @ W^T over
    K_BLOCKS_PER_SPLIT k tiles, stored, or with ADD_GATED added as routed + sigmoid(score) * rows.
    One split stores its tile in `out`; with SPLIT, each stores its float32 tile in `partial` [SPLIT, T, N] and the
    last of a tile's programs to arrive (`arrivals`) sums the SPLIT tiles in split order into `out`. With DENSE,
    the row blocks from QUANTIZED_BLOCKS are `dense_w`'s (x's dtype, read as it is), into `dense_out`, their
    partial tiles after W's in `partial` (`paired_tiled`). With SCALE_ORDER an nvfp4 program takes its rows in
    `program_rows`' scale order (contiguous scale words), else BLOCK_N consecutive rows; the split tiles in `partial`
    are kept in program order either way (contiguous lanes: scattered rows made every partial store and load scalar)."""
    await_producer(PDL)
    pid_n = tl.program_id(0)
    pid_m = tl.program_id(1)
    pid_k = tl.program_id(2)
    toks = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    tok_mask = toks < T
    x_rows = x + toks[:, None].to(tl.int64) * stride_x
    kb_begin = pid_k * K_BLOCKS_PER_SPLIT
    kb_end = tl.minimum(kb_begin + K_BLOCKS_PER_SPLIT, K_PAD // BLOCK_K)
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    if DENSE and pid_n >= QUANTIZED_BLOCKS:
        rows = ((pid_n - QUANTIZED_BLOCKS) * BLOCK_N + tl.arange(0, BLOCK_N)).to(tl.int64)
        n_rows, target, part = DENSE_N, dense_out, partial + SPLIT * T * N
        row_mask = rows < n_rows
        lanes = rows
        for kb in range(kb_begin, kb_end):
            cols = kb * BLOCK_K + tl.arange(0, BLOCK_K)
            xt = tl.load(x_rows + cols[None, :], mask=tok_mask[:, None] & (cols < K)[None, :], other=0.0)
            wt = tl.load(dense_w + rows[:, None] * K + cols[None, :], mask=row_mask[:, None] & (cols < K)[None, :], other=0.0)
            acc = _tile_dot(xt, wt, acc, IEEE)
    else:
        rows = program_rows(pid_n, BLOCK_N, NVFP4 and SCALE_ORDER)
        n_rows, target, part = N, out, partial
        row_mask = rows < n_rows
        lanes = (pid_n * BLOCK_N + tl.arange(0, BLOCK_N)).to(tl.int64)  # the rows in program order
        divisors = row_divisors(w, rows, row_mask, divisor_offset, NVFP4)
        for kb in range(kb_begin, kb_end):
            k0 = kb * BLOCK_K
            cols = k0 + tl.arange(0, BLOCK_K)
            xt = tl.load(x_rows + cols[None, :], mask=tok_mask[:, None] & (cols < K)[None, :], other=0.0)
            wt = load_tile(w, rows, row_mask, k0, high_offset, scale_offset, NVFP4, BITS, GROUP, K_PAD, BLOCK_N, BLOCK_K)
            acc = _tile_dot(xt, wt, acc, IEEE)
        if NVFP4:
            acc = acc / divisors[None, :]
    tile = toks[:, None].to(tl.int64) * n_rows + rows[None, :]
    mask = tok_mask[:, None] & row_mask[None, :]
    if SPLIT > 1:
        lane_tile = toks[:, None].to(tl.int64) * n_rows + lanes[None, :]  # the split tiles in program order
        # (lanes past the rows are rows past them: nvfp4 objects, the reordered ones, have whole 128-row tiles)
        lane_mask = tok_mask[:, None] & (lanes < n_rows)[None, :]
        tl.store(part + pid_k.to(tl.int64) * T * n_rows + lane_tile, acc, mask=lane_mask)
        count = arrivals + pid_m * tl.num_programs(0) + pid_n
        if last_to_arrive(count, SPLIT):
            acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
            for s in tl.static_range(SPLIT):  # read through L2: other programs wrote these rows
                acc += tl.load(part + s * T * n_rows + lane_tile, mask=lane_mask, other=0.0, cache_modifier=".cg")
            if EPILOGUE == ADD_GATED:
                acc = gated_add(acc, routed, score, stride_score, toks, T, tile, mask, out)
            tl.store(target + tile, acc.to(out.dtype.element_ty), mask=mask)
            rearm(count)
    else:  # one split, or each split's tile for a `sum_middle` launch after this one (no epilogue then)
        if EPILOGUE == ADD_GATED:
            acc = gated_add(acc, routed, score, stride_score, toks, T, tile, mask, out)
        tl.store(target + pid_k.to(tl.int64) * T * n_rows + tile, acc.to(out.dtype.element_ty), mask=mask)


@triton.jit
def _tile_dot(xt, wt, acc, IEEE: tl.constexpr):
    """acc + xt [M, BLOCK_K] @ wt [BLOCK_N, BLOCK_K]^T on tensor cores, the weights rounded to x's dtype (float32
    inputs: full precision)."""
    if IEEE:
        acc = tl.dot(xt, tl.trans(wt.to(xt.dtype)), acc, input_precision="ieee")
    else:
        acc = tl.dot(xt, tl.trans(wt.to(xt.dtype)), acc)
    return acc


@triton.jit
def _dequantize_kernel(
    w,
    out,
    N,
    K,
    high_offset,
    scale_offset,
    divisor_offset,
    NVFP4: tl.constexpr,
    BITS: tl.constexpr,
    GROUP: tl.constexpr,
    K_PAD: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    rows = program_rows(tl.program_id(0), BLOCK_N, NVFP4)
    k0 = tl.program_id(1) * BLOCK_K
    cols = k0 + tl.arange(0, BLOCK_K)
    row_mask = rows < N
    wt = load_tile(w, rows, row_mask, k0, high_offset, scale_offset, NVFP4, BITS, GROUP, K_PAD, BLOCK_N, BLOCK_K)
    if NVFP4:
        wt = tl.math.div_rn(wt, load_divisors(w, rows, row_mask, divisor_offset)[:, None])  # correctly rounded, as the reference
    tl.store(out + rows[:, None] * K + cols[None, :], wt.to(out.dtype.element_ty), mask=row_mask[:, None] & (cols < K)[None, :])


def _sm_count(device: torch.device) -> int:
    if device.type != "cuda":
        return 4
    return torch.cuda.get_device_properties(device).multi_processor_count


def dequantize_matrix(data: torch.Tensor, geometry: ObjectGeometry, dtype: torch.dtype) -> torch.Tensor:
    """The whole matrix [n, k] in `dtype`, decoded on the device (a transient buffer)."""
    g = TileGeometry.of(geometry)
    out = torch.empty(geometry.n, geometry.k, device=data.device, dtype=dtype)
    block_n, block_k = 32, block_k_for(g.k_pad, 128)
    grid = (triton.cdiv(geometry.n, block_n), g.k_pad // block_k)
    _dequantize_kernel[grid](
        data, out, geometry.n, geometry.k, g.high_offset, g.scale_offset, g.divisor_offset,
        NVFP4=g.nvfp4, BITS=g.bits, GROUP=g.group, K_PAD=g.k_pad, BLOCK_N=block_n, BLOCK_K=block_k,
    )
    return out


def fused_gemv(
    x: torch.Tensor,
    data: torch.Tensor,
    geometry: ObjectGeometry,
    x2: torch.Tensor | None = None,
    input_op: tl.constexpr = PLAIN,
    routed: torch.Tensor | None = None,
    score: torch.Tensor | None = None,
    norm_w: torch.Tensor | None = None,
    eps: float = 0.0,
) -> torch.Tensor:
    """The matrix-vector kernel for up to GEMV_MAX_TOKENS tokens: `input_op`(x [T, k], x2) @ W^T, its
    rows stored, or with `routed` [T, n] and `score` [T, 1] given, routed + sigmoid(score) * rows.
    x and x2 [T, k] have contiguous columns (rows may be strided, e.g. column slices of one buffer);
    GATED_NORM normalises groups of norm_w.numel() columns (ADD_NORM: `residual_norm_gemv`)."""
    _check_gemv_inputs(x, x2, geometry)
    tiles = gemv_tiles(geometry.n, x.shape[0])
    block_k = gemv_block_k(TileGeometry.of(geometry).k_pad, tiles.block_k)
    norm_d = 1 if norm_w is None else norm_w.numel()
    if block_k % norm_d or x.shape[1] % norm_d or (norm_w is not None and norm_d % 8):
        raise ValueError(
            f"norm groups of {norm_d} columns must divide the row ({x.shape[1]}) and the column tile ({block_k}) in whole words of 8"
        )
    out = torch.empty(x.shape[0], geometry.n, device=x.device, dtype=x.dtype)
    _launch_gemv(x, x2, norm_w, eps, data, geometry, out, input_op, norm_d, routed, score)
    return out


def residual_norm_gemv(
    x: torch.Tensor, delta: torch.Tensor, norm_w: torch.Tensor, eps: float, data: torch.Tensor, geometry: ObjectGeometry
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(y, total, normed) for up to GEMV_MAX_TOKENS tokens: total = x + delta and normed = (1 + norm_w) *
    rmsnorm(total) as `norm.add_rmsnorm` gives them, y = normed @ W^T (`_launch_residual_gemv`)."""
    _check_gemv_inputs(x, delta, geometry)
    out = torch.empty(x.shape[0], geometry.n, device=x.device, dtype=x.dtype)
    return (out, *_launch_residual_gemv(x, delta, norm_w, eps, data, geometry, out))


def _launch_residual_gemv(
    x: torch.Tensor, delta: torch.Tensor, norm_w: torch.Tensor, eps: float, data: torch.Tensor, geometry: ObjectGeometry,
    out: torch.Tensor, **paired,
) -> tuple[torch.Tensor, torch.Tensor]:
    """`_launch_gemv` of (1 + norm_w) * rmsnorm(x + delta) (`paired`: its dense product and conv); returns
    (x + delta, the normed rows). On CUDA cores the kernel normalises its own input tiles (one launch; up to
    FOLD_INPUT_MAX_TOKENS tokens); on tensor cores and past that `add_rmsnorm` runs first and the product reads its
    rows: on tensor cores the kernel's own statistic of every token's rows (a chain of row chunks before the first
    tile) is slower than that launch (docs/performance.md, Kernels)."""
    if on_tensor_cores(geometry.n, x.shape[0]) or x.shape[0] > FOLD_INPUT_MAX_TOKENS:
        total, normed = add_rmsnorm(x, delta, norm_w, eps, offset=True)
        _launch_gemv(normed, None, None, 0.0, data, geometry, out, PLAIN, 1, **paired)
        return total, normed
    total, normed = torch.empty_like(x), torch.empty_like(x)
    _launch_gemv(x, delta, norm_w, eps, data, geometry, out, ADD_NORM, 1, total=total, normed=normed, **paired)
    return total, normed


def paired_gemv(
    x: torch.Tensor, data: torch.Tensor, geometry: ObjectGeometry, dense_w: torch.Tensor,
    residual: tuple[torch.Tensor, torch.Tensor, float] | None = None, conv: tuple | None = None,
) -> tuple[torch.Tensor, ...]:
    """(x @ W^T, x @ dense_w^T) for up to GEMV_MAX_TOKENS tokens in one launch: the programs of the
    quantized matrix-vector product (its `fused_gemv` launch shape) followed by those of the dense one
    (`dense_linear`'s rows per program), e.g. GDN's q/k/v/z projections with its dense a/b rows, or the
    shared expert's gate/up with the dense router: one launch instead of two small ones. With
    `residual` = (delta, norm_w, eps) the input is (1 + norm_w) * rmsnorm(x + delta), computed as in
    `residual_norm_gemv`, and x + delta and the normed input follow the two products.
    With `conv` = (states, weight, slots, valid, channels), each token being one sequence's, the first
    `channels` columns of x @ W^T come out through GDN's conv (`gdn.conv_update`'s result, its windows
    advanced), computed by the programs that own those rows (`gdn.conv_rows`): no launch of its own."""
    delta, norm_w, eps = (None, None, 0.0) if residual is None else residual
    _check_gemv_inputs(x, delta, geometry)
    if dense_w.shape[1] != x.shape[1]:
        raise ValueError(f"a paired matrix-vector product takes two matrices of {x.shape[1]} columns")
    out = torch.empty(x.shape[0], geometry.n, device=x.device, dtype=x.dtype)
    dense_out = torch.empty(x.shape[0], dense_w.shape[0], device=x.device, dtype=x.dtype)
    paired = {"dense_w": dense_w.contiguous(), "dense_out": dense_out, "conv": conv}
    if residual is None:
        _launch_gemv(x, None, None, 0.0, data, geometry, out, PLAIN, 1, **paired)
        return out, dense_out
    return (out, dense_out, *_launch_residual_gemv(x, delta, norm_w, eps, data, geometry, out, **paired))


def _l2_prefetch(g: TileGeometry, block_n: int, on: bool) -> dict:
    """The L2_* constexprs of a matrix-vector launch: a program's row-split code and scale bytes per row and the
    128-byte lines of its rows, where `on` and L2_PREFETCH (else no lines)."""
    code_row, scale_row = g.k_pad if g.bits == 8 else g.k_pad // 2, 2 * g.k_pad // g.group  # Q8: a byte per code
    lines = [triton.next_power_of_2(triton.cdiv(block_n * row, 128)) if on and L2_PREFETCH and not g.nvfp4 else 0
             for row in (code_row, scale_row)]
    return {"L2_CODE_ROW": code_row, "L2_CODE_LINES": lines[0], "L2_SCALE_ROW": scale_row, "L2_SCALE_LINES": lines[1]}


def _check_gemv_inputs(x: torch.Tensor, x2: torch.Tensor | None, geometry: ObjectGeometry) -> None:
    x2 = x if x2 is None else x2
    if x.shape[0] > GEMV_MAX_TOKENS or x.shape[1] != geometry.k or x2.shape != x.shape or x.stride(1) != 1 or x2.stride(1) != 1:
        raise ValueError(f"a fused matrix-vector product takes up to {GEMV_MAX_TOKENS} rows of {geometry.k} contiguous columns")


def _launch_gemv(
    x: torch.Tensor, x2: torch.Tensor | None, norm_w: torch.Tensor | None, eps: float, data: torch.Tensor, geometry: ObjectGeometry,
    out: torch.Tensor, input_op: tl.constexpr, norm_d: int, routed: torch.Tensor | None = None, score: torch.Tensor | None = None,
    total: torch.Tensor | None = None, normed: torch.Tensor | None = None,
    dense_w: torch.Tensor | None = None, dense_out: torch.Tensor | None = None, conv: tuple | None = None,
) -> None:
    """One launch of the matrix-vector kernel (unused pointer arguments point at `out`); `conv` = (states,
    weight, slots, valid, channels) for the CONV epilogue."""
    t, k = x.shape
    x2 = x if x2 is None else x2
    g = TileGeometry.of(geometry)
    n = geometry.n
    mma, block_t = on_tensor_cores(n, t), triton.next_power_of_2(t)
    tiles = gemv_tiles(n, t)
    add_gated = routed is not None
    conv_states, conv_weight, slots, valid, channels = conv if conv is not None else (out, out, out, out, 0)
    routed = routed.contiguous() if add_gated else out
    score = score if add_gated else out
    quantized_programs = triton.cdiv(n, tiles.block_n)
    dense_n = 0 if dense_w is None else dense_w.shape[0]
    block_k, pdl = gemv_block_k(g.k_pad, tiles.block_k), launch_options(x.device)
    prefetch = pdl["PDL"] and t >= PREFETCH_MIN_TOKENS and block_k == g.k_pad
    _quantized_gemv_kernel[(quantized_programs + triton.cdiv(dense_n, dense_linear.GEMV_BLOCK_N),)](
        x, x2, x.stride(0), x2.stride(0), x if norm_w is None else norm_w.contiguous(), eps, data, routed, score, score.stride(0), out,
        out if total is None else total, out if normed is None else normed, out if dense_w is None else dense_w,
        out if dense_out is None else dense_out, t, n, k, dense_n, quantized_programs, g.high_offset, g.scale_offset, g.divisor_offset,
        NVFP4=g.nvfp4, BITS=g.bits, GROUP=g.group, K_PAD=g.k_pad, BLOCK_T=max(MMA_BLOCK_T, block_t) if mma else block_t,
        BLOCK_N=tiles.block_n,
        BLOCK_K=block_k, INPUT=input_op.value, NORM_D=norm_d,
        EPILOGUE=(ADD_GATED if add_gated else CONV if conv is not None else STORE).value,
        ROW_BLOCK=triton.next_power_of_2(k) if input_op == ADD_NORM else 1,
        DENSE=dense_w is not None, LOOP_T=block_t, DENSE_BLOCK_N=dense_linear.GEMV_BLOCK_N,
        DENSE_BLOCK_K=min(dense_linear.GEMV_BLOCK_K, triton.next_power_of_2(k)),
        conv_states=conv_states, conv_weight=conv_weight, slots=slots, valid=valid, CONV_C=channels, MMA=mma, IEEE=x.dtype == torch.float32,
        TAPS=conv_weight.shape[0] if conv is not None else 1,
        num_warps=tiles.warps, num_stages=tiles.stages, PREFETCH=prefetch,
        **_l2_prefetch(g, tiles.block_n, pdl["PDL"] and not prefetch), **pdl,
    )


def gated_linear(x: torch.Tensor, gate: torch.Tensor, data: torch.Tensor, geometry: ObjectGeometry) -> torch.Tensor:
    """(x * sigmoid(gate)) [T, k] @ W^T, the gate folded into the product's launch (`quantized_linear`)."""
    return quantized_linear(x, data, geometry, gate, SIGMOID_GATE)


def gated_norm_linear(
    x: torch.Tensor, z: torch.Tensor, norm_w: torch.Tensor, eps: float, data: torch.Tensor, geometry: ObjectGeometry
) -> torch.Tensor:
    """gated_rmsnorm(x, norm_w, eps, z) [T, H, D] flattened to [T, H * D], @ W^T, the norm computed as the
    product reads its input (`quantized_linear`)."""
    t = x.shape[0]
    return quantized_linear(x.reshape(t, -1), data, geometry, z.reshape(t, -1), GATED_NORM, norm_w=norm_w, eps=eps)


def _folds_input(x: torch.Tensor, x2: torch.Tensor | None, input_op: tl.constexpr, norm_d: int, block_k: int) -> bool:
    """Whether a kernel reading column tiles of `block_k` can compute `input_op`(x, x2) as it reads them: contiguous
    columns, and GATED_NORM groups (a power of two of norm_d columns, whole words of 8) lying whole in every tile."""
    if input_op == PLAIN:
        return True
    if x.shape[0] > FOLD_INPUT_MAX_TOKENS:
        return False
    contiguous = x.stride(1) == 1 and x2.stride(1) == 1
    whole_groups = block_k % norm_d == 0 and x.shape[1] % norm_d == 0 and norm_d % 8 == 0 and norm_d & (norm_d - 1) == 0
    return contiguous and (input_op != GATED_NORM or whole_groups)


def _unfolded_input(x: torch.Tensor, x2: torch.Tensor | None, input_op: tl.constexpr, norm_w: torch.Tensor | None, eps: float):
    """`input_op`(x, x2) computed before the product, by the elementwise kernels (prefill, unaligned norm groups)."""
    if input_op == SWIGLU:
        return swiglu(x, x2)
    if input_op == SIGMOID_GATE:
        return x * torch.sigmoid(x2)
    if input_op == GATED_NORM:
        t, d = x.shape[0], norm_w.numel()
        return gated_rmsnorm(x.reshape(t, -1, d), norm_w, eps, x2.reshape(t, -1, d)).reshape(t, -1)
    return x


def quantized_linear(
    x: torch.Tensor,
    data: torch.Tensor,
    geometry: ObjectGeometry,
    x2: torch.Tensor | None = None,
    input_op: tl.constexpr = PLAIN,
    routed: torch.Tensor | None = None,
    score: torch.Tensor | None = None,
    norm_w: torch.Tensor | None = None,
    eps: float = 0.0,
) -> torch.Tensor:
    """`input_op`(x [T, k], x2) @ W^T -> [T, n] in x's dtype, W given as its raw object bytes `data` on x's device;
    with `routed` [T, n] and `score` [T, 1] given, routed + sigmoid(score) * rows (the shared expert). The
    matrix-vector kernel computes the input step and the gated add inside its launch, the tiled kernel the gated add;
    the rest (and prefill's, around a cuBLAS product) run as elementwise kernels."""
    t, k = x.shape
    if k != geometry.k:
        raise ValueError(f"input has {k} columns, weight expects {geometry.k}")
    if t > FUSED_MAX_TOKENS:
        y = _unfolded_input(x, x2, input_op, norm_w, eps) @ dequantize_matrix(data, geometry, x.dtype).T
        return y if routed is None else add_gated(routed, score, y)
    n = geometry.n
    if on_matrix_vector(n, t):
        block_k = gemv_block_k(TileGeometry.of(geometry).k_pad, gemv_tiles(n, t).block_k)
        if not _folds_input(x, x2, input_op, 1 if norm_w is None else norm_w.numel(), block_k):
            x, x2, input_op, norm_w = _unfolded_input(x, x2, input_op, norm_w, eps), None, PLAIN, None
        x = x.contiguous() if input_op == PLAIN else x  # the fused inputs read rows of contiguous columns where they lie
        return fused_gemv(x, data, geometry, x2, input_op, routed, score, norm_w, eps)
    return _tiled_launch(_unfolded_input(x, x2, input_op, norm_w, eps).contiguous(), data, geometry, routed, score)[0]


def paired_tiled(x: torch.Tensor, data: torch.Tensor, geometry: ObjectGeometry, dense_w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(x @ W^T, x @ dense_w^T) for up to FUSED_MAX_TOKENS tokens in one launch of the tiled kernel, the dense rows
    as row blocks after W's (e.g. a batched step's shared-expert gate/up with the router): `paired_gemv`'s pairing
    for the products past the matrix-vector kernel."""
    if x.shape[0] > FUSED_MAX_TOKENS or x.shape[1] != geometry.k or dense_w.shape[1] != geometry.k:
        raise ValueError(f"a paired tiled product takes up to {FUSED_MAX_TOKENS} rows of {geometry.k} columns and two such matrices")
    return _tiled_launch(x.contiguous(), data, geometry, dense_w=dense_w.contiguous())


def _tiled_launch(
    x: torch.Tensor, data: torch.Tensor, geometry: ObjectGeometry, routed: torch.Tensor | None = None, score: torch.Tensor | None = None,
    dense_w: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """One launch of the tiled kernel (split-K across programs when the tiles alone would not fill the GPU), with
    `dense_w`'s rows as more row blocks; returns (the rows, or routed + sigmoid(score) * rows with `routed` given,
    and the dense rows or None)."""
    t = x.shape[0]
    g = TileGeometry.of(geometry)
    n, dense_n = geometry.n, 0 if dense_w is None else dense_w.shape[0]
    block_m = 16 if t <= 16 else (32 if t <= 32 else 64)
    block_n = DECODE_BLOCK_N
    block_k = block_k_for(g.k_pad)
    quantized_blocks = triton.cdiv(n, block_n)
    n_blocks = quantized_blocks + triton.cdiv(dense_n, block_n)
    k_blocks = g.k_pad // block_k
    m_blocks = triton.cdiv(t, block_m)
    split = max(1, min(k_blocks, (4 * _sm_count(x.device)) // (n_blocks * m_blocks)))
    per_split = triton.cdiv(k_blocks, split)
    split = triton.cdiv(k_blocks, per_split)
    out = torch.empty(t, n, device=x.device, dtype=x.dtype)
    dense_out = torch.empty(t, dense_n, device=x.device, dtype=x.dtype) if dense_n else None
    summed_after = split > 1 and not SUM_IN_PRODUCT  # (a split launch has fewer tiles than 4 per SM: one counter each)
    if summed_after:  # each split's rows, float32, for the `sum_middle` launches after this one
        targets = [torch.empty(split, t, rows, device=x.device, dtype=torch.float32) for rows in (n, dense_n)]
        partial = targets[0]
    else:
        targets = [out, dense_out]
        partial = torch.empty(split * t * (n + dense_n), device=x.device, dtype=torch.float32) if split > 1 else out
    add_after = routed is not None and (summed_after or not GATED_ADD_IN_TILED)  # summed after: the add needs the sums
    in_launch = routed is not None and not add_after
    fitting.launch(
        _quantized_matmul_kernel, (n_blocks, m_blocks, split),
        x, x.stride(0), data, routed.contiguous() if in_launch else out, score if in_launch else out, score.stride(0) if in_launch else 0,
        partial, targets[0], arrival_counts("quant_linear.split_k", x.device), x if dense_w is None else dense_w,
        out if dense_out is None else targets[1], t, n, geometry.k, dense_n, quantized_blocks,
        g.high_offset, g.scale_offset, g.divisor_offset, per_split, NVFP4=g.nvfp4, BITS=g.bits, GROUP=g.group, K_PAD=g.k_pad,
        BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k, IEEE=x.dtype == torch.float32, SPLIT=1 if summed_after else split,
        EPILOGUE=(ADD_GATED if in_launch else STORE).value, DENSE=dense_w is not None, SCALE_ORDER=TILED_SCALE_ORDER,
        num_warps=DECODE_WARPS, num_stages=TILED_STAGES, **launch_options(x.device),
    )
    if summed_after:
        out, dense_out = (sum_middle(rows.view(1, split, -1), x.dtype).view(t, -1) if rows.shape[2] else None for rows in targets)
    return (add_gated(routed, score, out) if add_after else out), dense_out


