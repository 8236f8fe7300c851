"""Quantized products of a few tokens (2..16): three designs measured side by side (bench/few_tokens_sweep.py).

Reference op: `ReferenceBackend.linear(x, w)` with `w` a row-split `QuantizedMatrix` (q8 or q4), i.e.
`x @ w.dequantize().T`. Each reads the codes in stored order with wide loads (q8: a byte a weight; q4: two
weights a byte, the low nibble the even column) and covers every token in one read of the weights:
* `few_tokens_linear`: tiles of codes times their scales, rounded to x's dtype, one tensor-core product per
  tile with the tokens padded to 16 (the weights as the MMA's M, or as its N);
* `group_dot_linear`: one scale group at a time, the codes only converted to x's dtype as the B operand (q4:
  the low nibbles against the even columns, the high ones against the odd), the group's scale applied to the
  product's float32 result, so nothing but a conversion lies between the weights' load and the MMA;
* `deferred_gemv`: CUDA cores, each thread's products of every token kept in registers across the row and
  summed across threads once per program.
Products with few rows split K across programs; the last program of a row block to arrive sums the splits in
split order (deterministic, no reduction launch).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ninfer_offload.artifact.formats import RowSplitGeometry
from ninfer_offload.kernels.arrivals import arrival_counts, last_to_arrive, rearm

BLOCK_T = 16  # tokens per program (the MMA's N), padded
SUPPORTED_BITS = (4, 8)


@triton.jit
def _code_tile(obj, rows, k0, BITS: tl.constexpr, K_PAD: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """float32 [BLOCK_N, BLOCK_K]: the signed codes of a tile, columns in order."""
    if BITS == 8:
        cols = k0 + tl.arange(0, BLOCK_K)
        raw = tl.load(obj + rows[:, None] * K_PAD + cols[None, :])
        return raw.to(tl.int8, bitcast=True).to(tl.float32)
    else:
        cols = k0 // 2 + tl.arange(0, BLOCK_K // 2)
        raw = tl.load(obj + rows[:, None] * (K_PAD // 2) + cols[None, :]).to(tl.int32)
        low = ((raw & 15) ^ 8) - 8
        high = ((raw >> 4) ^ 8) - 8
        return tl.reshape(tl.join(low, high), [BLOCK_N, BLOCK_K]).to(tl.float32)


@triton.jit
def _scale_tile(obj, rows, k0, scale_offset, GROUP: tl.constexpr, K_PAD: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """float32 [BLOCK_N, BLOCK_K]: each column's group scale."""
    groups = k0 // GROUP + tl.arange(0, BLOCK_K // GROUP)
    words = (obj + scale_offset).to(tl.pointer_type(tl.float16))
    scales = tl.load(words + rows[:, None] * (K_PAD // GROUP) + groups[None, :]).to(tl.float32)
    return tl.reshape(tl.broadcast_to(scales[:, :, None], [BLOCK_N, BLOCK_K // GROUP, GROUP]), [BLOCK_N, BLOCK_K])


@triton.jit
def _store_splits(acc, out, partial, count, pid_k, tile, mask, SPLIT_STRIDE, SPLIT: tl.constexpr):
    """Store a program's float32 tile: as it is with one split; else into its split's rows of `partial`, the last
    program of the row block to arrive at `count` summing the SPLIT tiles in split order into `out`."""
    if SPLIT > 1:
        tl.store(partial + pid_k.to(tl.int64) * SPLIT_STRIDE + tile, acc, mask=mask)
        if last_to_arrive(count, SPLIT):
            acc = tl.zeros_like(acc)
            for s in tl.static_range(SPLIT):  # through L2: other programs wrote these rows
                acc += tl.load(partial + s * SPLIT_STRIDE + tile, mask=mask, other=0.0, cache_modifier=".cg")
            tl.store(out + tile, acc.to(out.dtype.element_ty), mask=mask)
            rearm(count)
    else:
        tl.store(out + tile, acc.to(out.dtype.element_ty), mask=mask)


def _splits(programs: int, k_blocks: int, device: torch.device, split: int | None) -> tuple[int, int]:
    """(K splits, K blocks per split): `split` (default: enough to give about two programs per SM to `programs` row
    blocks), evened out so that no split is empty."""
    if split is None:
        split = max(1, min(k_blocks, (2 * _sm_count(device)) // programs))
    per_split = triton.cdiv(k_blocks, split)
    return triton.cdiv(k_blocks, per_split), per_split


@triton.jit
def _few_tokens_kernel(
    x, stride_x, w, out, partial, arrivals, T, N, K, scale_offset, K_TILES_PER_SPLIT,
    BITS: tl.constexpr, GROUP: tl.constexpr, K_PAD: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    BLOCK_T: tl.constexpr, SPLIT: tl.constexpr, IEEE: tl.constexpr, WEIGHTS_AS_M: tl.constexpr,
):
    """Programs (row block, K split): out[t, rows] for every token t < T over the split's K tiles."""
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    rows = (pid_n * BLOCK_N + tl.arange(0, BLOCK_N)).to(tl.int64)
    rows_in = tl.minimum(rows, N - 1)  # rows past N re-read the last one; never stored
    toks = tl.arange(0, BLOCK_T)
    tok_mask = toks < T
    acc = tl.zeros([BLOCK_N, BLOCK_T], dtype=tl.float32)
    first = pid_k * K_TILES_PER_SPLIT
    for kt in range(first, tl.minimum(first + K_TILES_PER_SPLIT, K_PAD // BLOCK_K)):
        k0 = kt * BLOCK_K
        cols = k0 + tl.arange(0, BLOCK_K)
        xt = tl.load(x + toks[None, :] * stride_x + cols[:, None], mask=tok_mask[None, :] & (cols < K)[:, None], other=0.0)
        weights = _code_tile(w, rows_in, k0, BITS, K_PAD, BLOCK_N, BLOCK_K) * _scale_tile(
            w, rows_in, k0, scale_offset, GROUP, K_PAD, BLOCK_N, BLOCK_K
        )
        if WEIGHTS_AS_M:
            acc = tl.dot(weights.to(xt.dtype), xt, acc, input_precision="ieee" if IEEE else None)
        else:  # tokens as M: the weights pass through shared memory as the B operand
            acc = tl.trans(tl.dot(tl.trans(xt), tl.trans(weights.to(xt.dtype)), tl.trans(acc), input_precision="ieee" if IEEE else None))
    tile = toks[None, :].to(tl.int64) * N + rows[:, None]
    mask = tok_mask[None, :] & (rows < N)[:, None]
    _store_splits(acc, out, partial, arrivals + pid_n, pid_k, tile, mask, T * N, SPLIT)


@triton.jit
def _deferred_gemv_kernel(
    x, stride_x, w, out, T, N, K, scale_offset,
    BITS: tl.constexpr, GROUP: tl.constexpr, K_PAD: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    BLOCK_T: tl.constexpr,
):
    """Programs (row block): out[t, rows] for every token t < T on CUDA cores. Each thread keeps its own products
    of every token across the whole row in registers ([BLOCK_T, BLOCK_N, BLOCK_K] float32) and the program sums
    them across threads once, after the K loop: a token costs one multiply-add per weight, no reduction per tile."""
    pid_n = tl.program_id(0)
    rows = (pid_n * BLOCK_N + tl.arange(0, BLOCK_N)).to(tl.int64)
    rows_in = tl.minimum(rows, N - 1)  # rows past N re-read the last one; never stored
    toks = tl.arange(0, BLOCK_T)
    tok_mask = toks < T
    acc = tl.zeros([BLOCK_T, BLOCK_N, BLOCK_K], dtype=tl.float32)
    for kt in range(0, K_PAD // BLOCK_K):
        k0 = kt * BLOCK_K
        cols = k0 + tl.arange(0, BLOCK_K)
        xt = tl.load(x + toks[:, None] * stride_x + cols[None, :], mask=tok_mask[:, None] & (cols < K)[None, :], other=0.0)
        weights = _code_tile(w, rows_in, k0, BITS, K_PAD, BLOCK_N, BLOCK_K) * _scale_tile(
            w, rows_in, k0, scale_offset, GROUP, K_PAD, BLOCK_N, BLOCK_K
        )
        acc += weights[None, :, :] * xt.to(tl.float32)[:, None, :]
    sums = tl.sum(acc, axis=2)
    tile = toks[:, None].to(tl.int64) * N + rows[None, :]
    tl.store(out + tile, sums.to(out.dtype.element_ty), mask=tok_mask[:, None] & (rows < N)[None, :])


@triton.jit
def _group_dot_kernel(
    x, stride_x, w, out, partial, arrivals, T, N, K, scale_offset, GROUPS_PER_SPLIT,
    BITS: tl.constexpr, GROUP: tl.constexpr, K_PAD: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_T: tl.constexpr,
    SPLIT: tl.constexpr, IEEE: tl.constexpr,
):
    """Programs (row block, K split): out[t, rows] for every token t < T, one scale group at a time on tensor cores:
    the group's codes, only converted to x's dtype, are the B operand of one product with the tokens' columns (q4: two
    products, the low nibbles with the even columns and the high ones with the odd columns), and the group's scale
    multiplies that product's float32 result. Nothing but a conversion lies between the weights' load and the MMA."""
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    rows = (pid_n * BLOCK_N + tl.arange(0, BLOCK_N)).to(tl.int64)
    rows_in = tl.minimum(rows, N - 1)  # rows past N re-read the last one; never stored
    toks = tl.arange(0, BLOCK_T)
    tok_mask = toks < T
    scales = (w + scale_offset).to(tl.pointer_type(tl.float16)) + rows_in * (K_PAD // GROUP)
    acc = tl.zeros([BLOCK_T, BLOCK_N], dtype=tl.float32)
    first = pid_k * GROUPS_PER_SPLIT
    for g in range(first, tl.minimum(first + GROUPS_PER_SPLIT, K_PAD // GROUP)):
        k0 = g * GROUP
        if BITS == 8:
            cols = k0 + tl.arange(0, GROUP)
            xt = tl.load(x + toks[:, None] * stride_x + cols[None, :], mask=tok_mask[:, None] & (cols < K)[None, :], other=0.0)
            codes = tl.load(w + rows_in[None, :] * K_PAD + cols[:, None]).to(tl.int8, bitcast=True)
            part = tl.dot(xt, codes.to(xt.dtype), input_precision="ieee" if IEEE else None)
        else:
            even = k0 + 2 * tl.arange(0, GROUP // 2)
            mask = tok_mask[:, None] & (even < K)[None, :]
            x_even = tl.load(x + toks[:, None] * stride_x + even[None, :], mask=mask, other=0.0)
            x_odd = tl.load(x + toks[:, None] * stride_x + even[None, :] + 1, mask=tok_mask[:, None] & (even + 1 < K)[None, :], other=0.0)
            packed = tl.load(w + rows_in[None, :] * (K_PAD // 2) + (even // 2)[:, None]).to(tl.int32)
            low = (((packed & 15) ^ 8) - 8).to(x_even.dtype)
            high = (((packed >> 4) ^ 8) - 8).to(x_even.dtype)
            part = tl.dot(x_even, low, input_precision="ieee" if IEEE else None)
            part = tl.dot(x_odd, high, part, input_precision="ieee" if IEEE else None)
        acc += part * tl.load(scales + g).to(tl.float32)[None, :]
    tile = toks[:, None].to(tl.int64) * N + rows[None, :]
    mask = tok_mask[:, None] & (rows < N)[None, :]
    _store_splits(acc, out, partial, arrivals + pid_n, pid_k, tile, mask, T * N, SPLIT)


def group_dot_linear(
    x: torch.Tensor, data: torch.Tensor, geometry: RowSplitGeometry, block_n: int = 64, split: int | None = None, num_warps: int = 4,
    num_stages: int = 4,
) -> torch.Tensor:
    """x [T, K] (T <= 16) @ W^T, one scale group per tensor-core product, the scale applied to its result
    (`_group_dot_kernel`); `split`: K splits (default: enough row-block programs for about two per SM)."""
    t, k = x.shape
    if not 1 <= t <= BLOCK_T or geometry.fmt.bits not in SUPPORTED_BITS or k != geometry.k:
        raise ValueError(f"group_dot_linear takes 1..{BLOCK_T} tokens of a q8/q4 row-split object of K={geometry.k}")
    n, groups = geometry.n, geometry.k_pad // geometry.fmt.group
    n_blocks = triton.cdiv(n, block_n)
    split, per_split = _splits(n_blocks, groups, x.device, split)
    out = torch.empty(t, n, device=x.device, dtype=x.dtype)
    partial = torch.empty(split, t, n, device=x.device, dtype=torch.float32) if split > 1 else out
    _group_dot_kernel[(n_blocks, split)](
        x, x.stride(0), data, out, partial, arrival_counts("small_batch.group_dot", x.device), t, n, k, geometry.scale_offset,
        per_split, BITS=geometry.fmt.bits, GROUP=geometry.fmt.group, K_PAD=geometry.k_pad, BLOCK_N=block_n, BLOCK_T=BLOCK_T,
        SPLIT=split, IEEE=x.dtype == torch.float32, num_warps=num_warps, num_stages=num_stages,
    )
    return out


def deferred_gemv(
    x: torch.Tensor, data: torch.Tensor, geometry: RowSplitGeometry, block_n: int = 8, block_k: int = 256, num_warps: int = 4,
    num_stages: int = 3,
) -> torch.Tensor:
    """x [T, K] (T <= 16) @ W^T on CUDA cores with one reduction per program (`_deferred_gemv_kernel`)."""
    t, k = x.shape
    if not 1 <= t <= BLOCK_T or geometry.fmt.bits not in SUPPORTED_BITS or k != geometry.k:
        raise ValueError(f"deferred_gemv takes 1..{BLOCK_T} tokens of a q8/q4 row-split object of K={geometry.k}")
    out = torch.empty(t, geometry.n, device=x.device, dtype=x.dtype)
    _deferred_gemv_kernel[(triton.cdiv(geometry.n, block_n),)](
        x, x.stride(0), data, out, t, geometry.n, k, geometry.scale_offset, BITS=geometry.fmt.bits, GROUP=geometry.fmt.group,
        K_PAD=geometry.k_pad, BLOCK_N=block_n, BLOCK_K=min(block_k, geometry.k_pad), BLOCK_T=triton.next_power_of_2(t),
        num_warps=num_warps, num_stages=num_stages,
    )
    return out


def few_tokens_linear(
    x: torch.Tensor, data: torch.Tensor, geometry: RowSplitGeometry, block_n: int = 64, block_k: int = 256, split: int | None = None,
    num_warps: int = 4, num_stages: int = 3, weights_as_m: bool = True,
) -> torch.Tensor:
    """x [T, K] (T <= 16) @ W^T for a row-split q8/q4 object `data` of `geometry`: [T, N] in x's dtype. `split`: K
    splits (default: enough row-block programs for about two per SM)."""
    t, k = x.shape
    if not 1 <= t <= BLOCK_T or geometry.fmt.bits not in SUPPORTED_BITS or k != geometry.k:
        raise ValueError(f"few_tokens_linear takes 1..{BLOCK_T} tokens of a q8/q4 row-split object of K={geometry.k}")
    n, k_pad = geometry.n, geometry.k_pad
    block_k = min(block_k, k_pad)
    k_tiles = k_pad // block_k
    n_blocks = triton.cdiv(n, block_n)
    split, per_split = _splits(n_blocks, k_tiles, x.device, split)
    out = torch.empty(t, n, device=x.device, dtype=x.dtype)
    partial = torch.empty(split, t, n, device=x.device, dtype=torch.float32) if split > 1 else out
    _few_tokens_kernel[(n_blocks, split)](
        x, x.stride(0), data, out, partial, arrival_counts("small_batch.split_k", x.device), t, n, k, geometry.scale_offset,
        per_split, BITS=geometry.fmt.bits, GROUP=geometry.fmt.group, K_PAD=k_pad, BLOCK_N=block_n, BLOCK_K=block_k,
        BLOCK_T=BLOCK_T, SPLIT=split, IEEE=x.dtype == torch.float32, WEIGHTS_AS_M=weights_as_m, num_warps=num_warps, num_stages=num_stages,
    )
    return out


def _sm_count(device: torch.device) -> int:
    if device.type != "cuda":
        return 4
    return torch.cuda.get_device_properties(device).multi_processor_count
