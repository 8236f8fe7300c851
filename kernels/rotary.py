"""Per-head q/k RMSNorm and partial rotary embedding in one launch (reference op:
`ReferenceBackend.qk_norm_rotary`, i.e. offset RMSNorm then `model.attention.Rotary`).

One program per (token, head) row: the row's RMS, then each of the first `dim` columns rotated
with its partner half (rotate_half), the rest passed through. The normed values, cos and sin are
rounded to the activation dtype where the reference rounds them.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _qk_norm_rotary_kernel(
    x, w, positions, inv_freq, out, eps, HEADS: tl.constexpr, D: tl.constexpr, ROT: tl.constexpr, D_PAD: tl.constexpr
):
    row = tl.program_id(0).to(tl.int64)
    base = row * D
    cols = tl.arange(0, D_PAD)
    mask = cols < D
    xv = tl.load(x + base + cols, mask=mask, other=0.0)
    xf = xv.to(tl.float32)
    inv_rms = tl.rsqrt(tl.sum(xf * xf) / D + eps)
    half: tl.constexpr = ROT // 2
    rotated = cols < ROT
    first = cols < half
    partner = tl.where(rotated, tl.where(first, cols + half, cols - half), cols)
    normed = (xf * inv_rms * (1.0 + tl.load(w + cols, mask=mask, other=0.0).to(tl.float32))).to(xv.dtype).to(tl.float32)
    pf = tl.load(x + base + partner, mask=mask, other=0.0).to(tl.float32)
    other = (pf * inv_rms * (1.0 + tl.load(w + partner, mask=mask, other=0.0).to(tl.float32))).to(xv.dtype).to(tl.float32)
    angle = tl.load(positions + row // HEADS).to(tl.float32) * tl.load(inv_freq + cols % half, mask=rotated, other=0.0)
    cos = tl.cos(angle).to(xv.dtype).to(tl.float32)
    sin = tl.sin(angle).to(xv.dtype).to(tl.float32)
    signed = tl.where(first, -other, other)
    y = (normed * cos).to(xv.dtype).to(tl.float32) + (signed * sin).to(xv.dtype).to(tl.float32)
    tl.store(out + base + cols, tl.where(rotated, y, normed).to(out.dtype.element_ty), mask=mask)


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
