"""The shared expert's elementwise steps in one launch each (reference ops: `ReferenceBackend.swiglu`,
`add_gated`): silu(gate) * up, and routed + sigmoid(score) * shared. Intermediate results are
rounded to the activation dtype where the reference rounds them."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

BLOCK = 1024


@triton.jit
def _swiglu_kernel(gate, up, out, N, BLOCK: tl.constexpr):
    idx = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = idx < N
    gv = tl.load(gate + idx, mask=mask, other=0.0)
    gf = gv.to(tl.float32)
    silu = (gf / (1.0 + tl.exp(-gf))).to(gv.dtype).to(tl.float32)
    tl.store(out + idx, (silu * tl.load(up + idx, mask=mask, other=0.0).to(tl.float32)).to(out.dtype.element_ty), mask=mask)


def swiglu(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up, elementwise (same shapes)."""
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
    """routed [T, H] + sigmoid(score [T, 1]) * shared [T, H]."""
    r, sc, sh = routed.contiguous(), score.contiguous(), shared.contiguous()
    out = torch.empty_like(r)
    if r.numel():
        _add_gated_kernel[(triton.cdiv(r.numel(), BLOCK),)](r, sc, sh, out, r.numel(), r.shape[-1], BLOCK=BLOCK)
    return out
