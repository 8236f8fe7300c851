"""Per-head q/k RMSNorm and partial rotary embedding (reference op: `ReferenceBackend.qk_norm_rotary`,
i.e. offset RMSNorm then `model.attention.Rotary`), and an attention layer's inputs in one launch
(reference op: `ReferenceBackend.attention_inputs`: q and k normed and rotated, k and v written to
their KV rows).

One program per (token, head) row: the row's RMS, then each of the first `dim` columns rotated
with its partner half (rotate_half), the rest passed through. The normed values, cos and sin are
rounded to the activation dtype where the reference rounds them.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ninfer_offload.kernels.launch import await_producer, launch_options


@triton.jit
def _norm_rotate(x, w, position, inv_freq, eps, D: tl.constexpr, ROT: tl.constexpr, D_PAD: tl.constexpr):
    """One head's row at `x` (D values): (1 + w) * x / rms, the first ROT columns rotated at `position`;
    float32, rounded to x's dtype where the reference rounds."""
    cols = tl.arange(0, D_PAD)
    mask = cols < D
    xv = tl.load(x + cols, mask=mask, other=0.0)
    xf = xv.to(tl.float32)
    inv_rms = tl.rsqrt(tl.sum(xf * xf) / D + eps)
    half: tl.constexpr = ROT // 2
    rotated = cols < ROT
    first = cols < half
    partner = tl.where(rotated, tl.where(first, cols + half, cols - half), cols)
    normed = (xf * inv_rms * (1.0 + tl.load(w + cols, mask=mask, other=0.0).to(tl.float32))).to(xv.dtype).to(tl.float32)
    pf = tl.load(x + partner, mask=mask, other=0.0).to(tl.float32)
    other = (pf * inv_rms * (1.0 + tl.load(w + partner, mask=mask, other=0.0).to(tl.float32))).to(xv.dtype).to(tl.float32)
    angle = position * tl.load(inv_freq + cols % half, mask=rotated, other=0.0)
    cos = tl.cos(angle).to(xv.dtype).to(tl.float32)
    sin = tl.sin(angle).to(xv.dtype).to(tl.float32)
    signed = tl.where(first, -other, other)
    y = (normed * cos).to(xv.dtype).to(tl.float32) + (signed * sin).to(xv.dtype).to(tl.float32)
    return tl.where(rotated, y, normed)


@triton.jit
def _qk_norm_rotary_kernel(
    x, w, positions, inv_freq, out, eps, HEADS: tl.constexpr, D: tl.constexpr, ROT: tl.constexpr, D_PAD: tl.constexpr
):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, D_PAD)
    position = tl.load(positions + row // HEADS).to(tl.float32)
    y = _norm_rotate(x + row * D, w, position, inv_freq, eps, D, ROT, D_PAD)
    tl.store(out + row * D + cols, y.to(out.dtype.element_ty), mask=cols < D)


@triton.jit
def _attention_inputs_kernel(
    q, k, v, stride_q, stride_k, stride_v, q_norm, k_norm, positions, inv_freq, kv_rows, q_out, k_pool, v_pool, eps,
    HQ: tl.constexpr, HKV: tl.constexpr, D: tl.constexpr, ROT: tl.constexpr, D_PAD: tl.constexpr, PDL: tl.constexpr,
):
    await_producer(PDL)
    t = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1)
    cols = tl.arange(0, D_PAD)
    mask = cols < D
    position = tl.load(positions + t).to(tl.float32)
    pool_row = tl.load(kv_rows + t).to(tl.int64) * (HKV * D)
    if head < HQ:
        y = _norm_rotate(q + t * stride_q + head * D, q_norm, position, inv_freq, eps, D, ROT, D_PAD)
        tl.store(q_out + (t * HQ + head) * D + cols, y.to(q_out.dtype.element_ty), mask=mask)
    elif head < HQ + HKV:
        y = _norm_rotate(k + t * stride_k + (head - HQ) * D, k_norm, position, inv_freq, eps, D, ROT, D_PAD)
        tl.store(k_pool + pool_row + (head - HQ) * D + cols, y.to(k_pool.dtype.element_ty), mask=mask)
    else:
        values = tl.load(v + t * stride_v + (head - HQ - HKV) * D + cols, mask=mask, other=0.0)
        tl.store(v_pool + pool_row + (head - HQ - HKV) * D + cols, values, mask=mask)


def qk_norm_rotary(x: torch.Tensor, w: torch.Tensor, eps: float, inv_freq: torch.Tensor, dim: int, positions: torch.Tensor) -> torch.Tensor:
    """x [T, heads, D]: (1 + w) * x / rms per head, then rotary on the first `dim` dims at `positions` [T]
    with frequencies `inv_freq` [dim / 2]."""
    t, heads, d = x.shape
    xc = x.contiguous()
    out = torch.empty_like(xc)
    if xc.numel():
        _qk_norm_rotary_kernel[(t * heads,)](
            xc, w.contiguous(), positions.contiguous(), inv_freq.contiguous(), out, eps,
            HEADS=heads, D=d, ROT=dim, D_PAD=triton.next_power_of_2(d),
        )
    return out


def attention_inputs(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, q_norm: torch.Tensor, k_norm: torch.Tensor, eps: float,
    inv_freq: torch.Tensor, dim: int, positions: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor, kv_rows: torch.Tensor,
) -> torch.Tensor:
    """q [T, Hq, D] and k [T, Hkv, D] normed and rotated (`qk_norm_rotary`), k and v [T, Hkv, D] written to
    rows `kv_rows` [T] of the pools [rows, Hkv, D] (the activations' dtype), in one launch; returns q
    (contiguous). Token rows may be strided (column slices of one product), heads must not be."""
    t, hq, d = q.shape
    hkv = k.shape[1]
    for x in (q, k, v):
        if x.stride(2) != 1 or x.stride(1) != d:
            raise ValueError("attention inputs need contiguous heads within each token's row")
    for pool in (k_pool, v_pool):
        if pool.dtype != q.dtype or not pool.is_contiguous() or pool.shape[1:] != (hkv, d):
            raise ValueError(f"the KV pools must be contiguous {q.dtype} [rows, {hkv}, {d}] tensors")
    out = torch.empty(t, hq, d, dtype=q.dtype, device=q.device)
    if t:
        _attention_inputs_kernel[(t, hq + 2 * hkv)](
            q, k, v, q.stride(0), k.stride(0), v.stride(0), q_norm.contiguous(), k_norm.contiguous(), positions.contiguous(),
            inv_freq.contiguous(), kv_rows.contiguous(), out, k_pool, v_pool, eps,
            HQ=hq, HKV=hkv, D=d, ROT=dim, D_PAD=triton.next_power_of_2(d), **launch_options(q.device),
        )
    return out
