"""Fused routed-experts kernels: routing result -> per-(token, expert) work -> output.

Reference op: `ReferenceBackend.routed_experts(x, topk_ids, topk_weights, experts)`:
`out[t] = sum_j w[t, j] * down_e(silu(gate_e(x[t])) * up_e(x[t]))` with `e = topk_ids[t, j]`.

Experts are reached through a per-layer int64 table: `table[e]` is the byte offset of expert e's
record (`ExpertRecordLayout`: gate/up object, then the down object at `down_offset`; each
row-split or nvfp4, decoded by `kernels/tiles.py` per the `NVFP4` constexpr, nvfp4 rows divided by
their FP32 divisor in the fp32 accumulators) from an
`arena` base tensor, a multiple of 256. Resident banks (arena = the bank), cache slots
(arena = the slot pool) and mapped pinned host records (arena = any 256-aligned tensor, offsets
= address differences in the unified address space) all go through the same kernels; only the
table differs. Offsets from an aligned base argument, rather than raw addresses, let the
compiler prove alignment and issue 16-byte pipelined loads (raw int-to-pointer addresses
compile to one-byte loads).

Two paths, both free of host syncs (so they can be captured in a CUDA graph):
* few (token, slot) pairs (decode, verification, small batches): matrix-vector kernels, a program per pair
  and slice, decoding each weight tile in registers (`load_gemv_tile`). Kernel 1 computes a column slice of
  the pair's gate and up rows and applies SwiGLU. Kernel 2 runs a program per (slice of output rows, slot,
  token): each writes its expert's rounded, weighted rows (fp32) and the last of a slice's k programs to
  arrive sums them in slot order (an atomic count per slice, so no reduction is launched and the k experts
  are read in parallel). An expert that several tokens use is read once per token, its repeats mostly from
  L2; over host records, from `SHARED_READ_MIN_TOKENS` tokens, both kernels compute all of an expert's pairs in the
  programs of its first pair instead (one read of a host expert over PCIe), counting the others' assignments
  as shared uses (`ExpertBank.shared_uses`: they read no record of their own). Given the MoE block's shared
  expert (`SharedExpert`), one more program per slice and token computes its down rows (SwiGLU of its gate/up,
  scaled by sigmoid of its score) in the same launch and the last arriver adds them to the rounded routed sum,
  as `shared_expert` would after it: one launch fewer per layer.
* otherwise the pairs are planned in blocks of at most BLOCK_M pairs of one expert (each pair its
  own block when there are few, else sorted by expert). Kernel 1 computes gate and up rows for a
  block with `tl.dot` and applies SwiGLU; kernel 2 applies the down rows and the routing weight.
  The per-token sum over the k slots is a fixed-order reduction.

`routed_experts_split` runs the tiled kernels of a prefill chunk in passes over one plan (each pass runs
the blocks of one set of experts) with a caller's `wait` before the last, so that the first passes run
while the records of the last are still being copied into VRAM (`runtime.prefill_staging`); one sum
follows. Over many pairs, the experts in host memory get a pass of their own on tiles that read rows
in long runs over PCIe (`HOST_PREFILL_TILES`), the others keep the VRAM tiles (`PREFILL_TILES`), on which
the PCIe tiles are slower (docs/performance.md, Offload at a VRAM budget).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from functools import lru_cache

import torch
import triton
import triton.language as tl

from ninfer_offload.artifact.records import ExpertRecordLayout
from ninfer_offload.model.backend import SharedExpert
from ninfer_offload.model.experts import count_uses
from ninfer_offload.kernels import fitting, shared_expert
from ninfer_offload.kernels.arrivals import ARRIVAL_COUNTS, arrival_counts, last_to_arrive, rearm
from ninfer_offload.kernels.launch import await_producer, launch_options
from ninfer_offload.kernels.nvfp4 import row_divisors
from ninfer_offload.kernels.quant_linear import SWIGLU, GemvTiles, input_columns
from ninfer_offload.kernels.reduce import sum_middle
from ninfer_offload.kernels.rowsplit import dot_code_tile, load_columns
from ninfer_offload.kernels.tiles import TileGeometry, block_k_for, gemv_block_k, gemv_tile, load_gemv_tile, load_tile, program_rows


@dataclass(frozen=True)
class Tiles:
    """Launch shape of the two tiled kernels: pairs per block, output columns per program of each, warps, the
    widest k tile and the software-pipeline depth (the matrix-vector gate/up kernel takes a `GemvTiles`)."""

    block_m: int
    gate_up_n: int
    down_n: int
    warps: int
    block_k: int = 256
    stages: int = 3


# Up to this many (token, slot) pairs and tokens: the matrix-vector kernels, a program per pair (both products).
# A program per pair beat a program per expert walking the tokens routed to it at 2-8 tokens, with tokens mostly on
# different experts (docs/performance.md, Kernels). The matrix-vector kernels' register tiles bound the token count
# (a per-pair program holds one token's x tile), the split down kernel's arrival counts the rows x tokens.
GEMV_MAX_PAIRS = 64
GEMV_MAX_TOKENS = 8
# The gate/up kernel's columns per program, widest k tile, warps and pipeline depth: the fastest in sweeps and step
# A/B runs (docs/performance.md, Kernels).
GEMV_TILES = GemvTiles(8, 2048, 4, 3)
# Rows per program, warps and k tile of the split down kernel: in the step (with the shared expert folded in) 16 rows
# on 2 warps with one k tile led (docs/performance.md, Kernels).
SPLIT_DOWN_N, SPLIT_DOWN_WARPS, SPLIT_DOWN_BLOCK_K = 16, 2, 512
# Up to this many tokens the split down kernel's programs read their weight tile before they wait for the gate/up
# launch (where both down products are one k tile), as the one-tile dense products do (`quant_linear.PREFETCH_MIN_TOKENS`).
# The tile held across the wait raises the kernel's registers, which a batch's many programs may pay in occupancy.
# 0 (off): up to one token it gained nothing, up to 4 or 8 tokens it slowed verification (docs/performance.md,
# Decode step settings); module-level so `bench/step_ab.py` can compare them.
DOWN_PREFETCH_MAX_TOKENS = 0
# Each token's shared expert in the split down launch (its own launch after the routed experts otherwise).
# Module-level so benchmarks can compare the two.
FOLD_SHARED_EXPERT = True
# From this many tokens (GEMV_MAX_TOKENS + 1: never), launches over host records (offloaded loads) read each expert's
# slices once for all pairs routed to it: the program of the expert's first pair (per column or row slice) computes
# each of those pairs in turn, re-reading its slice from L1/L2, and the others' programs stop. With a program per pair
# a repeat comes mostly from L2 in VRAM, but may cross PCIe again for an expert in host memory. Resident launches keep
# a program per pair: the same walk lost there. Over host records it shortens offloaded batch steps
# (docs/performance.md, Offload at a VRAM budget).
SHARED_READ_MIN_TOKENS = 2
# Tiled kernels: batches past the matrix-vector limits (few pairs per expert) and prefill (many).
# Module-level so benchmarks can sweep them.
DECODE_TILES = Tiles(16, 32, 64, 4)  # the faster of the swept shapes (docs/performance.md, Kernels)
PREFILL_TILES = Tiles(64, 64, 64, 4, 64, 3)  # the fastest swept shape for 2048-token prefill (docs/performance.md, Kernels)
# Prefill over records that may live in host memory (read over PCIe): 256-wide k tiles, so each row
# is read in runs of 128+ bytes, which reach a larger share of the link than short runs
# (docs/performance.md, Offload at a VRAM budget).
# Its block_m is PREFILL_TILES' (`routed_experts_split`'s two passes share one plan).
HOST_PREFILL_TILES = Tiles(64, 32, 64, 4, 256, 3)
PREFILL_MIN_PAIRS = 256
EVERY_BLOCK, FIRST_PASS, SECOND_PASS = 0, 1, 2  # which blocks a tiled launch runs (`_runs`): by pass,
ANYWHERE, VRAM_RECORDS, HOST_RECORDS = 0, 1, 2  # and by where the records are
# Up to this many (token, slot) pairs each pair is its own block: no sort, no scatter (decode).
PAIR_PLAN_MAX = 64


@dataclass(frozen=True)
class WorkPlan:
    """Pairs grouped by expert: `block_expert[b]` (-1: unused block) and `block_pairs[b, :]` (-1: empty)."""

    block_expert: torch.Tensor  # [max_blocks] int64
    block_pairs: torch.Tensor  # [max_blocks, block_m] int64, pair index = token * top_k + slot
    block_m: int


@lru_cache(maxsize=64)
def _one_pair_per_block(pairs: int, block_m: int, device: torch.device) -> torch.Tensor:
    rows = torch.full((pairs, block_m), -1, dtype=torch.int64, device=device)
    rows[:, 0] = torch.arange(pairs, device=device)
    return rows


def plan_pairs(topk_ids: torch.Tensor, block_m: int) -> WorkPlan:
    """Each (token, slot) pair in its own block (few pairs: planning costs one reshape, no sort)."""
    flat = topk_ids.reshape(-1).to(torch.int64)
    return WorkPlan(flat, _one_pair_per_block(flat.numel(), block_m, flat.device), block_m)


# Pairs each program of the planning kernels reads at once.
PLAN_BLOCK = 2048


@triton.jit
def _count_kernel(ids, counts, pairs, BLOCK: tl.constexpr):
    """counts[e] = pairs routed to expert e (one program per expert)."""
    e = tl.program_id(0)
    total = 0
    for p0 in range(0, pairs, BLOCK):
        index = p0 + tl.arange(0, BLOCK)
        total += tl.sum((tl.load(ids + index, mask=index < pairs, other=-1) == e).to(tl.int32))
    tl.store(counts + e, total)


@triton.jit
def _place_kernel(
    ids, counts, block_expert, block_pairs, pairs, experts, max_blocks, tail_per_program,
    BLOCK_M: tl.constexpr, BLOCK: tl.constexpr, BLOCK_E: tl.constexpr,
):
    """Expert e's pairs, in pair order, into its blocks (after those of experts < e), its last block
    padded with -1; then its share of the unused blocks after the last expert's (expert and pairs -1)."""
    e = tl.program_id(0)
    experts_i = tl.arange(0, BLOCK_E)
    blocks = (tl.load(counts + experts_i, mask=experts_i < experts, other=0) + BLOCK_M - 1) // BLOCK_M
    first = tl.sum(tl.where(experts_i < e, blocks, 0))
    used = tl.sum(blocks)
    count = tl.load(counts + e)
    own = (count + BLOCK_M - 1) // BLOCK_M
    start = first.to(tl.int64) * BLOCK_M
    placed = 0
    for p0 in range(0, pairs, BLOCK):
        index = p0 + tl.arange(0, BLOCK)
        mine = (tl.load(ids + index, mask=index < pairs, other=-1) == e).to(tl.int32)
        rank = placed + tl.cumsum(mine, 0) - 1
        tl.store(block_pairs + start + rank, index.to(tl.int64), mask=mine > 0)
        placed += tl.sum(mine)
    slack = tl.arange(0, BLOCK_M)
    tl.store(block_pairs + start + count + slack, -1, mask=count + slack < own * BLOCK_M)
    for b0 in range(0, own, BLOCK):
        b = b0 + tl.arange(0, BLOCK)
        tl.store(block_expert + first + b, e.to(tl.int64), mask=b < own)
    tail = used + e * tail_per_program
    tail_end = tl.minimum(tail + tail_per_program, max_blocks)
    for b0 in range(tail, tail_end, BLOCK):
        b = b0 + tl.arange(0, BLOCK)
        tl.store(block_expert + b, -1, mask=b < tail_end)
    for p0 in range(tail.to(tl.int64) * BLOCK_M, tail_end.to(tl.int64) * BLOCK_M, BLOCK):
        p = p0 + tl.arange(0, BLOCK)
        tl.store(block_pairs + p, -1, mask=p < tail_end.to(tl.int64) * BLOCK_M)


