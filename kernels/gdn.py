"""Gated DeltaNet decode kernels: the gating (g, beta), the recurrent delta-rule step and the causal conv state update.

Reference ops: `ReferenceBackend.gdn_gating`, `gdn_decode` and `conv_update`. The recurrent
kernel keeps one value-column block of a head's fp32 state in registers while it walks the tokens
(T = 1 in decode, a few when verifying drafts), so the state is read and written once per call.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _gdn_recurrent_kernel(
    q,
    k,
    v,
    g,
    beta,
    state,
    out,
    T,
    HK: tl.constexpr,
    HV: tl.constexpr,
    DK: tl.constexpr,
    DV: tl.constexpr,
    DK_PAD: tl.constexpr,
    BLOCK_V: tl.constexpr,
):
    h = tl.program_id(0)
    cols = tl.program_id(1) * BLOCK_V + tl.arange(0, BLOCK_V)
    hk = h // (HV // HK)
    dk = tl.arange(0, DK_PAD)
    kmask = dk < DK
    vmask = cols < DV
    smask = kmask[:, None] & vmask[None, :]
    sptr = state + h * DK * DV + dk[:, None] * DV + cols[None, :]
    s = tl.load(sptr, mask=smask, other=0.0)
    for t in range(T):
        qt = tl.load(q + (t * HK + hk) * DK + dk, mask=kmask, other=0.0).to(tl.float32)
        kt = tl.load(k + (t * HK + hk) * DK + dk, mask=kmask, other=0.0).to(tl.float32)
        qt = qt * tl.rsqrt(tl.sum(qt * qt) + 1e-6) * (1.0 / tl.sqrt(float(DK)))
        kt = kt * tl.rsqrt(tl.sum(kt * kt) + 1e-6)
        vt = tl.load(v + (t * HV + h) * DV + cols, mask=vmask, other=0.0).to(tl.float32)
        decay = tl.exp(tl.load(g + t * HV + h).to(tl.float32))
        b = tl.load(beta + t * HV + h).to(tl.float32)
        s = s * decay
        update = b * (vt - tl.sum(kt[:, None] * s, axis=0))
        s = s + kt[:, None] * update[None, :]
        o = tl.sum(qt[:, None] * s, axis=0)
        tl.store(out + (t * HV + h) * DV + cols, o.to(out.dtype.element_ty), mask=vmask)
    tl.store(sptr, s, mask=smask)


def gdn_decode(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor, state: torch.Tensor) -> torch.Tensor:
    """Delta rule token by token; q, k [T, Hk, Dk], v [T, Hv, Dv], g, beta [T, Hv], state [Hv, Dk, Dv] fp32 (in place)."""
    t, hk, dk = q.shape
    hv, dv = v.shape[1], v.shape[2]
    if state.dtype != torch.float32 or not state.is_contiguous():
        raise ValueError("the GDN state must be a contiguous float32 tensor")
    out = torch.empty_like(v)
    block_v = min(32, triton.next_power_of_2(dv))
    _gdn_recurrent_kernel[(hv, triton.cdiv(dv, block_v))](
        q.contiguous(), k.contiguous(), v.contiguous(), g.contiguous(), beta.contiguous(), state, out, t,
        HK=hk, HV=hv, DK=dk, DV=dv, DK_PAD=triton.next_power_of_2(dk), BLOCK_V=block_v,
    )
    return out


@triton.jit
def _conv_update_kernel(x, conv_state, weight, out, T, C, TAPS: tl.constexpr, BLOCK_C: tl.constexpr):
    cols = tl.program_id(0) * BLOCK_C + tl.arange(0, BLOCK_C)
    mask = cols < C
    for t in range(T):
        acc = tl.zeros([BLOCK_C], dtype=tl.float32)
        for i in tl.static_range(TAPS - 1):
            acc += tl.load(weight + i * C + cols, mask=mask, other=0.0).to(tl.float32) * tl.load(conv_state + i * C + cols, mask=mask, other=0.0).to(tl.float32)
        xt = tl.load(x + t * C + cols, mask=mask, other=0.0)
        acc += tl.load(weight + (TAPS - 1) * C + cols, mask=mask, other=0.0).to(tl.float32) * xt.to(tl.float32)
        for i in tl.static_range(TAPS - 2):
            tl.store(conv_state + i * C + cols, tl.load(conv_state + (i + 1) * C + cols, mask=mask), mask=mask)
        tl.store(conv_state + (TAPS - 2) * C + cols, xt.to(conv_state.dtype.element_ty), mask=mask)
        tl.store(out + t * C + cols, (acc / (1.0 + tl.exp(-acc))).to(out.dtype.element_ty), mask=mask)


def conv_update(x: torch.Tensor, conv_state: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """silu(causal depthwise conv) of x [T, C] with taps weight [W, C]; conv_state [W-1, C] advanced in place."""
    t, c = x.shape
    taps = weight.shape[0]
    if conv_state.shape != (taps - 1, c) or not conv_state.is_contiguous():
        raise ValueError(f"conv state must be a contiguous [{taps - 1}, {c}] tensor")
    out = torch.empty_like(x)
    block_c = 256
    _conv_update_kernel[(triton.cdiv(c, block_c),)](x.contiguous(), conv_state, weight.contiguous(), out, t, c, TAPS=taps, BLOCK_C=block_c)
    return out


def fla_available() -> bool:
    """Whether flash-linear-attention's gated delta rule kernels can be imported."""
    try:
        import fla.ops.gated_delta_rule  # noqa: F401
    except ImportError:
        return False
    return True


