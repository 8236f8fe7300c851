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
* few (token, slot) pairs (decode, verification, small batches): matrix-vector kernels. A program
  per (pair, column slice) works only if its pair is the first one routed to its expert, and then
  for every token routed to that expert, decoding each weight tile once (`load_gemv_tile`):
  kernel 1 computes gate and up rows and applies SwiGLU (per token on CUDA cores, or from
  `MMA_GATE_UP_MIN_TOKENS` tokens all of an expert's pairs in one tensor-core product). For up to
  `SHARED_DOWN_MIN_TOKENS - 1` tokens, kernel 2 runs a program per (slice of output rows, slot, token):
  each writes its expert's rounded, weighted rows (fp32) and the last of a slice's k programs to arrive
  sums them in slot order (an atomic count per slice, so no
  reduction is launched and the k experts are read in parallel). Given the MoE block's shared expert
  (`SharedExpert`), one more program per slice computes its down rows (SwiGLU of its gate/up, scaled
  by sigmoid of its score) in the same launch and the last arriver adds them to the rounded routed
  sum, as `shared_expert` would after it: one launch fewer per layer. For more tokens, the down kernel
  shares each expert as kernel 1 does (per token on CUDA cores, or from `MMA_DOWN_MIN_TOKENS` tokens all of
  an expert's pairs in one tensor-core product) and the k weighted rows of each token are summed in the
  same fixed order by the last program of each row slice to arrive (`SUM_IN_PRODUCT`).
* otherwise the pairs are planned in blocks of at most BLOCK_M pairs of one expert (each pair its
  own block when there are few, else sorted by expert). Kernel 1 computes gate and up rows for a
  block with `tl.dot` and applies SwiGLU; kernel 2 applies the down rows and the routing weight.
  The per-token sum over the k slots is a fixed-order reduction.

`routed_experts_split` runs the tiled kernels of a prefill chunk in passes over one plan (each pass runs
the blocks of one set of experts) with a caller's `wait` before the last, so that the first passes run
while the records of the last are still being copied into VRAM (`runtime.prefill_staging`); one sum
follows. Over many pairs, the experts in host memory get a pass of their own on tiles that read rows
in long runs over PCIe (`HOST_PREFILL_TILES`), the others keep the VRAM tiles (`PREFILL_TILES`: at
23eb0a6 the PCIe tiles took 1.5 + 0.9 ms per 4096-token layer over VRAM records against 0.57 + 0.45).
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
from ninfer_offload.kernels.quant_linear import SWIGLU, input_columns
from ninfer_offload.kernels.reduce import sum_middle
from ninfer_offload.kernels.rowsplit import dot_code_tile, load_columns, mma_code_tile
from ninfer_offload.kernels.tiles import TileGeometry, block_k_for, gemv_block_k, gemv_tile, load_gemv_tile, load_tile, program_rows


@dataclass(frozen=True)
class Tiles:
    """Launch shape of the two kernels: pairs per block, output columns per program, warps, and (tiled
    kernels) the widest k tile and the software-pipeline depth."""

    block_m: int
    gate_up_n: int
    down_n: int
    warps: int
    block_k: int = 256
    stages: int = 3


# Up to this many (token, slot) pairs: the matrix-vector kernels (block_m unused;
# widest column tile in block_k). H200 sweep (bench/kernel_sweeps.py): 20.5 us per layer vs 24.0 for 16/16/4 warps, 1024 wide.
GEMV_MAX_PAIRS = 64
GEMV_MAX_TOKENS = 8  # the kernels unroll a loop over the tokens
# From this many tokens the matrix-vector down product reads each expert once for all the tokens routed to
# it (`_down_shared_gemv_kernel`: weighted rows per pair, then one fixed-order sum launch); below it a
# program per (row slice, pair) reads its pair's expert and the last of a slice's k programs sums the
# weighted rows (`_down_split_gemv_kernel`: an expert shared by several tokens is read once per token, no
# sum launch). Both round, weight and sum the same way (on a GPU their fp32 dot products may differ in the
# last bits: the two kernels reduce a row in different orders). Module-level so benchmarks can compare them.
# H200 step A/B at 87d790d (bench/results/step_ab_h200_87d790d.json): a 3-draft verification (4 tokens) took
# 4.69 ms with the per-token kernel against 4.74 with the shared one.
SHARED_DOWN_MIN_TOKENS = 5
# The shared down kernel's per-token sum of the k weighted rows: by the last program of each row slice to arrive
# (an arrival count) or, turned off, by a `sum_middle` launch after it (40 launches, 91 us of the 5.3 ms batch-8
# step at 01e649c). Module-level so benchmarks can compare the two.
SUM_IN_PRODUCT = True
# Rows per program, warps and k tile of the split down kernel. H200, 1 token, 8 experts, 40 layers' records (cold
# L2): 7.3 us per layer at 32 rows / 2 warps, 7.5-8.5 at 16-128 rows / 2-8 warps; 10.0-10.7 us for one
# program per 16 rows walking the 8 experts (the kernel it replaced). In the step (with the shared expert folded
# in, 241 registers) 16 rows led in two runs at 05f867f: one-token step 2.216 / 2.207 ms against 2.242 / 2.247 at
# 32 rows (bench/results/step_ab_h200_split_tiles_05f867f.json, step_ab_h200_split_n16_05f867f.json); k tiles of
# 256 / 128 (fewer registers, a k loop) 2.57 / 2.52, 4 warps 2.36, 64 rows / 4 warps 2.75.
SPLIT_DOWN_N, SPLIT_DOWN_WARPS, SPLIT_DOWN_BLOCK_K = 16, 2, 512
# One token's shared expert in the split down launch (its own launch after the routed experts otherwise).
# Module-level so benchmarks can compare the two.
FOLD_SHARED_EXPERT = True
GEMV_TILES = Tiles(1, 16, 16, 8, 2048, 3)
# Up to this many tokens the gate/up product runs a program per pair on the one-token tiles (`PER_PAIR`: an expert
# shared by several tokens read once per token, its repeats mostly from L2), above it a program per expert walking
# its tokens (BATCH_GEMV_TILES, or tensor cores from MMA_GATE_UP_MIN_TOKENS). Module-level so benchmarks can
# compare them; 0 (off) until measured.
PAIR_GATE_UP_MAX_TOKENS = 0
# Several tokens: the gate/up kernel keeps its decoded gate and up tiles live across the token loop, so
# the one-token tiles spill at 8 tokens (255 registers and 368 bytes of stack per thread in the sm_90
# cubin); 8 rows x 512 columns x 4 warps keep them in 159 registers. H200, cold L2, 4 tokens
# (bench/results/kernels_h200_cold_cfce028.json): 58.8 us per layer against 69.0 (one token: 15.1 against 14.4).
# 16 down rows per program: 31.0 us per layer at 8 tokens against 35.9 for 8 rows, 15.5 against 16.4 at 4
# (step A/B at 87d790d, kernels by launch shape).
BATCH_GEMV_TILES = Tiles(1, 8, 16, 4, 512, 4)
# Several tokens' down product on tensor cores from this many tokens (`_down_shared_gemv_kernel` with MMA: each
# expert's pairs in one product, rows per program and k tile of MMA_DOWN_TILES), below it per token on CUDA cores.
# H200 step A/B at 87d790d (random routing, ~60 experts per layer at 8 tokens): 25.9 us per layer at 8 tokens
# against 35.9 per token (batch-8 step 6.13 against 6.46 ms); at 4 tokens 17.2 against 16.4 (the split kernel's
# range now). 5-7 tokens unmeasured: the per-token kernel keeps them. Rows per program (its per-token sums in the
# launch), H200 batch-8 step: 32 / 64 rows 34.6 / 29.3 us per layer (5.77 / 5.61 ms, k tiles of 256: 6.08;
# bench/results/step_ab_h200_9ed0fbb.json), 64 / 128 rows 29.3 / 26.7 us (5.23 / 5.17 ms, 64 rows on 8 warps 6.04;
# step_ab_h200_bf29cbc.json).
MMA_DOWN_MIN_TOKENS = 8
MMA_DOWN_TILES = Tiles(1, 8, 128, 4, 128, 3)
# The gate/up product likewise (`_gate_up_swiglu_gemv_kernel` with MMA, columns per program and k tile of
# MMA_GATE_UP_TILES). H200 step A/B at 442bc96: batch-8 step 5.56 ms with 32 columns per program against 6.03 per
# token (16 columns: 6.05); a 3-draft verification on it 5.12 against 4.62, so not below 8 tokens.
MMA_GATE_UP_MIN_TOKENS = 8
MMA_GATE_UP_TILES = Tiles(1, 32, 32, 4, 128, 3)  # sm_90 cubins: 242 registers at 64 pairs, no spill
# Tiled kernels: batches past the matrix-vector limits (few pairs per expert) and prefill (many).
# Module-level so benchmarks can sweep them.
DECODE_TILES = Tiles(16, 32, 64, 4)  # measured on the H200: 16/32/64 beat 16/16/32 (49 vs 64 us per layer)
PREFILL_TILES = Tiles(64, 64, 64, 4, 64, 3)  # H200 sweep, 2048 tokens: 0.86 ms per layer vs 1.76 for 64/32/64, k tile 256
# Prefill over records that may live in host memory (read over PCIe): 256-wide k tiles, so each row
# is read in runs of 128+ bytes (runs of 32 bytes measured 0.43 of the PCIe roofline, 128 bytes 0.68-0.73).
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
def _expert_tokens(topk_ids, pair, pairs, TOP_K: tl.constexpr, BLOCK_PAIRS: tl.constexpr):
    """(expert of `pair`, whether `pair` is its expert's first pair, the pair indices [BLOCK_PAIRS], which
    of them use the expert, their tokens): a program per pair does the work of every pair of its
    expert, so each expert's weights are read and decoded once per step."""
    index = tl.arange(0, BLOCK_PAIRS)
    ids = tl.load(topk_ids + index, mask=index < pairs, other=-1)
    e = tl.load(topk_ids + pair)
    uses = ids == e
    first = tl.min(tl.where(uses, index, BLOCK_PAIRS))
    return e, first == pair, index, uses, index // TOP_K


@triton.jit
def _token_bits(uses, token_of, BLOCK_T: tl.constexpr):
    """int32 with bit t set where token t is routed to the expert (`_expert_tokens`' uses): computed once, before
    the k loop, so the per-token branches inside it test a bit instead of reducing over the pairs per tile."""
    toks = tl.arange(0, BLOCK_T)
    routed = tl.max(tl.where(uses[:, None] & (token_of[:, None] == toks[None, :]), 1, 0), axis=0)
    return tl.sum(routed << toks)


PAIR_BITS = tl.constexpr(8)  # bits per token of `_token_first_pairs`: pair indices up to 127, and 128 for none


@triton.jit
def _token_first_pairs(uses, token_of, index, BLOCK_T: tl.constexpr, BLOCK_PAIRS: tl.constexpr):
    """int64 holding, PAIR_BITS bits per token t, the index of token t's first pair routed to the expert
    (BLOCK_PAIRS where none is): computed once, before the k loop (BLOCK_T * PAIR_BITS <= 64, BLOCK_PAIRS <= 128)."""
    toks = tl.arange(0, BLOCK_T)
    first = tl.min(tl.where(uses[:, None] & (token_of[:, None] == toks[None, :]), index[:, None], BLOCK_PAIRS), axis=0)
    return tl.sum(first.to(tl.int64) << (toks.to(tl.int64) * PAIR_BITS))


@triton.jit
def pair_rows(y, token_of, BLOCK_T: tl.constexpr, BLOCK_PAIRS: tl.constexpr, BLOCK_N: tl.constexpr):
    """Per-token rows y [BLOCK_T, BLOCK_N] -> one row per pair [BLOCK_PAIRS, BLOCK_N] (its token's):
    every pair of the expert gets its row, also a token's repeated uses of one expert."""
    toks = tl.arange(0, BLOCK_T)
    out = tl.zeros([BLOCK_PAIRS, BLOCK_N], dtype=tl.float32)
    for t in tl.static_range(BLOCK_T):
        row = tl.sum(tl.where(toks[:, None] == t, y, 0.0), axis=0)
        out = tl.where((token_of == t)[:, None], row[None, :], out)
    return out


MMA_ROWS = tl.constexpr(16)  # pairs of one expert per tensor-core product of the matrix-vector kernels


@triton.jit
def _expert_pair_rows(uses, rank, index, r0, BLOCK_PAIRS: tl.constexpr):
    """(member, live) [MMA_ROWS]: row r of a tensor-core product is the expert's (r0 + r)-th pair (`rank`: of
    each pair among the expert's), `live` where there is one."""
    slot = r0 + tl.arange(0, MMA_ROWS)
    member = tl.min(tl.where(uses[None, :] & (rank[None, :] == slot[:, None]), index[None, :], BLOCK_PAIRS), axis=1)
    return member, member < BLOCK_PAIRS


@triton.jit
def _gate_up_tiles(
    record, cols_i, col_mask, k0, I, high_offset, scale_offset,
    NVFP4: tl.constexpr, BITS: tl.constexpr, GROUP: tl.constexpr, K_PAD: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):
    """(gate codes, gate scales, up codes, up scales): the k tile at `k0` of an expert's gate rows `cols_i` and of
    its up rows (I rows further on), for `dot_code_tile` / `mma_code_tile`."""
    gate = load_gemv_tile(record, cols_i, col_mask, k0, high_offset, scale_offset, NVFP4, BITS, GROUP, K_PAD, BLOCK_N, BLOCK_K)
    up = load_gemv_tile(record, cols_i + I, col_mask, k0, high_offset, scale_offset, NVFP4, BITS, GROUP, K_PAD, BLOCK_N, BLOCK_K)
    return gate[0], gate[1], up[0], up[1]


@triton.jit
def _swiglu_rows(acc_gate, acc_up, gate_divisors, up_divisors, x, NVFP4: tl.constexpr):
    """SwiGLU of gate and up accumulators [R, BLOCK_N] (float32): over their rows' divisors (nvfp4,
    `row_divisors`), each rounded to the activations' dtype first."""
    if NVFP4:
        acc_gate = acc_gate / gate_divisors[None, :]
        acc_up = acc_up / up_divisors[None, :]
    gate = acc_gate.to(x.dtype.element_ty).to(tl.float32)
    up = acc_up.to(x.dtype.element_ty).to(tl.float32)
    return gate / (1.0 + tl.exp(-gate)) * up


@triton.jit
def _gate_up_swiglu_gemv_kernel(
    x,
    arena,
    table,
    topk_ids,
    act,
    use_counts,
    stride_x,
    pairs,
    H,
    I,
    high_offset,
    scale_offset,
    divisor_offset,
    TOP_K: tl.constexpr,
    BLOCK_T: tl.constexpr,
    BLOCK_PAIRS: tl.constexpr,
    NVFP4: tl.constexpr,
    WHOLE_TILES: tl.constexpr,
    BITS: tl.constexpr,
    GROUP: tl.constexpr,
    K_PAD: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    MMA: tl.constexpr,
    PER_PAIR: tl.constexpr,
    COUNT: tl.constexpr,
    IEEE: tl.constexpr,
    PDL: tl.constexpr,
):
    """Gate and up columns of the expert of each first pair, decoded once, for every pair routed to it; SwiGLU
    of each pair into `act`. Per token on CUDA cores, or with MMA every pair of the expert at once on tensor
    cores (as `_down_shared_gemv_kernel` does). PER_PAIR (BLOCK_T 1): every pair's program does its own pair,
    an expert shared by several tokens read once per token (its other reads mostly from L2). With COUNT, each
    pair's first program adds 1 to `use_counts` at its expert (`model.experts.count_uses`)."""
    await_producer(PDL)
    if PER_PAIR:
        index = tl.arange(0, BLOCK_PAIRS)
        e = tl.load(topk_ids + tl.program_id(0))
        owner = True
        uses = index == tl.program_id(0)
        token_of = tl.zeros([BLOCK_PAIRS], dtype=tl.int32)
        x_rows = x + (tl.program_id(0) // TOP_K).to(tl.int64) * stride_x
    else:
        e, owner, index, uses, token_of = _expert_tokens(topk_ids, tl.program_id(0), pairs, TOP_K, BLOCK_PAIRS)
        x_rows = x
    if COUNT:
        if tl.program_id(1) == 0:
            tl.atomic_add(use_counts + e, 1, sem="relaxed")
    if owner:
        record = arena + tl.multiple_of(tl.load(table + e), 256)
        cols_i = program_rows(tl.program_id(1), BLOCK_N, WHOLE_TILES)
        col_mask = cols_i < I
        gate_divisors = row_divisors(record, cols_i, col_mask, divisor_offset, NVFP4)
        up_divisors = row_divisors(record, cols_i + I, col_mask, divisor_offset, NVFP4)
        if MMA:
            rank = tl.cumsum(uses.to(tl.int32), axis=0) - 1
            for r0 in range(0, tl.sum(uses.to(tl.int32)), MMA_ROWS):
                member, live = _expert_pair_rows(uses, rank, index, r0, BLOCK_PAIRS)
                token = tl.where(live, member // TOP_K, 0).to(tl.int64)
                acc_gate = tl.zeros([MMA_ROWS, BLOCK_N], dtype=tl.float32)
                acc_up = tl.zeros([MMA_ROWS, BLOCK_N], dtype=tl.float32)
                for k0 in range(0, K_PAD, BLOCK_K):
                    g_codes, g_scales, u_codes, u_scales = _gate_up_tiles(
                        record, cols_i, col_mask, k0, I, high_offset, scale_offset, NVFP4, BITS, GROUP, K_PAD, BLOCK_N, BLOCK_K
                    )
                    cols = k0 + tl.arange(0, BLOCK_K)
                    xt = tl.load(x + token[:, None] * stride_x + cols[None, :], mask=live[:, None] & (cols < H)[None, :], other=0.0)
                    acc_gate = mma_code_tile(g_codes, g_scales, xt, acc_gate, GROUP, BLOCK_N, BLOCK_K, IEEE)
                    acc_up = mma_code_tile(u_codes, u_scales, xt, acc_up, GROUP, BLOCK_N, BLOCK_K, IEEE)
                y = _swiglu_rows(acc_gate, acc_up, gate_divisors, up_divisors, x, NVFP4)
                ptr = act + member.to(tl.int64)[:, None] * I + cols_i[None, :]
                tl.store(ptr, y.to(act.dtype.element_ty), mask=live[:, None] & col_mask[None, :])
        else:
            toks = tl.arange(0, BLOCK_T)
            acc_gate = tl.zeros([BLOCK_T, BLOCK_N], dtype=tl.float32)
            acc_up = tl.zeros([BLOCK_T, BLOCK_N], dtype=tl.float32)
            routed = _token_bits(uses, token_of, BLOCK_T)
            for k0 in range(0, K_PAD, BLOCK_K):
                g_codes, g_scales, u_codes, u_scales = _gate_up_tiles(
                    record, cols_i, col_mask, k0, I, high_offset, scale_offset, NVFP4, BITS, GROUP, K_PAD, BLOCK_N, BLOCK_K
                )
                for t in tl.static_range(BLOCK_T):  # the tile is decoded once for every token routed to the expert
                    if (routed >> t) & 1:
                        xt = load_columns(x_rows + t * stride_x, k0, H, BLOCK_K)
                        gate_part = dot_code_tile(g_codes, g_scales, xt, GROUP, BLOCK_N, BLOCK_K)
                        up_part = dot_code_tile(u_codes, u_scales, xt, GROUP, BLOCK_N, BLOCK_K)
                        acc_gate = tl.where(toks[:, None] == t, acc_gate + gate_part[None, :], acc_gate)
                        acc_up = tl.where(toks[:, None] == t, acc_up + up_part[None, :], acc_up)
            y = _swiglu_rows(acc_gate, acc_up, gate_divisors, up_divisors, x, NVFP4)
            pair_act = pair_rows(y, token_of, BLOCK_T, BLOCK_PAIRS, BLOCK_N)
            ptr = act + index.to(tl.int64)[:, None] * I + cols_i[None, :]
            tl.store(ptr, pair_act.to(act.dtype.element_ty), mask=uses[:, None] & col_mask[None, :])


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
def _down_shared_gemv_kernel(
    act,
    arena,
    table,
    topk_ids,
    weights,
    weighted,
    out,
    arrivals,
    pairs,
    H,
    I,
    down_offset,
    high_offset,
    scale_offset,
    divisor_offset,
    TOP_K: tl.constexpr,
    BLOCK_T: tl.constexpr,
    BLOCK_PAIRS: tl.constexpr,
    NVFP4: tl.constexpr,
    BITS: tl.constexpr,
    GROUP: tl.constexpr,
    K_PAD: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    MMA: tl.constexpr,
    IEEE: tl.constexpr,
    SUM: tl.constexpr,
    PDL: tl.constexpr,
):
    """Several tokens: the expert of each first pair, decoded once, applied to every pair routed to it;
    each pair's weighted output row (float32) goes to `weighted` for the per-token sum. Per token on CUDA
    cores, or with MMA every pair of the expert at once on tensor cores (in index order, MMA_ROWS per
    product: one product unless a token uses the expert in several slots; no per-token loop or reduction).
    With SUM, the last of a row slice's programs to arrive (`arrivals`; every pair's program arrives, owner
    or not) sums each token's TOP_K weighted rows in slot order into `out`."""
    await_producer(PDL)
    e, owner, index, uses, token_of = _expert_tokens(topk_ids, tl.program_id(0), pairs, TOP_K, BLOCK_PAIRS)
    rows = program_rows(tl.program_id(1), BLOCK_N, NVFP4)
    row_mask = rows < H
    if owner:
        down = arena + tl.multiple_of(tl.load(table + e), 256) + down_offset
        divisors = row_divisors(down, rows, row_mask, divisor_offset, NVFP4)
        if MMA:
            rank = tl.cumsum(uses.to(tl.int32), axis=0) - 1  # of each pair among the expert's
            for r0 in range(0, tl.sum(uses.to(tl.int32)), MMA_ROWS):
                member, live = _expert_pair_rows(uses, rank, index, r0, BLOCK_PAIRS)
                acc = tl.zeros([MMA_ROWS, BLOCK_N], dtype=tl.float32)
                for k0 in range(0, K_PAD, BLOCK_K):
                    codes, scales = load_gemv_tile(
                        down, rows, row_mask, k0, high_offset, scale_offset, NVFP4, BITS, GROUP, K_PAD, BLOCK_N, BLOCK_K
                    )
                    cols = k0 + tl.arange(0, BLOCK_K)
                    at = act + member.to(tl.int64)[:, None] * I + cols[None, :]
                    xt = tl.load(at, mask=live[:, None] & (cols < I)[None, :], other=0.0)
                    acc = mma_code_tile(codes, scales, xt, acc, GROUP, BLOCK_N, BLOCK_K, IEEE)
                y = _rounded_down_rows(acc, divisors, act, NVFP4)
                w = tl.load(weights + member, mask=live, other=0.0).to(tl.float32)
                ptr = weighted + member.to(tl.int64)[:, None] * H + rows[None, :]
                tl.store(ptr, y * w[:, None], mask=live[:, None] & row_mask[None, :])
        else:
            toks = tl.arange(0, BLOCK_T)
            acc = tl.zeros([BLOCK_T, BLOCK_N], dtype=tl.float32)
            first_pairs = _token_first_pairs(uses, token_of, index, BLOCK_T, BLOCK_PAIRS)
            for k0 in range(0, K_PAD, BLOCK_K):
                codes, scales = load_gemv_tile(
                    down, rows, row_mask, k0, high_offset, scale_offset, NVFP4, BITS, GROUP, K_PAD, BLOCK_N, BLOCK_K
                )
                for t in tl.static_range(BLOCK_T):
                    pair = (first_pairs >> (PAIR_BITS * t)) & (BLOCK_PAIRS * 2 - 1)
                    if pair < BLOCK_PAIRS:
                        xt = load_columns(act + pair.to(tl.int64) * I, k0, I, BLOCK_K)
                        part = dot_code_tile(codes, scales, xt, GROUP, BLOCK_N, BLOCK_K)
                        acc = tl.where(toks[:, None] == t, acc + part[None, :], acc)
            y = _rounded_down_rows(acc, divisors, act, NVFP4)
            w = tl.load(weights + index, mask=uses, other=0.0).to(tl.float32)
            ptr = weighted + index.to(tl.int64)[:, None] * H + rows[None, :]
            out_rows = pair_rows(y, token_of, BLOCK_T, BLOCK_PAIRS, BLOCK_N) * w[:, None]
            tl.store(ptr, out_rows, mask=uses[:, None] & row_mask[None, :])
    if SUM:
        count = arrivals + tl.program_id(1)
        if last_to_arrive(count, pairs):
            for t in tl.static_range(BLOCK_T):
                if t < pairs // TOP_K:
                    _sum_slots(weighted + t * TOP_K * H, out + t * H, H, rows, row_mask, TOP_K, False, BLOCK_N)
            rearm(count)


@triton.jit
def _routed_down_rows(
    act, arena, table, topk_ids, weights, I, down_offset, high_offset, scale_offset, divisor_offset, pair, rows, row_mask,
    NVFP4: tl.constexpr, BITS: tl.constexpr, GROUP: tl.constexpr, K_PAD: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):
    """float32 [BLOCK_N]: rows `rows` of pair `pair`'s expert down product, rounded, times its routing weight (read,
    like the divisors, before the k loop: after it, a memory round trip after all of the program's compute)."""
    down = arena + tl.multiple_of(tl.load(table + tl.load(topk_ids + pair)), 256) + down_offset
    weight = tl.load(weights + pair).to(tl.float32)
    divisors = row_divisors(down, rows, row_mask, divisor_offset, NVFP4)
    acc = tl.zeros([BLOCK_N], dtype=tl.float32)
    for k0 in range(0, K_PAD, BLOCK_K):
        xt = load_columns(act + pair * I, k0, I, BLOCK_K)
        acc += gemv_tile(down, rows, row_mask, k0, xt, high_offset, scale_offset, NVFP4, BITS, GROUP, K_PAD, BLOCK_N, BLOCK_K)
    return _rounded_down_rows(acc, divisors, act, NVFP4) * weight


@triton.jit
def _shared_expert_rows(
    gate, up, stride_gate, stride_up, down, score, stride_score, S, high_offset, scale_offset, divisor_offset, tok, rows, row_mask,
    NVFP4: tl.constexpr, BITS: tl.constexpr, GROUP: tl.constexpr, K_PAD: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):
    """float32 [BLOCK_N]: rows `rows` of token `tok`'s shared expert, sigmoid(score) * SwiGLU(gate, up) @ down^T,
    rounded where `shared_expert.shared_expert` rounds (before the routed output is added)."""
    sv = tl.load(score + tok * stride_score)
    divisors = row_divisors(down, rows, row_mask, divisor_offset, NVFP4)
    acc = tl.zeros([BLOCK_N], dtype=tl.float32)
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
    PDL: tl.constexpr,
):
    """A program per (row slice, slot, token): its expert's down rows, rounded and weighted, into
    `partial` (float32); with SHARED_EXPERT a program per (row slice, token) more: the shared
    expert's down rows of SwiGLU(gate, up) (object `shared_down`, S columns), rounded and scaled by
    sigmoid(score) as `shared_expert` rounds them. The last of a slice's programs to arrive
    (`arrivals`, zero between launches) sums the slice's TOP_K routed rows in slot order into `out`
    (plus the shared expert's rows after rounding the routed sum) and zeroes its count again."""
    await_producer(PDL)
    block, j, tok = tl.program_id(0), tl.program_id(1), tl.program_id(2).to(tl.int64)
    rows = program_rows(block, BLOCK_N, NVFP4)
    row_mask = rows < H
    slots: tl.constexpr = TOP_K + SHARED_EXPERT
    pair = tok * TOP_K + j
    if SHARED_EXPERT:
        if j == TOP_K:
            y = _shared_expert_rows(
                gate, up, stride_gate, stride_up, shared_down, score, stride_score, S, s_high_offset, s_scale_offset, s_divisor_offset,
                tok, rows, row_mask, S_NVFP4, S_BITS, S_GROUP, S_K_PAD, BLOCK_N, S_BLOCK_K,
            )
        else:
            y = _routed_down_rows(
                act, arena, table, topk_ids, weights, I, down_offset, high_offset, scale_offset, divisor_offset, pair, rows, row_mask,
                NVFP4, BITS, GROUP, K_PAD, BLOCK_N, BLOCK_K,
            )
    else:
        y = _routed_down_rows(
            act, arena, table, topk_ids, weights, I, down_offset, high_offset, scale_offset, divisor_offset, pair, rows, row_mask,
            NVFP4, BITS, GROUP, K_PAD, BLOCK_N, BLOCK_K,
        )
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
        # registers: 168 against 128 per thread in the sm_90 cubin)
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
) -> torch.Tensor:
    """Routed-experts output [T, H] in x's dtype, plus `shared`'s rows when given (the MoE block's
    output: one token's in the same launch as its routed down rows, else `shared_expert` after them);
    expert e's record starts `table[e]` bytes (int64, a multiple of 256) after the start of the uint8
    tensor `arena`. `host_records`: some records are in host memory, read over PCIe (the tiled
    kernels then read rows in long runs). `uses` (int32 [E]) counts each (token, expert) assignment:
    in the gate/up launch of the matrix-vector path, else by `count_uses`."""
    t, hidden = x.shape
    gu, dn = _geometries(layout, hidden)
    x = x.contiguous()
    pairs = t * topk_ids.shape[1]
    if pairs <= GEMV_MAX_PAIRS and t <= GEMV_MAX_TOKENS:
        return _routed_experts_gemv(x, topk_ids, topk_weights, arena, table, layout, gu, dn, shared, uses)
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


def _on_tensor_cores(tokens: int, min_tokens: int, geometry: TileGeometry, tiles: Tiles) -> bool:
    """Whether a matrix-vector product of `tokens` tokens runs on tensor cores: from `min_tokens`, and only with
    k tiles of 128+ columns (the tiles the tensor-core launches were measured with)."""
    return tokens >= min_tokens and gemv_block_k(geometry.k_pad, tiles.block_k) >= 128


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
    uses: torch.Tensor | None,
) -> torch.Tensor:
    """The matrix-vector path of `routed_experts` (few pairs); the gate/up launch counts `uses`."""
    (t, hidden), top_k, inter = x.shape, topk_ids.shape[1], layout.down.k
    ids, tiles = topk_ids.contiguous(), GEMV_TILES if t == 1 else BATCH_GEMV_TILES
    pairs = t * top_k
    block_t, block_pairs = triton.next_power_of_2(t), triton.next_power_of_2(pairs)
    act = torch.empty(pairs, inter, device=x.device, dtype=x.dtype)
    mma = _on_tensor_cores(t, MMA_GATE_UP_MIN_TOKENS, gu, MMA_GATE_UP_TILES)
    per_pair = not mma and t <= PAIR_GATE_UP_MAX_TOKENS
    gate_up_tiles = MMA_GATE_UP_TILES if mma else GEMV_TILES if per_pair else tiles
    _gate_up_swiglu_gemv_kernel[(pairs, triton.cdiv(inter, gate_up_tiles.gate_up_n))](
        x, arena, table, ids, act, act if uses is None else uses, x.stride(0), pairs, hidden, inter, gu.high_offset, gu.scale_offset,
        gu.divisor_offset, TOP_K=top_k, BLOCK_T=1 if per_pair else block_t, BLOCK_PAIRS=block_pairs, NVFP4=gu.nvfp4,
        WHOLE_TILES=_whole_tiles(gu, inter), BITS=gu.bits, GROUP=gu.group, K_PAD=gu.k_pad, BLOCK_N=gate_up_tiles.gate_up_n,
        BLOCK_K=gemv_block_k(gu.k_pad, gate_up_tiles.block_k), MMA=mma, PER_PAIR=per_pair, COUNT=uses is not None,
        IEEE=x.dtype == torch.float32,
        num_warps=gate_up_tiles.warps, num_stages=gate_up_tiles.stages, **launch_options(x.device),
    )
    weights = topk_weights.contiguous()
    blocks = triton.cdiv(hidden, SPLIT_DOWN_N)
    if t < SHARED_DOWN_MIN_TOKENS and t * blocks <= ARRIVAL_COUNTS:  # a program per (row slice, slot), no sum launch
        fold = _foldable(shared)
        out = torch.empty(t, hidden, device=x.device, dtype=x.dtype)
        partial = torch.empty(pairs + fold * t, hidden, device=x.device, dtype=torch.float32)
        gate, up, score = (shared.gate, shared.up, shared.score) if fold else (x, x, x)
        s_data, sg = (shared.down.data, TileGeometry.of(shared.down.geometry)) if fold else (arena, dn)
        _down_split_gemv_kernel[(blocks, top_k + fold, t)](
            act, arena, table, ids, weights, partial, arrival_counts("moe.down_split", x.device), out, hidden, inter, layout.down_offset,
            dn.high_offset, dn.scale_offset, dn.divisor_offset, gate, up, gate.stride(0), up.stride(0), s_data, score, score.stride(0),
            gate.shape[1], sg.high_offset, sg.scale_offset, sg.divisor_offset, TOP_K=top_k, NVFP4=dn.nvfp4, BITS=dn.bits,
            GROUP=dn.group, K_PAD=dn.k_pad, BLOCK_N=SPLIT_DOWN_N, BLOCK_K=gemv_block_k(dn.k_pad, SPLIT_DOWN_BLOCK_K), SHARED_EXPERT=fold,
            S_NVFP4=sg.nvfp4, S_BITS=sg.bits, S_GROUP=sg.group, S_K_PAD=sg.k_pad, S_BLOCK_K=gemv_block_k(sg.k_pad, SPLIT_DOWN_BLOCK_K),
            num_warps=SPLIT_DOWN_WARPS, num_stages=tiles.stages, **launch_options(x.device),
        )
        return out if fold else _with_shared(out, shared)
    weighted = torch.empty(pairs, hidden, device=x.device, dtype=torch.float32)
    mma = _on_tensor_cores(t, MMA_DOWN_MIN_TOKENS, dn, MMA_DOWN_TILES)
    down_tiles = MMA_DOWN_TILES if mma else tiles
    slices = triton.cdiv(hidden, down_tiles.down_n)
    summed = SUM_IN_PRODUCT and slices <= ARRIVAL_COUNTS
    out = torch.empty(t, hidden, device=x.device, dtype=x.dtype)
    _down_shared_gemv_kernel[(pairs, slices)](
        act, arena, table, ids, weights, weighted, out, arrival_counts("moe.down_shared", x.device), pairs, hidden, inter,
        layout.down_offset, dn.high_offset, dn.scale_offset, dn.divisor_offset, TOP_K=top_k, BLOCK_T=block_t, BLOCK_PAIRS=block_pairs,
        NVFP4=dn.nvfp4, BITS=dn.bits, GROUP=dn.group, K_PAD=dn.k_pad, BLOCK_N=down_tiles.down_n,
        BLOCK_K=gemv_block_k(dn.k_pad, down_tiles.block_k), MMA=mma, IEEE=x.dtype == torch.float32, SUM=summed,
        num_warps=down_tiles.warps, num_stages=down_tiles.stages, **launch_options(x.device),
    )
    return _with_shared(out if summed else sum_middle(weighted.view(t, top_k, hidden), x.dtype), shared)


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