def plan_work(topk_ids: torch.Tensor, num_experts: int, block_m: int) -> WorkPlan:
    """Group the (token, slot) pairs of `topk_ids` [T, k] by expert (a counting sort in two launches,
    static shapes, no host sync): expert e's pairs in pair order fill consecutive blocks, the experts in order."""
    ids = topk_ids.reshape(-1).contiguous()
    pairs = ids.numel()
    max_blocks = triton.cdiv(pairs, block_m) + min(pairs, num_experts)
    counts = torch.empty(num_experts, dtype=torch.int32, device=ids.device)
    block_expert = torch.empty(max_blocks, dtype=torch.int64, device=ids.device)
    block_pairs = torch.empty(max_blocks, block_m, dtype=torch.int64, device=ids.device)
    _count_kernel[(num_experts,)](ids, counts, pairs, BLOCK=PLAN_BLOCK)
    _place_kernel[(num_experts,)](
        ids, counts, block_expert, block_pairs, pairs, num_experts, max_blocks, triton.cdiv(max_blocks, num_experts),
        BLOCK_M=block_m, BLOCK=PLAN_BLOCK, BLOCK_E=triton.next_power_of_2(num_experts),
    )
    return WorkPlan(block_expert, block_pairs, block_m)


@triton.jit
def _gate_up_tiles(
    record, cols_i, col_mask, k0, I, high_offset, scale_offset,
    NVFP4: tl.constexpr, BITS: tl.constexpr, GROUP: tl.constexpr, K_PAD: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):
    """(gate codes, gate scales, up codes, up scales): the k tile at `k0` of an expert's gate rows `cols_i` and of
    its up rows (I rows further on), for `dot_code_tile`. Both tiles are read before either product, so that
    every load of the pair is issued before the first multiply-add (two `tiles.gemv_tile` calls issue the up
    rows' loads after the gate product starts; docs/performance.md, Kernels)."""
    gate = load_gemv_tile(record, cols_i, col_mask, k0, high_offset, scale_offset, NVFP4, BITS, GROUP, K_PAD, BLOCK_N, BLOCK_K)
    up = load_gemv_tile(record, cols_i + I, col_mask, k0, high_offset, scale_offset, NVFP4, BITS, GROUP, K_PAD, BLOCK_N, BLOCK_K)
    return gate[0], gate[1], up[0], up[1]


