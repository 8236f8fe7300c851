"""The shared expert's output after its gate/up product: `routed + sigmoid(score) * (silu(gate) * up) @ W_down^T`.

Reference op: `ReferenceBackend.shared_expert(gate, up, down, routed, score)`. Up to
`GEMV_MAX_TOKENS` tokens of a quantized down matrix (decode) it is one matrix-vector kernel: each
program decodes its rows' tiles once (`load_gemv_tile`), computes SwiGLU of the gate/up columns it
needs as it reads them, and adds the score-gated rows to the routed output in its epilogue (no
intermediate activation, no separate SwiGLU or gating launch). Otherwise (prefill, dense weights)
the same steps run as two elementwise kernels around the linear product. Intermediate results
are rounded to the activation dtype where the reference rounds them.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ninfer_offload.kernels import quant_linear
from ninfer_offload.kernels.dense_linear import dense_linear
from ninfer_offload.kernels.nvfp4 import load_divisors
from ninfer_offload.kernels.rowsplit import dot_code_tile
from ninfer_offload.kernels.tiles import TileGeometry, gemv_block_k, load_gemv_tile
from ninfer_offload.model.backend import Weight

BLOCK = 1024


@triton.jit
def _swiglu_columns(gate, up, row, cols, K):
    """silu(gate) * up of one token's columns `cols` (float32, rounded to the activation dtype as
    the reference rounds silu and the product)."""
    gv = tl.load(gate + row + cols, mask=cols < K, other=0.0)
    gf = gv.to(tl.float32)
    silu = (gf / (1.0 + tl.exp(-gf))).to(gv.dtype).to(tl.float32)
    return (silu * tl.load(up + row + cols, mask=cols < K, other=0.0).to(tl.float32)).to(gv.dtype).to(tl.float32)


@triton.jit
def _shared_expert_gemv_kernel(
    gate,
    up,
    stride_in,
    w,
    routed,
    score,
    stride_score,
    out,
    T,
    N,
    K,
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
):
    rows = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N).to(tl.int64)
    row_mask = rows < N
    toks = tl.arange(0, BLOCK_T)
    acc = tl.zeros([BLOCK_T, BLOCK_N], dtype=tl.float32)
    for k0 in range(0, K_PAD, BLOCK_K):
        low, high, scales = load_gemv_tile(w, rows, row_mask, k0, high_offset, scale_offset, NVFP4, BITS, GROUP, K_PAD, BLOCK_N, BLOCK_K)
        cols = k0 + tl.arange(0, BLOCK_K)
        for t in tl.static_range(BLOCK_T):  # the tile is decoded once for every token
            act = _swiglu_columns(gate, up, tl.minimum(t, T - 1).to(tl.int64) * stride_in, cols, K)
            part = dot_code_tile(low, high, scales, act, BITS, GROUP, BLOCK_N, BLOCK_K)
            acc = tl.where(toks[:, None] == t, acc + part[None, :], acc)
    if NVFP4:
        acc = acc / load_divisors(w, rows, row_mask, divisor_offset)[None, :]
    shared = acc.to(out.dtype.element_ty).to(tl.float32)
    tok_mask = toks < T
    sv = tl.load(score + toks.to(tl.int64) * stride_score, mask=tok_mask, other=0.0)
    sf = sv.to(tl.float32)
    gated = (1.0 / (1.0 + tl.exp(-sf))).to(sv.dtype).to(tl.float32)
    scaled = (gated[:, None] * shared).to(sv.dtype).to(tl.float32)
    offsets = toks[:, None].to(tl.int64) * N + rows[None, :]
    mask = tok_mask[:, None] & row_mask[None, :]
    total = tl.load(routed + offsets, mask=mask, other=0.0).to(tl.float32) + scaled
    tl.store(out + offsets, total.to(out.dtype.element_ty), mask=mask)


def shared_expert(gate: torch.Tensor, up: torch.Tensor, down: Weight, routed: torch.Tensor, score: torch.Tensor) -> torch.Tensor:
    """routed [T, H] + sigmoid(score [T, 1]) * (silu(gate) * up) [T, S] @ down^T (down [H, S])."""
    t, k = gate.shape
    if isinstance(down, torch.Tensor) or t > quant_linear.GEMV_MAX_TOKENS:
        act = swiglu(gate, up)
        shared = dense_linear(act, down) if isinstance(down, torch.Tensor) else quant_linear.quantized_linear(act, down.data, down.geometry)
        return add_gated(routed, score, shared)
    if k != down.k or up.stride() != gate.stride() or gate.stride(1) != 1:
        raise ValueError(f"gate/up [{t}, {k}] (same row-major strides) do not fit a down matrix of {down.k} columns")
    g = TileGeometry.of(down.geometry)
    r = routed.contiguous()
    out = torch.empty_like(r)
    _shared_expert_gemv_kernel[(triton.cdiv(down.n, quant_linear.GEMV_BLOCK_N),)](
        gate, up, gate.stride(0), down.data, r, score, score.stride(0), out, t, down.n, k,
        g.high_offset, g.scale_offset, g.divisor_offset,
        NVFP4=g.nvfp4, BITS=g.bits, GROUP=g.group, K_PAD=g.k_pad, BLOCK_T=triton.next_power_of_2(t),
        BLOCK_N=quant_linear.GEMV_BLOCK_N, BLOCK_K=gemv_block_k(g.k_pad, quant_linear.GEMV_BLOCK_K),
        num_warps=quant_linear.GEMV_WARPS, num_stages=quant_linear.GEMV_STAGES,
    )
    return out


@triton.jit
def _swiglu_kernel(gate, up, out, N, BLOCK: tl.constexpr):
    idx = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = idx < N
    gv = tl.load(gate + idx, mask=mask, other=0.0)
    gf = gv.to(tl.float32)
    silu = (gf / (1.0 + tl.exp(-gf))).to(gv.dtype).to(tl.float32)
    tl.store(out + idx, (silu * tl.load(up + idx, mask=mask, other=0.0).to(tl.float32)).to(out.dtype.element_ty), mask=mask)


def swiglu(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up, elementwise (same shapes): the prefill path's first step."""
    g, u = gate.contiguous(), up.contiguous()
    out = torch.empty_like(g)
    if g.numel():
        _swiglu_kernel[(triton.cdiv(g.numel(), BLOCK),)](g, u, out, g.numel(), BLOCK=BLOCK)
    return out


@triton.jit
def _add_gated_kernel(routed, score, shared, out, N, C, BLOCK: tl.constexpr):
    idx = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = idx < N
    sv = tl.load(score + idx // C, mask=mask, other=0.0)
    sf = sv.to(tl.float32)
    gate = (1.0 / (1.0 + tl.exp(-sf))).to(sv.dtype).to(tl.float32)
    scaled = (gate * tl.load(shared + idx, mask=mask, other=0.0).to(tl.float32)).to(sv.dtype).to(tl.float32)
    total = tl.load(routed + idx, mask=mask, other=0.0).to(tl.float32) + scaled
    tl.store(out + idx, total.to(out.dtype.element_ty), mask=mask)


def add_gated(routed: torch.Tensor, score: torch.Tensor, shared: torch.Tensor) -> torch.Tensor:
    """routed [T, H] + sigmoid(score [T, 1]) * shared [T, H]: the prefill path's last step."""
    r, sc, sh = routed.contiguous(), score.contiguous(), shared.contiguous()
    out = torch.empty_like(r)
    if r.numel():
        _add_gated_kernel[(triton.cdiv(r.numel(), BLOCK),)](r, sc, sh, out, r.numel(), r.shape[-1], BLOCK=BLOCK)
    return out
