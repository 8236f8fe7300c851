"""The shared expert's elementwise steps where its down product cannot fold them: SwiGLU of the gate/up
product before it, the score-gated add to the routed output after it (prefill, dense weights).

Reference op: the two steps of `ReferenceBackend.shared_expert`, each result rounded to the activation
dtype where the reference rounds.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

BLOCK = 1024


@triton.jit
def _swiglu_kernel(gate, up, out, N, C, stride_gate, stride_up, BLOCK: tl.constexpr):
    idx = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = idx < N
    row, col = (idx // C).to(tl.int64), idx % C
    gv = tl.load(gate + row * stride_gate + col, mask=mask, other=0.0)
    gf = gv.to(tl.float32)
    silu = (gf / (1.0 + tl.exp(-gf))).to(gv.dtype).to(tl.float32)
    uf = tl.load(up + row * stride_up + col, mask=mask, other=0.0).to(tl.float32)
    tl.store(out + idx, (silu * uf).to(out.dtype.element_ty), mask=mask)


def swiglu(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up, elementwise ([T, S] each, rows may be strided: column slices of one product) -> [T, S]:
    the prefill path's first step."""
    g, u = (x if x.stride(1) == 1 else x.contiguous() for x in (gate, up))
    out = torch.empty(g.shape, dtype=g.dtype, device=g.device)
    if g.numel():
        _swiglu_kernel[(triton.cdiv(g.numel(), BLOCK),)](g, u, out, g.numel(), g.shape[1], g.stride(0), u.stride(0), BLOCK=BLOCK)
    return out


@triton.jit
def _add_gated_kernel(routed, score, shared, out, N, C, stride_score, BLOCK: tl.constexpr):
    idx = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = idx < N
    sv = tl.load(score + (idx // C).to(tl.int64) * stride_score, mask=mask, other=0.0)
    sf = sv.to(tl.float32)
    gate = (1.0 / (1.0 + tl.exp(-sf))).to(sv.dtype).to(tl.float32)
    scaled = (gate * tl.load(shared + idx, mask=mask, other=0.0).to(tl.float32)).to(sv.dtype).to(tl.float32)
    total = tl.load(routed + idx, mask=mask, other=0.0).to(tl.float32) + scaled
    tl.store(out + idx, total.to(out.dtype.element_ty), mask=mask)


def add_gated(routed: torch.Tensor, score: torch.Tensor, shared: torch.Tensor) -> torch.Tensor:
    """routed [T, H] + sigmoid(score [T, 1]) * shared [T, H]: the prefill path's last step (score may be a
    column of a wider product)."""
    r, sh = routed.contiguous(), shared.contiguous()
    out = torch.empty_like(r)
    if r.numel():
        _add_gated_kernel[(triton.cdiv(r.numel(), BLOCK),)](r, score, sh, out, r.numel(), r.shape[-1], score.stride(0), BLOCK=BLOCK)
    return out