@triton.jit
def _swiglu_rows(acc_gate, acc_up, gate_divisors, up_divisors, x, NVFP4: tl.constexpr):
    """SwiGLU of gate and up accumulators ([BLOCK_N] or [R, BLOCK_N], float32): over their rows' divisors
    ([BLOCK_N]: nvfp4, `row_divisors`), each rounded to the activations' dtype first."""
    if NVFP4:
        acc_gate = acc_gate / gate_divisors
        acc_up = acc_up / up_divisors
    gate = acc_gate.to(x.dtype.element_ty).to(tl.float32)
    up = acc_up.to(x.dtype.element_ty).to(tl.float32)
    return gate / (1.0 + tl.exp(-gate)) * up


@triton.jit
def _pairs_of_expert(topk_ids, pair, e, pairs, PAIRS_PAD: tl.constexpr):
    """(whether `pair` is the first of the launch's `pairs` routed to expert `e`, bool [PAIRS_PAD]: every pair
    routed to `e`)."""
    at = tl.arange(0, PAIRS_PAD)
    same = tl.load(topk_ids + at, mask=at < pairs, other=-1) == e
    return tl.min(tl.where(same, at, PAIRS_PAD), axis=0) == pair, same


@triton.jit
def _next_pair(left, PAIRS_PAD: tl.constexpr):
    """(the lowest pair of mask `left`, `left` without it)."""
    at = tl.arange(0, PAIRS_PAD)
    q = tl.min(tl.where(left, at, PAIRS_PAD), axis=0)
    return q, left & (at != q)


@triton.jit
def _gate_up_swiglu_gemv_kernel(
    x,
    arena,
    table,
    topk_ids,
    act,
    use_counts,
    shared_use_counts,
    stride_x,
    H,
    I,
    high_offset,
    scale_offset,
    divisor_offset,
    pairs,
    TOP_K: tl.constexpr,
    NVFP4: tl.constexpr,
    WHOLE_TILES: tl.constexpr,
    BITS: tl.constexpr,
    GROUP: tl.constexpr,
    K_PAD: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    COUNT: tl.constexpr,
    SHARED_READS: tl.constexpr,
    COUNT_SHARED: tl.constexpr,
    PAIRS_PAD: tl.constexpr,
    PDL: tl.constexpr,
):
    """A program per (pair, column slice): the gate and up columns of the pair's expert times its token's x,
    SwiGLU into the pair's row of `act`. An expert that several tokens use is read once per token (the
    repeats mostly from L2, the programs of one column slice running together); with SHARED_READS the program of
    its first pair computes every pair of the expert in turn (its repeats of the slice from L1/L2, not from memory
    or over PCIe again), the others stop. With COUNT, each pair's first program adds 1 to `use_counts` at its expert
    (`model.experts.count_uses`); with COUNT_SHARED (and SHARED_READS) the first program of each pair that reads
    no slice of its own adds 1 to `shared_use_counts` too."""
    await_producer(PDL)
    pair = tl.program_id(0)
    e = tl.load(topk_ids + pair)
    if COUNT:
        if tl.program_id(1) == 0:
            tl.atomic_add(use_counts + e, 1, sem="relaxed")
    record = arena + tl.multiple_of(tl.load(table + e), 256)
    cols_i = program_rows(tl.program_id(1), BLOCK_N, WHOLE_TILES)
    col_mask = cols_i < I
    if SHARED_READS:
        first, left = _pairs_of_expert(topk_ids, pair, e, pairs, PAIRS_PAD)
        if first:
            for _ in range(tl.sum(left.to(tl.int32), axis=0)):
                q, left = _next_pair(left, PAIRS_PAD)
                _gate_up_pair_rows(
                    x, stride_x, act, record, q, cols_i, col_mask, H, I, high_offset, scale_offset, divisor_offset,
                    TOP_K, NVFP4, BITS, GROUP, K_PAD, BLOCK_N, BLOCK_K,
                )
        elif COUNT_SHARED:
            if tl.program_id(1) == 0:
                tl.atomic_add(shared_use_counts + e, 1, sem="relaxed")
    else:
        _gate_up_pair_rows(
            x, stride_x, act, record, pair, cols_i, col_mask, H, I, high_offset, scale_offset, divisor_offset,
            TOP_K, NVFP4, BITS, GROUP, K_PAD, BLOCK_N, BLOCK_K,
        )