def gdn_prefill(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor, state: torch.Tensor) -> torch.Tensor:
    """Chunked delta rule through flash-linear-attention (CUDA); the contract of `ReferenceBackend.gdn_prefill`."""
    from fla.ops.gated_delta_rule import chunk_gated_delta_rule

    out, final = chunk_gated_delta_rule(
        q.unsqueeze(0), k.unsqueeze(0), v.unsqueeze(0), g.float().unsqueeze(0), beta.to(v.dtype).unsqueeze(0),
        scale=q.shape[-1] ** -0.5, initial_state=state.unsqueeze(0), output_final_state=True, use_qk_l2norm_in_kernel=True,
    )
    state.copy_(final[0])
    return out[0].to(v.dtype)


@triton.jit
def _gating_kernel(a, b, a_log, dt_bias, g, beta, N, HV: tl.constexpr, BLOCK: tl.constexpr):
    idx = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = idx < N
    h = idx % HV
    x = tl.load(a + idx, mask=mask, other=0.0).to(tl.float32) + tl.load(dt_bias + h, mask=mask, other=0.0)
    softplus = tl.where(x > 20.0, x, tl.log(1.0 + tl.exp(x)))  # torch's softplus threshold
    tl.store(g + idx, -tl.exp(tl.load(a_log + h, mask=mask, other=0.0)) * softplus, mask=mask)
    bv = tl.load(b + idx, mask=mask, other=0.0).to(tl.float32)
    tl.store(beta + idx, (1.0 / (1.0 + tl.exp(-bv))).to(beta.dtype.element_ty), mask=mask)


def gdn_gating(a: torch.Tensor, b: torch.Tensor, a_log: torch.Tensor, dt_bias: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """g = -exp(a_log) * softplus(a + dt_bias) (fp32) and beta = sigmoid(b), [T, Hv], in one launch;
    the contract of `ReferenceBackend.gdn_gating`."""
    hv = a.shape[-1]
    g = torch.empty(a.shape, dtype=torch.float32, device=a.device)
    beta = torch.empty_like(b)
    n = a.numel()
    block = min(1024, triton.next_power_of_2(max(n, 1)))
    _gating_kernel[(triton.cdiv(n, block),)](
        a.contiguous(), b.contiguous(), a_log.float().contiguous(), dt_bias.float().contiguous(), g, beta, n, HV=hv, BLOCK=block
    )
    return g, beta
