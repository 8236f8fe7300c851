"""RMSNorm in one pass: alone, after the residual add, or gated by silu(z) (reference ops:
`ReferenceBackend.rmsnorm`, `add_rmsnorm`, `gated_rmsnorm`)."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ninfer_offload.kernels.launch import await_producer, launch_options


@triton.jit
def _rmsnorm_kernel(x, w, out, D, eps, OFFSET: tl.constexpr, BLOCK_D: tl.constexpr, PDL: tl.constexpr):
    await_producer(PDL)
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK_D)
    mask = cols < D
    xv = tl.load(x + row * D + cols, mask=mask, other=0.0)
    xf = xv.to(tl.float32)
    normed = xf * tl.rsqrt(tl.sum(xf * xf) / D + eps)
    wv = tl.load(w + cols, mask=mask, other=0.0)
    if OFFSET:
        y = normed * (1.0 + wv.to(tl.float32))
    else:  # w cast to x's dtype times the normalised value rounded to x's dtype, as the reference
        y = wv.to(xv.dtype).to(tl.float32) * normed.to(xv.dtype).to(tl.float32)
    tl.store(out + row * D + cols, y.to(out.dtype.element_ty), mask=mask)


def rmsnorm(x: torch.Tensor, w: torch.Tensor, eps: float, offset: bool) -> torch.Tensor:
    """RMSNorm over the last dim (fp32 statistics): (1 + w) * x / rms if `offset`, else w * x / rms."""
    d = x.shape[-1]
    xc = x.contiguous()
    out = torch.empty_like(xc)
    rows = xc.numel() // d
    if rows:
        _rmsnorm_kernel[(rows,)](
            xc, w.contiguous(), out, d, eps, OFFSET=offset, BLOCK_D=triton.next_power_of_2(d), **launch_options(xc.device)
        )
    return out


@triton.jit
def residual_sum(xv, dv):
    """x + delta rounded to x's dtype, as float32: the residual stream that `add_rmsnorm` normalises."""
    return (xv.to(tl.float32) + dv.to(tl.float32)).to(xv.dtype).to(tl.float32)


@triton.jit
def offset_normed(sf, inv_rms, wv):
    """(1 + w) * sf / rms in float32 (the offset form of `add_rmsnorm`, before its rounding)."""
    return sf * inv_rms * (1.0 + wv.to(tl.float32))


@triton.jit
def residual_inv_rms(x, delta, D, eps, BLOCK_D: tl.constexpr):
    """1 / rms of one row's x + delta over its D columns (BLOCK_D >= D): `add_rmsnorm`'s statistic, for a
    kernel that normalises its own input tile (`quant_linear`'s matrix-vector products)."""
    cols = tl.arange(0, BLOCK_D)
    mask = cols < D
    sf = residual_sum(tl.load(x + cols, mask=mask, other=0.0), tl.load(delta + cols, mask=mask, other=0.0))
    return tl.rsqrt(tl.sum(sf * sf) / D + eps)


@triton.jit
def _add_rmsnorm_kernel(x, delta, total, out, w, D, eps, OFFSET: tl.constexpr, BLOCK_D: tl.constexpr, PDL: tl.constexpr):
    await_producer(PDL)
    row = tl.program_id(0).to(tl.int64)
    add_rmsnorm_row(x + row * D, delta + row * D, total + row * D, out + row * D, w, D, eps, OFFSET, BLOCK_D)


@triton.jit
def add_rmsnorm_row(x, delta, total, out, w, D, eps, OFFSET: tl.constexpr, BLOCK_D: tl.constexpr):
    """One row of `add_rmsnorm`: total = x + delta, out = its norm (also written by the matrix-vector
    kernels that normalise their own input, for the ops after them)."""
    cols = tl.arange(0, BLOCK_D)
    mask = cols < D
    xv = tl.load(x + cols, mask=mask, other=0.0)
    sf = residual_sum(xv, tl.load(delta + cols, mask=mask, other=0.0))
    tl.store(total + cols, sf.to(xv.dtype), mask=mask)
    inv_rms = tl.rsqrt(tl.sum(sf * sf) / D + eps)
    wv = tl.load(w + cols, mask=mask, other=0.0)
    if OFFSET:
        y = offset_normed(sf, inv_rms, wv)
    else:
        y = wv.to(xv.dtype).to(tl.float32) * (sf * inv_rms).to(xv.dtype).to(tl.float32)
    tl.store(out + cols, y.to(out.dtype.element_ty), mask=mask)


def add_rmsnorm(x: torch.Tensor, delta: torch.Tensor, w: torch.Tensor, eps: float, offset: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """(x + delta, rmsnorm(x + delta)) in one pass; the contract of `ReferenceBackend.add_rmsnorm`."""
    d = x.shape[-1]
    xc, dc = x.contiguous(), delta.contiguous()
    total, out = torch.empty_like(xc), torch.empty_like(xc)
    rows = xc.numel() // d
    if rows:
        _add_rmsnorm_kernel[(rows,)](
            xc, dc, total, out, w.contiguous(), d, eps, OFFSET=offset, BLOCK_D=triton.next_power_of_2(d), **launch_options(xc.device)
        )
    return total, out


@triton.jit
def _gated_rmsnorm_kernel(x, w, z, out, D, HEADS, stride_x, stride_z, eps, BLOCK_D: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    token, head = row // HEADS, row % HEADS
    cols = tl.arange(0, BLOCK_D)
    mask = cols < D
    xv = tl.load(x + token * stride_x + head * D + cols, mask=mask, other=0.0)
    xf = xv.to(tl.float32)
    normed = (xf * tl.rsqrt(tl.sum(xf * xf) / D + eps)).to(xv.dtype).to(tl.float32)
    y = (tl.load(w + cols, mask=mask, other=0.0).to(xv.dtype).to(tl.float32) * normed).to(xv.dtype).to(tl.float32)
    zf = tl.load(z + token * stride_z + head * D + cols, mask=mask, other=0.0).to(tl.float32)
    gate = (zf / (1.0 + tl.exp(-zf))).to(xv.dtype).to(tl.float32)
    tl.store(out + row * D + cols, (y * gate).to(out.dtype.element_ty), mask=mask)


def _token_rows(x: torch.Tensor, heads: int) -> torch.Tensor:
    """x as [tokens, heads, D] with each token's heads back to back (a view where they are: a column
    slice of a wider product; else a contiguous copy)."""
    x = x.reshape(-1, heads, x.shape[-1])
    return x if x.stride(2) == 1 and x.stride(1) == x.shape[2] else x.contiguous()


def gated_rmsnorm(x: torch.Tensor, w: torch.Tensor, eps: float, z: torch.Tensor) -> torch.Tensor:
    """rmsnorm(x) * w * silu(z) per row of the last dim, in one pass; the contract of `ReferenceBackend.gated_rmsnorm`.
    The tokens of x and z [..., H, D] may be strided rows (z: a column slice of the GDN input product)."""
    d = x.shape[-1]
    heads = x.shape[-2] if x.dim() > 1 else 1
    xr, zr = _token_rows(x, heads), _token_rows(z, heads)
    out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    rows = out.numel() // d
    if rows:
        _gated_rmsnorm_kernel[(rows,)](
            xr, w.contiguous(), zr, out, d, heads, xr.stride(0), zr.stride(0), eps, BLOCK_D=triton.next_power_of_2(d)
        )
    return out