@triton.jit
def _gate_up_pair_rows(
    x, stride_x, act, record, pair, cols_i, col_mask, H, I, high_offset, scale_offset, divisor_offset,
    TOP_K: tl.constexpr, NVFP4: tl.constexpr, BITS: tl.constexpr, GROUP: tl.constexpr, K_PAD: tl.constexpr, BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    """SwiGLU of the gate and up columns `cols_i` of expert `record` times pair `pair`'s token row of x, into the pair's
    row of `act` (the rows' divisors read first: a program that computes no pair reads none)."""
    gate_divisors = row_divisors(record, cols_i, col_mask, divisor_offset, NVFP4)
    up_divisors = row_divisors(record, cols_i + I, col_mask, divisor_offset, NVFP4)
    x_row = x + (pair // TOP_K).to(tl.int64) * stride_x
    acc_gate = tl.zeros([BLOCK_N], dtype=tl.float32)
    acc_up = tl.zeros([BLOCK_N], dtype=tl.float32)
    for k0 in range(0, K_PAD, BLOCK_K):
        g_codes, g_scales, u_codes, u_scales = _gate_up_tiles(
            record, cols_i, col_mask, k0, I, high_offset, scale_offset, NVFP4, BITS, GROUP, K_PAD, BLOCK_N, BLOCK_K
        )
        xt = load_columns(x_row, k0, H, BLOCK_K)
        acc_gate += dot_code_tile(g_codes, g_scales, xt, GROUP, BLOCK_N, BLOCK_K)
        acc_up += dot_code_tile(u_codes, u_scales, xt, GROUP, BLOCK_N, BLOCK_K)
    y = _swiglu_rows(acc_gate, acc_up, gate_divisors, up_divisors, x, NVFP4)
    tl.store(act + pair.to(tl.int64) * I + cols_i, y.to(act.dtype.element_ty), mask=col_mask)


@triton.jit
def _rounded_down_rows(acc, divisors, act, NVFP4: tl.constexpr):
    """A down product's float32 rows (`acc`, [BLOCK_N] or [R, BLOCK_N]) over its rows' divisors (nvfp4,
    `row_divisors`), rounded to the activations' dtype."""
    if NVFP4:
        acc = acc / divisors
    return acc.to(act.dtype.element_ty).to(tl.float32)


@triton.jit
def _sum_slots(partial, out, H, rows, row_mask, TOP_K: tl.constexpr, SHARED_EXPERT: tl.constexpr, BLOCK_N: tl.constexpr):
    """Rows `rows` of one token's output into `out`: its TOP_K weighted routed rows (`partial` [TOP_K (+ 1), H],
    fp32) summed in slot order, rounded, plus with SHARED_EXPERT the shared expert's rows after them
    (`shared_expert`'s order). Read through L2: other programs wrote them."""
    total = tl.zeros([BLOCK_N], dtype=tl.float32)
    for s in tl.static_range(TOP_K):
        total += tl.load(partial + s * H + rows, mask=row_mask, other=0.0, cache_modifier=".cg")
    if SHARED_EXPERT:
        shared = tl.load(partial + TOP_K * H + rows, mask=row_mask, other=0.0, cache_modifier=".cg")
        total = total.to(out.dtype.element_ty).to(tl.float32) + shared
    tl.store(out + rows, total.to(out.dtype.element_ty), mask=row_mask)


@triton.jit
def _routed_down_rows(
    act, arena, table, topk_ids, weights, I, down_offset, high_offset, scale_offset, divisor_offset, pair, rows, row_mask,
    NVFP4: tl.constexpr, BITS: tl.constexpr, GROUP: tl.constexpr, K_PAD: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    PREFETCH: tl.constexpr, PDL: tl.constexpr,
):
    """float32 [BLOCK_N]: rows `rows` of pair `pair`'s expert down product, rounded, times its routing weight (read,
    like the divisors, before the k loop: after it, a memory round trip after all of the program's compute).
    With PREFETCH (one k tile) the routing, the divisors and the tile are read before `await_producer`: the
    routing was written two kernels before this one (the router's top-k, before the gate/up launch), and a
    kernel launched with PDL is scheduled only once the kernel before it has waited for its own producer."""
    down = arena + tl.multiple_of(tl.load(table + tl.load(topk_ids + pair)), 256) + down_offset
    weight = tl.load(weights + pair).to(tl.float32)
    divisors = row_divisors(down, rows, row_mask, divisor_offset, NVFP4)
    acc = tl.zeros([BLOCK_N], dtype=tl.float32)
    if PREFETCH:
        codes, scales = load_gemv_tile(down, rows, row_mask, 0, high_offset, scale_offset, NVFP4, BITS, GROUP, K_PAD, BLOCK_N, BLOCK_K)
        await_producer(PDL)
        acc += dot_code_tile(codes, scales, load_columns(act + pair * I, 0, I, BLOCK_K), GROUP, BLOCK_N, BLOCK_K)
    else:
        for k0 in range(0, K_PAD, BLOCK_K):
            xt = load_columns(act + pair * I, k0, I, BLOCK_K)
            acc += gemv_tile(down, rows, row_mask, k0, xt, high_offset, scale_offset, NVFP4, BITS, GROUP, K_PAD, BLOCK_N, BLOCK_K)
    return _rounded_down_rows(acc, divisors, act, NVFP4) * weight


@triton.jit
def _shared_expert_rows(
    gate, up, stride_gate, stride_up, down, score, stride_score, S, high_offset, scale_offset, divisor_offset, tok, rows, row_mask,
    NVFP4: tl.constexpr, BITS: tl.constexpr, GROUP: tl.constexpr, K_PAD: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    PREFETCH: tl.constexpr, PDL: tl.constexpr,
):
    """float32 [BLOCK_N]: rows `rows` of token `tok`'s shared expert, sigmoid(score) * SwiGLU(gate, up) @ down^T,
    rounded where `shared_expert.shared_expert` rounds (before the routed output is added). With PREFETCH (one k
    tile) the divisors and the tile are read before `await_producer`."""
    divisors = row_divisors(down, rows, row_mask, divisor_offset, NVFP4)
    if PREFETCH:
        codes, scales = load_gemv_tile(down, rows, row_mask, 0, high_offset, scale_offset, NVFP4, BITS, GROUP, K_PAD, BLOCK_N, BLOCK_K)
        await_producer(PDL)
    sv = tl.load(score + tok * stride_score)
    acc = tl.zeros([BLOCK_N], dtype=tl.float32)
    if PREFETCH:
        xt = input_columns(gate, up, tok * stride_gate, tok * stride_up, 0, S, gate, 0.0, SWIGLU, 1, BLOCK_K, 1)
        acc += dot_code_tile(codes, scales, xt, GROUP, BLOCK_N, BLOCK_K)
    else:
        for k0 in range(0, K_PAD, BLOCK_K):
            xt = input_columns(gate, up, tok * stride_gate, tok * stride_up, k0, S, gate, 0.0, SWIGLU, 1, BLOCK_K, 1)
            acc += gemv_tile(down, rows, row_mask, k0, xt, high_offset, scale_offset, NVFP4, BITS, GROUP, K_PAD, BLOCK_N, BLOCK_K)
    if NVFP4:
        acc = acc / divisors
    gated = (1.0 / (1.0 + tl.exp(-sv.to(tl.float32)))).to(sv.dtype).to(tl.float32)
    return (gated * acc.to(sv.dtype).to(tl.float32)).to(sv.dtype).to(tl.float32)


@triton.jit
def _down_split_gemv_kernel(
    act,
    arena,
    table,
    topk_ids,
    weights,
    partial,
    arrivals,
    out,
    H,
    I,
    down_offset,
    high_offset,
    scale_offset,
    divisor_offset,
    gate,
    up,
    stride_gate,
    stride_up,
    shared_down,
    score,
    stride_score,
    S,
    s_high_offset,
    s_scale_offset,
    s_divisor_offset,
    TOP_K: tl.constexpr,
    NVFP4: tl.constexpr,
    BITS: tl.constexpr,
    GROUP: tl.constexpr,
    K_PAD: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    SHARED_EXPERT: tl.constexpr,
    S_NVFP4: tl.constexpr,
    S_BITS: tl.constexpr,
    S_GROUP: tl.constexpr,
    S_K_PAD: tl.constexpr,
    S_BLOCK_K: tl.constexpr,
    PREFETCH: tl.constexpr,
    SHARED_READS: tl.constexpr,
    PAIRS_PAD: tl.constexpr,
    PDL: tl.constexpr,
):
    """A program per (row slice, slot, token): its expert's down rows, rounded and weighted, into
    `partial` (float32); with SHARED_EXPERT a program per (row slice, token) more: the shared
    expert's down rows of SwiGLU(gate, up) (object `shared_down`, S columns), rounded and scaled by
    sigmoid(score) as `shared_expert` rounds them. The last of a slice's programs to arrive
    (`arrivals`, zero between launches) sums the slice's TOP_K routed rows in slot order into `out`
    (plus the shared expert's rows after rounding the routed sum) and zeroes its count again.
    With PREFETCH (both products of one k tile) each program reads its weight tile before it waits for the
    gate/up launch (`_routed_down_rows`). With SHARED_READS the program of an expert's first pair computes, stores
    and arrives for every pair of that expert in turn (its tile's repeats from L1/L2); the others' programs stop."""
    if not PREFETCH:
        await_producer(PDL)
    block, j, tok = tl.program_id(0), tl.program_id(1), tl.program_id(2).to(tl.int64)
    rows = program_rows(block, BLOCK_N, NVFP4)
    row_mask = rows < H
    pair = tok * TOP_K + j
    if SHARED_READS and j < TOP_K:
        first, left = _pairs_of_expert(topk_ids, pair, tl.load(topk_ids + pair), tl.num_programs(2) * TOP_K, PAIRS_PAD)
        if first:
            for _ in range(tl.sum(left.to(tl.int32), axis=0)):
                q, left = _next_pair(left, PAIRS_PAD)
                y = _routed_down_rows(
                    act, arena, table, topk_ids, weights, I, down_offset, high_offset, scale_offset, divisor_offset, q.to(tl.int64), rows,
                    row_mask, NVFP4, BITS, GROUP, K_PAD, BLOCK_N, BLOCK_K, False, PDL,
                )
                _arrive_with_rows(y, partial, arrivals, out, H, block, q % TOP_K, (q // TOP_K).to(tl.int64), rows, row_mask, TOP_K,
                                  SHARED_EXPERT, BLOCK_N)
    else:
        if SHARED_EXPERT:
            if j == TOP_K:
                y = _shared_expert_rows(
                    gate, up, stride_gate, stride_up, shared_down, score, stride_score, S, s_high_offset, s_scale_offset,
                    s_divisor_offset, tok, rows, row_mask, S_NVFP4, S_BITS, S_GROUP, S_K_PAD, BLOCK_N, S_BLOCK_K, PREFETCH, PDL,
                )
            else:
                y = _routed_down_rows(
                    act, arena, table, topk_ids, weights, I, down_offset, high_offset, scale_offset, divisor_offset, pair, rows, row_mask,
                    NVFP4, BITS, GROUP, K_PAD, BLOCK_N, BLOCK_K, PREFETCH, PDL,
                )
        else:
            y = _routed_down_rows(
                act, arena, table, topk_ids, weights, I, down_offset, high_offset, scale_offset, divisor_offset, pair, rows, row_mask,
                NVFP4, BITS, GROUP, K_PAD, BLOCK_N, BLOCK_K, PREFETCH, PDL,
            )
        _arrive_with_rows(y, partial, arrivals, out, H, block, j, tok, rows, row_mask, TOP_K, SHARED_EXPERT, BLOCK_N)


@triton.jit
def _arrive_with_rows(
    y, partial, arrivals, out, H, block, j, tok, rows, row_mask, TOP_K: tl.constexpr, SHARED_EXPERT: tl.constexpr, BLOCK_N: tl.constexpr,
):
    """Store rows `y` of token `tok`'s slot `j` into `partial` and arrive at the token's slice count; the last of the
    slice's programs to arrive sums the token's slots into `out` (`_sum_slots`) and zeroes the count."""
    slots: tl.constexpr = TOP_K + SHARED_EXPERT
    tl.store(partial + (tok * slots + j) * H + rows, y, mask=row_mask)
    count = arrivals + tok * tl.num_programs(0) + block
    if last_to_arrive(count, slots):
        _sum_slots(partial + tok * slots * H, out + tok * H, H, rows, row_mask, TOP_K, SHARED_EXPERT, BLOCK_N)
        rearm(count)


@triton.jit
def _runs(e, deferred, table, arena_bytes, PASS: tl.constexpr, WHERE: tl.constexpr):
    """Whether a tiled kernel's block of expert `e` (-1: an empty block) runs: PASS 0 every block, 1 those of
    experts not `deferred` ([E] bool or 0/1 ints), 2 those of deferred experts; WHERE 0 wherever the record is, 1 only
    records inside the arena (VRAM), 2 only records outside it (host memory, read over PCIe)."""
    run = e >= 0
    if PASS != 0:
        later = tl.load(deferred + tl.maximum(e, 0)).to(tl.int32)
        run = run & ((later != 0) == (PASS == 2))
    if WHERE != 0:
        offset = tl.load(table + tl.maximum(e, 0))
        inside = (offset >= 0) & (offset < arena_bytes)
        run = run & (inside == (WHERE == 1))
    return run


@triton.jit
def _gate_up_swiglu_kernel(
    x,
    arena,
    table,
    block_expert,
    block_pairs,
    deferred,
    arena_bytes,
    act,
    stride_x,
    H,
    I,
    high_offset,
    scale_offset,
    divisor_offset,
    TOP_K: tl.constexpr,
    NVFP4: tl.constexpr,
    WHOLE_TILES: tl.constexpr,
    BITS: tl.constexpr,
    GROUP: tl.constexpr,
    K_PAD: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    IEEE: tl.constexpr,
    PASS: tl.constexpr,
    WHERE: tl.constexpr,
):
    b = tl.program_id(0)
    e = tl.load(block_expert + b)
    if _runs(e, deferred, table, arena_bytes, PASS, WHERE):
        record = arena + tl.multiple_of(tl.load(table + e), 256)
        pairs = tl.load(block_pairs + b * BLOCK_M + tl.arange(0, BLOCK_M))
        pair_mask = pairs >= 0
        toks = tl.where(pair_mask, pairs // TOP_K, 0)
        cols_i = program_rows(tl.program_id(1), BLOCK_N, WHOLE_TILES)
        col_mask = cols_i < I
        acc_gate = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
        acc_up = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
        for k0 in range(0, K_PAD, BLOCK_K):
            cols = k0 + tl.arange(0, BLOCK_K)
            xt = tl.load(x + toks[:, None] * stride_x + cols[None, :], mask=pair_mask[:, None] & (cols < H)[None, :], other=0.0)
            wg = load_tile(record, cols_i, col_mask, k0, high_offset, scale_offset, NVFP4, BITS, GROUP, K_PAD, BLOCK_N, BLOCK_K)
            wu = load_tile(record, cols_i + I, col_mask, k0, high_offset, scale_offset, NVFP4, BITS, GROUP, K_PAD, BLOCK_N, BLOCK_K)
            if IEEE:
                acc_gate = tl.dot(xt, tl.trans(wg), acc_gate, input_precision="ieee")
                acc_up = tl.dot(xt, tl.trans(wu), acc_up, input_precision="ieee")
            else:
                acc_gate = tl.dot(xt, tl.trans(wg.to(xt.dtype)), acc_gate)
                acc_up = tl.dot(xt, tl.trans(wu.to(xt.dtype)), acc_up)
        # (the divisors after the k loop: a prefill program runs many k tiles, and held through them they cost
        # registers)
        gate_divisors = row_divisors(record, cols_i, col_mask, divisor_offset, NVFP4)
        up_divisors = row_divisors(record, cols_i + I, col_mask, divisor_offset, NVFP4)
        y = _swiglu_rows(acc_gate, acc_up, gate_divisors, up_divisors, x, NVFP4)
        tl.store(act + pairs[:, None] * I + cols_i[None, :], y.to(act.dtype.element_ty), mask=pair_mask[:, None] & col_mask[None, :])


@triton.jit
def _down_kernel(
    act,
    arena,
    table,
    block_expert,
    block_pairs,
    deferred,
    arena_bytes,
    weights,
    out,
    H,
    I,
    down_offset,
    high_offset,
    scale_offset,
    divisor_offset,
    NVFP4: tl.constexpr,
    BITS: tl.constexpr,
    GROUP: tl.constexpr,
    K_PAD: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    IEEE: tl.constexpr,
    PASS: tl.constexpr,
    WHERE: tl.constexpr,
):
    b = tl.program_id(0)
    e = tl.load(block_expert + b)
    if _runs(e, deferred, table, arena_bytes, PASS, WHERE):
        down = arena + tl.multiple_of(tl.load(table + e), 256) + down_offset
        pairs = tl.load(block_pairs + b * BLOCK_M + tl.arange(0, BLOCK_M))
        pair_mask = pairs >= 0
        safe_pairs = tl.where(pair_mask, pairs, 0)
        rows = program_rows(tl.program_id(1), BLOCK_N, NVFP4)
        row_mask = rows < H
        acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
        for k0 in range(0, K_PAD, BLOCK_K):
            cols = k0 + tl.arange(0, BLOCK_K)
            at = tl.load(act + safe_pairs[:, None] * I + cols[None, :], mask=pair_mask[:, None] & (cols < I)[None, :], other=0.0)
            wd = load_tile(down, rows, row_mask, k0, high_offset, scale_offset, NVFP4, BITS, GROUP, K_PAD, BLOCK_N, BLOCK_K)
            if IEEE:
                acc = tl.dot(at, tl.trans(wd), acc, input_precision="ieee")
            else:
                acc = tl.dot(at, tl.trans(wd.to(at.dtype)), acc)
        y = _rounded_down_rows(acc, row_divisors(down, rows, row_mask, divisor_offset, NVFP4), act, NVFP4)  # after the loop, as above
        w = tl.load(weights + safe_pairs, mask=pair_mask, other=0.0).to(tl.float32)
        tl.store(out + safe_pairs[:, None] * H + rows[None, :], y * w[:, None], mask=pair_mask[:, None] & row_mask[None, :])


def _geometries(layout: ExpertRecordLayout, hidden: int) -> tuple[TileGeometry, TileGeometry]:
    """Tile geometries of the gate/up and down objects; checks that the records fit `hidden`."""
    inter = layout.down.k
    if layout.gate_up.k != hidden or layout.gate_up.n != 2 * inter or layout.down.n != hidden:
        raise ValueError(
            f"expert records [{layout.gate_up.n}, {layout.gate_up.k}] / [{layout.down.n}, {inter}] do not fit hidden size {hidden}"
        )
    return TileGeometry.of(layout.gate_up), TileGeometry.of(layout.down)


def routed_experts(
    x: torch.Tensor,
    topk_ids: torch.Tensor,
    topk_weights: torch.Tensor,
    arena: torch.Tensor,
    table: torch.Tensor,
    layout: ExpertRecordLayout,
    host_records: bool = False,
    shared: SharedExpert | None = None,
    uses: torch.Tensor | None = None,
    shared_uses: torch.Tensor | None = None,
) -> torch.Tensor:
    """Routed-experts output [T, H] in x's dtype, plus `shared`'s rows when given (the MoE block's
    output: one token's in the same launch as its routed down rows, else `shared_expert` after them);
    expert e's record starts `table[e]` bytes (int64, a multiple of 256) after the start of the uint8
    tensor `arena`. `host_records`: some records are in host memory, read over PCIe (the tiled
    kernels then read rows in long runs). `uses` (int32 [E]) counts each (token, expert) assignment:
    in the gate/up launch of the matrix-vector path, else by `count_uses`; `shared_uses` (int32 [E]) the assignments
    that read no record of their own (an expert's later pairs where the matrix-vector kernels read it once for all)."""
    t, hidden = x.shape
    gu, dn = _geometries(layout, hidden)
    x = x.contiguous()
    pairs = t * topk_ids.shape[1]
    if pairs <= GEMV_MAX_PAIRS and t <= GEMV_MAX_TOKENS and t * triton.cdiv(hidden, SPLIT_DOWN_N) <= ARRIVAL_COUNTS:
        return _routed_experts_gemv(x, topk_ids, topk_weights, arena, table, layout, gu, dn, shared, host_records, uses, shared_uses)
    if uses is not None:
        count_uses(uses, topk_ids)
    tiles = PREFILL_TILES if pairs > PREFILL_MIN_PAIRS else DECODE_TILES
    if pairs <= PAIR_PLAN_MAX:
        plan = plan_pairs(topk_ids, tiles.block_m)
    else:
        plan = plan_work(topk_ids, table.numel(), tiles.block_m)
    act, weighted = _buffers(x, pairs, layout)
    args = (x, topk_ids, topk_weights, arena, table, layout, plan)
    if tiles is PREFILL_TILES:
        _prefill_tiled(args, act, weighted, None, EVERY_BLOCK, host_records)
    else:
        _tiled(*args, tiles, act, weighted)
    return _with_shared(sum_middle(weighted.view(t, -1, hidden), x.dtype), shared)


def _with_shared(routed: torch.Tensor, shared: SharedExpert | None) -> torch.Tensor:
    """The routed output plus the shared expert's rows (`shared_expert`), if any."""
    return routed if shared is None else shared_expert.shared_expert(shared.gate, shared.up, shared.down, routed, shared.score)


def routed_experts_split(
    x: torch.Tensor,
    topk_ids: torch.Tensor,
    topk_weights: torch.Tensor,
    arena: torch.Tensor,
    table: torch.Tensor,
    layout: ExpertRecordLayout,
    later: torch.Tensor,
    wait: Callable[[], None],
    host_records: bool = False,
) -> torch.Tensor:
    """`routed_experts` of a prefill chunk (more than PREFILL_MIN_PAIRS pairs) in passes over one
    plan: the blocks of the experts not in `later` ([E] bool or 0/1 ints, on x's device), then `wait()` (e.g. the
    stream waits for the copies that bring `later`'s records into VRAM), then the blocks of `later`,
    which are in VRAM (the VRAM tiles), and one per-token sum. `host_records`: some experts not in
    `later` are in host memory (before the wait, a pass of their own reads their rows in long runs)."""
    t, hidden = x.shape
    _geometries(layout, hidden)
    pairs = topk_ids.numel()
    if pairs <= PREFILL_MIN_PAIRS:
        raise ValueError(f"two-pass routed experts are for prefill chunks of more than {PREFILL_MIN_PAIRS} pairs, got {pairs}")
    x = x.contiguous()
    plan = plan_work(topk_ids, table.numel(), PREFILL_TILES.block_m)
    act, weighted = _buffers(x, pairs, layout)
    args = (x, topk_ids, topk_weights, arena, table, layout, plan)
    _prefill_tiled(args, act, weighted, later, FIRST_PASS, host_records)
    wait()
    _tiled(*args, PREFILL_TILES, act, weighted, later, SECOND_PASS)
    return sum_middle(weighted.view(t, -1, hidden), x.dtype)


def _prefill_tiled(args: tuple, act: torch.Tensor, weighted: torch.Tensor, deferred, which: int, host_records: bool) -> None:
    """`_tiled` (`args`: its first seven) on the prefill tiles over the blocks `deferred` / `which` select; with
    `host_records`, the experts in host memory in launches of their own on the PCIe tiles."""
    if host_records:
        _tiled(*args, PREFILL_TILES, act, weighted, deferred, which, VRAM_RECORDS)
        _tiled(*args, HOST_PREFILL_TILES, act, weighted, deferred, which, HOST_RECORDS)
    else:
        _tiled(*args, PREFILL_TILES, act, weighted, deferred, which)


def _buffers(x: torch.Tensor, pairs: int, layout: ExpertRecordLayout) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-pair SwiGLU activations [pairs, I] (x's dtype) and weighted output rows [pairs, H] (float32)."""
    act = torch.empty(pairs, layout.down.k, device=x.device, dtype=x.dtype)
    return act, torch.empty(pairs, x.shape[1], device=x.device, dtype=torch.float32)


def _tiled(
    x: torch.Tensor,
    topk_ids: torch.Tensor,
    topk_weights: torch.Tensor,
    arena: torch.Tensor,
    table: torch.Tensor,
    layout: ExpertRecordLayout,
    plan: WorkPlan,
    tiles: Tiles,
    act: torch.Tensor,
    weighted: torch.Tensor,
    deferred: torch.Tensor | None = None,
    which: int = EVERY_BLOCK,
    where: int = ANYWHERE,
) -> None:
    """The two tiled kernels over the blocks of `plan` (all, or with `deferred` [E] (bool or 0/1 ints) those of the
    experts not deferred (FIRST_PASS) or deferred (SECOND_PASS); of those, with `where`, only the experts
    whose records are in VRAM or only those in host memory): their pairs' rows of `act`, then of `weighted`."""
    hidden, inter, top_k = x.shape[1], layout.down.k, topk_ids.shape[1]
    gu, dn = TileGeometry.of(layout.gate_up), TileGeometry.of(layout.down)
    blocks = plan.block_expert.numel()
    ieee = x.dtype == torch.float32
    deferred = plan.block_expert if deferred is None else deferred  # (not read by EVERY_BLOCK)
    fitting.launch(
        _gate_up_swiglu_kernel, (blocks, triton.cdiv(inter, tiles.gate_up_n)),
        x, arena, table, plan.block_expert, plan.block_pairs, deferred, arena.numel(), act, x.stride(0), hidden, inter, gu.high_offset,
        gu.scale_offset, gu.divisor_offset, TOP_K=top_k, NVFP4=gu.nvfp4, WHOLE_TILES=_whole_tiles(gu, inter), BITS=gu.bits, GROUP=gu.group,
        K_PAD=gu.k_pad, BLOCK_M=plan.block_m, BLOCK_N=tiles.gate_up_n, BLOCK_K=block_k_for(gu.k_pad, tiles.block_k), IEEE=ieee, PASS=which,
        WHERE=where, num_warps=tiles.warps, num_stages=tiles.stages,
    )
    fitting.launch(
        _down_kernel, (blocks, triton.cdiv(hidden, tiles.down_n)),
        act, arena, table, plan.block_expert, plan.block_pairs, deferred, arena.numel(), topk_weights.reshape(-1).contiguous(), weighted,
        hidden,
        inter, layout.down_offset, dn.high_offset, dn.scale_offset, dn.divisor_offset,
        NVFP4=dn.nvfp4, BITS=dn.bits, GROUP=dn.group, K_PAD=dn.k_pad, BLOCK_M=plan.block_m, BLOCK_N=tiles.down_n,
        BLOCK_K=block_k_for(dn.k_pad, tiles.block_k), IEEE=ieee, PASS=which, WHERE=where, num_warps=tiles.warps, num_stages=tiles.stages,
    )


def _whole_tiles(gu: TileGeometry, inter: int) -> bool:
    """Whether the gate rows and the up rows of nvfp4 gate/up objects are each whole 128-row tiles (`tiles.program_rows`)."""
    return gu.nvfp4 and inter % 128 == 0


def _routed_experts_gemv(
    x: torch.Tensor,
    topk_ids: torch.Tensor,
    topk_weights: torch.Tensor,
    arena: torch.Tensor,
    table: torch.Tensor,
    layout: ExpertRecordLayout,
    gu: TileGeometry,
    dn: TileGeometry,
    shared: SharedExpert | None,
    host_records: bool,
    uses: torch.Tensor | None,
    shared_uses: torch.Tensor | None,
) -> torch.Tensor:
    """The matrix-vector path of `routed_experts` (few pairs): a program per (pair, column slice) for gate/up (it
    counts `uses`), a program per (row slice, slot, token) for down, the last of a slice's to arrive summing it;
    over host records from SHARED_READ_MIN_TOKENS tokens, only the programs of each expert's first pair compute,
    every pair of the expert."""
    (t, hidden), top_k, inter = x.shape, topk_ids.shape[1], layout.down.k
    ids, pairs = topk_ids.contiguous(), t * top_k
    act = torch.empty(pairs, inter, device=x.device, dtype=x.dtype)
    gu_block_k = gemv_block_k(gu.k_pad, GEMV_TILES.block_k)
    fold = _foldable(shared)
    s_data, sg = (shared.down.data, TileGeometry.of(shared.down.geometry)) if fold else (arena, dn)
    block_k, s_block_k = gemv_block_k(dn.k_pad, SPLIT_DOWN_BLOCK_K), gemv_block_k(sg.k_pad, SPLIT_DOWN_BLOCK_K)
    shared_reads = host_records and t >= SHARED_READ_MIN_TOKENS
    pairs_pad = triton.next_power_of_2(pairs)
    _gate_up_swiglu_gemv_kernel[(pairs, triton.cdiv(inter, GEMV_TILES.block_n))](
        x, arena, table, ids, act, act if uses is None else uses, act if shared_uses is None else shared_uses, x.stride(0), hidden,
        inter, gu.high_offset, gu.scale_offset, gu.divisor_offset, pairs, TOP_K=top_k, NVFP4=gu.nvfp4,
        WHOLE_TILES=_whole_tiles(gu, inter), BITS=gu.bits, GROUP=gu.group, K_PAD=gu.k_pad, BLOCK_N=GEMV_TILES.block_n,
        BLOCK_K=gu_block_k, COUNT=uses is not None, SHARED_READS=shared_reads, COUNT_SHARED=shared_uses is not None,
        PAIRS_PAD=pairs_pad, num_warps=GEMV_TILES.warps, num_stages=GEMV_TILES.stages, **launch_options(x.device),
    )
    out = torch.empty(t, hidden, device=x.device, dtype=x.dtype)
    partial = torch.empty(pairs + fold * t, hidden, device=x.device, dtype=torch.float32)
    gate, up, score = (shared.gate, shared.up, shared.score) if fold else (x, x, x)
    _down_split_gemv_kernel[(triton.cdiv(hidden, SPLIT_DOWN_N), top_k + fold, t)](
        act, arena, table, ids, topk_weights.contiguous(), partial, arrival_counts("moe.down_split", x.device), out, hidden, inter,
        layout.down_offset, dn.high_offset, dn.scale_offset, dn.divisor_offset, gate, up, gate.stride(0), up.stride(0), s_data, score,
        score.stride(0), gate.shape[1], sg.high_offset, sg.scale_offset, sg.divisor_offset, TOP_K=top_k, NVFP4=dn.nvfp4, BITS=dn.bits,
        GROUP=dn.group, K_PAD=dn.k_pad, BLOCK_N=SPLIT_DOWN_N, BLOCK_K=block_k, SHARED_EXPERT=fold,
        S_NVFP4=sg.nvfp4, S_BITS=sg.bits, S_GROUP=sg.group, S_K_PAD=sg.k_pad, S_BLOCK_K=s_block_k,
        PREFETCH=t <= DOWN_PREFETCH_MAX_TOKENS and block_k == dn.k_pad and s_block_k == sg.k_pad and not shared_reads,
        SHARED_READS=shared_reads, PAIRS_PAD=pairs_pad, num_warps=SPLIT_DOWN_WARPS, num_stages=GEMV_TILES.stages,
        **launch_options(x.device),
    )
    return out if fold else _with_shared(out, shared)


def _foldable(shared: SharedExpert | None) -> bool:
    """Whether the shared expert's down rows go into the routed down launch: FOLD_SHARED_EXPERT, a quantized down
    matrix, gate/up of contiguous columns."""
    return (
        FOLD_SHARED_EXPERT and shared is not None and not isinstance(shared.down, torch.Tensor)
        and shared.gate.stride(1) == 1 and shared.up.stride(1) == 1
    )


def record_table(slots: torch.Tensor, stride: int) -> torch.Tensor:
    """Offset table [E] of experts held in rows `slots[e]` of an arena of `stride`-byte rows."""
    if stride % 256:
        raise ValueError(f"record rows must be a multiple of 256 bytes, got {stride}")
    return slots.to(torch.int64) * stride
