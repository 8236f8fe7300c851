"""The shared expert's output after its gate/up product: `routed + sigmoid(score) * (silu(gate) * up) @ W_down^T`.

Reference op: `ReferenceBackend.shared_expert(gate, up, down, routed, score)`. One token's shared
expert usually runs inside the routed experts' down launch (`moe.routed_experts` with a
`SharedExpert`, the same roundings); otherwise, for the tokens a quantized down matrix takes the
matrix-vector kernel for (`quant_linear.on_matrix_vector`: decode, few-token steps) it is one launch of the
matrix-vector kernel (`quant_linear.fused_gemv`): it computes SwiGLU of the gate/up columns as it
reads them and adds the score-gated rows to the routed output in its epilogue (no intermediate
activation, no separate SwiGLU or gating launch). Otherwise (prefill, dense weights)
the same steps run as two elementwise kernels around the linear product. Intermediate results
are rounded to the activation dtype where the reference rounds them.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ninfer_offload.kernels import quant_linear
from ninfer_offload.kernels.dense_linear import dense_linear
from ninfer_offload.model.backend import Weight

BLOCK = 1024


def shared_expert(gate: torch.Tensor, up: torch.Tensor, down: Weight, routed: torch.Tensor, score: torch.Tensor) -> torch.Tensor:
    """routed [T, H] + sigmoid(score [T, 1]) * (silu(gate) * up) [T, S] @ down^T (down [H, S])."""
    if isinstance(down, torch.Tensor) or not quant_linear.on_matrix_vector(down.n, gate.shape[0]):
        act = swiglu(gate, up)
        shared = dense_linear(act, down) if isinstance(down, torch.Tensor) else quant_linear.quantized_linear(act, down.data, down.geometry)
        return add_gated(routed, score, shared)
    return quant_linear.fused_gemv(gate, down.data, down.geometry, up, quant_linear.SWIGLU, routed, score)


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
