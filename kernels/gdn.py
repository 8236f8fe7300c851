"""Gated DeltaNet decode kernels: the gating (g, beta), the recurrent delta-rule step and the causal conv state update.

Reference ops: `ReferenceBackend.gdn_gating`, `gdn_decode` and `conv_update`. The decode kernels
take B sequences of T tokens each (rows grouped per sequence) in one launch and find each
sequence's state through its slot, a device tensor, so a captured step keeps its launch shape.
The recurrent kernel keeps one value-column block of a head's fp32 state in registers while it
walks the sequence's tokens (T = 1 in decode, a few when verifying drafts, up to
`model.gdn.RECURRENT_PREFILL_TOKENS` in a short prefill chunk), so the state is read and written once
per call; it gates each token from the raw a and b projections itself (the gating kernel's
arithmetic, inline), so decode launches no separate gating kernel. A longer prefill chunk gates with
`gdn_gating` and runs the chunked rule (flash-linear-attention) on g and beta.
"""

from __future__ import annotations

import threading
from concurrent.futures import Future

import torch
import triton
import triton.language as tl

from ninfer_offload.kernels.launch import await_producer, launch_options


@triton.jit
def _gates(a_ptr, b_ptr, neg_rate, bias):
    """(exp(g), beta) of one token and head from its raw a and b, as `gdn_gating` computes g (fp32)
    and beta (rounded to b's dtype): g = -exp(a_log) * softplus(a + dt_bias), beta = sigmoid(b)."""
    x = tl.load(a_ptr).to(tl.float32) + bias
    softplus = tl.where(x > 20.0, x, tl.log(1.0 + tl.exp(x)))  # torch's softplus threshold
    bv = tl.load(b_ptr)
    beta = (1.0 / (1.0 + tl.exp(-bv.to(tl.float32)))).to(bv.dtype).to(tl.float32)
    return tl.exp(neg_rate * softplus), beta


@triton.jit
def _gdn_recurrent_kernel(
    q,
    k,
    v,
    a,
    b,
    a_log,
    dt_bias,
    slots,
    valid,
    states,
    kept,
    out,
    T,
    KEPT_TOKENS,
    stride_q,
    stride_k,
    stride_v,
    stride_a,
    stride_b,
    HK: tl.constexpr,
    HV: tl.constexpr,
    DK: tl.constexpr,
    DV: tl.constexpr,
    DK_PAD: tl.constexpr,
    BLOCK_V: tl.constexpr,
    KEEP: tl.constexpr,
    PDL: tl.constexpr,
):
    """One (value head, column slice, sequence): its state slice, read while the kernel before this one finishes
    (only this kernel writes the states; `launch.await_producer`), stepped through the sequence's valid tokens."""
    h = tl.program_id(0)
    cols = tl.program_id(1) * BLOCK_V + tl.arange(0, BLOCK_V)
    seq = tl.program_id(2)
    slot = tl.load(slots + seq).to(tl.int64)
    hk = h // (HV // HK)
    dk = tl.arange(0, DK_PAD)
    kmask = dk < DK
    vmask = cols < DV
    smask = kmask[:, None] & vmask[None, :]
    block = h * DK * DV + dk[:, None] * DV + cols[None, :]
    sptr = states + slot * HV * DK * DV + block
    s = tl.load(sptr, mask=smask, other=0.0)
    neg_rate = -tl.exp(tl.load(a_log + h).to(tl.float32))
    bias = tl.load(dt_bias + h).to(tl.float32)
    n = tl.load(valid + seq).to(tl.int32)
    await_producer(PDL)
    for t in range(n):
        row = seq * T + t
        qt = tl.load(q + row * stride_q + hk * DK + dk, mask=kmask, other=0.0).to(tl.float32)
        kt = tl.load(k + row * stride_k + hk * DK + dk, mask=kmask, other=0.0).to(tl.float32)
        qt = qt * tl.rsqrt(tl.sum(qt * qt) + 1e-6) * (1.0 / tl.sqrt(float(DK)))
        kt = kt * tl.rsqrt(tl.sum(kt * kt) + 1e-6)
        vt = tl.load(v + row * stride_v + h * DV + cols, mask=vmask, other=0.0).to(tl.float32)
        decay, beta = _gates(a + row * stride_a + h, b + row * stride_b + h, neg_rate, bias)
        s = s * decay
        update = beta * (vt - tl.sum(kt[:, None] * s, axis=0))
        s = s + kt[:, None] * update[None, :]
        o = tl.sum(qt[:, None] * s, axis=0)
        tl.store(out + (row * HV + h) * DV + cols, o.to(out.dtype.element_ty), mask=vmask)
        if KEEP:
            if t < T - 1:
                tl.store(kept + (slot * KEPT_TOKENS + t) * HV * DK * DV + block, s, mask=smask)
    for t in range(n, T):  # padding rows: zeros, the state stays the one after the last real token
        tl.store(out + ((seq * T + t) * HV + h) * DV + cols, tl.zeros([BLOCK_V], dtype=out.dtype.element_ty), mask=vmask)
    tl.store(sptr, s, mask=smask)


# Value columns of a state per program of the recurrent kernel: the step's 32 heads x 128 columns run as 128
# programs of [128, 32] states. Narrower slices (more programs, a shorter chain per program) were slower
# (docs/performance.md, Kernels). Module-level so benchmarks can compare them.
RECURRENT_BLOCK_V = 32


def _rows(x: torch.Tensor) -> torch.Tensor:
    """x [N, heads, D] with contiguous heads and dims (rows may be strided, e.g. a split of a wider tensor)."""
    return x if x.stride(2) == 1 and x.stride(1) == x.shape[2] else x.contiguous()


def _check_kept(kept: torch.Tensor, live: torch.Tensor, tokens_per_sequence: int) -> None:
    """`kept` must be [slots, K >= T-1, ...] like the live states `live` [slots, ...]."""
    if kept.dtype != live.dtype or kept.shape[0] != live.shape[0] or kept.shape[2:] != live.shape[1:] or not kept.is_contiguous():
        raise ValueError(f"kept states must be one contiguous {live.dtype} [slots, K, {', '.join(map(str, live.shape[1:]))}] tensor")
    if kept.shape[1] < tokens_per_sequence - 1:
        raise ValueError(f"kept states hold {kept.shape[1]} tokens, fewer than the {tokens_per_sequence - 1} a step keeps")


def gdn_decode(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, a: torch.Tensor, b: torch.Tensor, a_log: torch.Tensor,
    dt_bias: torch.Tensor, states: torch.Tensor, slots: torch.Tensor, valid: torch.Tensor, tokens_per_sequence: int,
    kept: torch.Tensor | None,
) -> torch.Tensor:
    """Delta rule token by token for the B = len(slots) sequences of T tokens in q, k [N, Hk, Dk], v [N, Hv, Dv],
    gated by the raw a, b [N, Hv] (rows may be strided) with a_log, dt_bias [Hv] as `gdn_gating` gates
    them, sequence b on states[slots[b]] of states [slots, Hv, Dk, Dv] fp32 (in place) over its first
    valid[b] tokens (the rest are padding: zero rows, no effect on the state). A `kept`
    [slots, K, Hv, Dk, Dv] receives the state after each token but the last. Returns [N, Hv, Dv]."""
    _, hk, dk = q.shape
    _, hv, dv = v.shape
    if states.dtype != torch.float32 or not states.is_contiguous():
        raise ValueError("the GDN states must be a contiguous float32 tensor")
    if a.stride(1) != 1 or b.stride(1) != 1:
        raise ValueError("a and b need contiguous heads")
    if kept is not None:
        _check_kept(kept, states, tokens_per_sequence)
    q, k, v = _rows(q), _rows(k), _rows(v)
    out = torch.empty(v.shape, dtype=v.dtype, device=v.device)
    block_v = min(RECURRENT_BLOCK_V, triton.next_power_of_2(dv))
    _gdn_recurrent_kernel[(hv, triton.cdiv(dv, block_v), slots.shape[0])](
        q, k, v, a, b, a_log.float().contiguous(), dt_bias.float().contiguous(), slots, valid, states,
        states if kept is None else kept, out, tokens_per_sequence, 0 if kept is None else kept.shape[1],
        q.stride(0), k.stride(0), v.stride(0), a.stride(0), b.stride(0),
        HK=hk, HV=hv, DK=dk, DV=dv, DK_PAD=triton.next_power_of_2(dk), BLOCK_V=block_v, KEEP=kept is not None,
        **launch_options(v.device),
    )
    return out


@triton.jit
def _window(x, stride_x, state, first_row, w, wmask, cols, cmask, C, PREV: tl.constexpr):
    """Rows w [R] of a sequence's conv window in fp32: its previous inputs (state rows 0..PREV-1), then its
    inputs (x from row `first_row`, rows `stride_x` apart); the result is [R, BLOCK_C]."""
    starts = tl.where(w < PREV, state + w * C, x + (first_row + w - PREV).to(tl.int64) * stride_x)
    return tl.load(starts[:, None] + cols[None, :], mask=wmask[:, None] & cmask[None, :], other=0.0).to(tl.float32)


MAX_BLOCK_T = 64  # a program's tokens of one sequence in `conv_update`
# Channels per program of `conv_update` (a verification's 4 tokens of 8,192 channels: 32 programs at 256). Module-level
# so `bench/step_ab.py` can compare them.
CONV_BLOCK_C = 256


@triton.jit
def _conv_update_kernel(
    x,
    slots,
    valid,
    states,
    weight,
    kept,
    out,
    T,
    C,
    stride_x,
    stride_out,
    KEPT_TOKENS,
    TAPS: tl.constexpr,
    PREV_PAD: tl.constexpr,
    BLOCK_T: tl.constexpr,
    BLOCK_C: tl.constexpr,
    KEEP: tl.constexpr,
    PDL: tl.constexpr,
):
    await_producer(PDL)
    # Window row w of sequence `seq` is state row w for w < TAPS-1, then input row seq*T + w - (TAPS-1);
    # token t reads window rows t..t+TAPS-1, and the window after it is rows t+1..t+TAPS-1. Only the
    # first token block (one, or BLOCK_T >= TAPS-1) reads state rows, so its program writes the new window.
    cols = tl.program_id(0) * BLOCK_C + tl.arange(0, BLOCK_C)
    seq = tl.program_id(1)
    t0 = tl.program_id(2) * BLOCK_T
    cmask = cols < C
    slot = tl.load(slots + seq).to(tl.int64)
    state = states + slot * (TAPS - 1) * C
    rows = tl.arange(0, PREV_PAD)
    tokens = t0 + tl.arange(0, BLOCK_T)
    tmask = tokens < T
    acc = tl.zeros([BLOCK_T, BLOCK_C], dtype=tl.float32)
    for i in tl.static_range(TAPS):
        win = _window(x, stride_x, state, seq * T, tokens + i, tmask, cols, cmask, C, TAPS - 1)
        acc += tl.load(weight + i * C + cols, mask=cmask, other=0.0).to(tl.float32)[None, :] * win
        if KEEP and i > 0:
            dst = kept + ((slot * KEPT_TOKENS + tokens[:, None]) * (TAPS - 1) + i - 1) * C + cols[None, :]
            tl.store(dst, win.to(kept.dtype.element_ty), mask=(tokens < T - 1)[:, None] & cmask[None, :])
    final = tl.zeros([PREV_PAD, BLOCK_C], dtype=tl.float32)
    if t0 == 0:  # the window after the last real token (padding rows after it are computed, not kept)
        n = tl.load(valid + seq).to(tl.int32)
        final = _window(x, stride_x, state, seq * T, n + rows, rows < TAPS - 1, cols, cmask, C, TAPS - 1)
    tl.debug_barrier()  # every thread has read its x rows and the old window: out may be x, the window is overwritten
    dst = out + (seq * T + tokens[:, None]).to(tl.int64) * stride_out + cols[None, :]
    tl.store(dst, (acc / (1.0 + tl.exp(-acc))).to(out.dtype.element_ty), mask=tmask[:, None] & cmask[None, :])
    if t0 == 0:
        rmask = (rows < TAPS - 1)[:, None] & cmask[None, :]
        tl.store(state + rows[:, None] * C + cols[None, :], final.to(states.dtype.element_ty), mask=rmask)


# One token per sequence: the conv runs in the epilogue of the product that computes its input
# (`conv_rows`, through `quant_linear.paired_gemv`). Module-level so benchmarks can compare the two.
CONV_IN_PRODUCT = True


@triton.jit
def conv_rows(y, toks, T, rows, row_mask, states, weight, slots, valid, C, TAPS: tl.constexpr, LOOP_T: tl.constexpr):
    """`conv_update` of one token per sequence, done by the product that computes its input: y [BLOCK_T,
    BLOCK_N] float32 holds token t's values of channels `rows` (a program's own rows: the conv is
    depthwise, so no other program reads or writes their windows); token t continues the window
    states[slots[t]] (advanced when valid[t] > 0). Channels below C become silu(conv), rounded to the
    states' dtype as `conv_update` stores them; the others pass."""
    conv = (rows < C) & row_mask
    xr = y.to(states.dtype.element_ty).to(tl.float32)  # the projection as the conv reads it
    for t in tl.static_range(LOOP_T):
        if t < T:
            window = states + tl.load(slots + t).to(tl.int64) * (TAPS - 1) * C + rows
            xt = tl.sum(tl.where(toks[:, None] == t, xr, 0.0), axis=0)
            acc = tl.zeros_like(xt)
            for i in tl.static_range(TAPS - 1):
                acc += tl.load(weight + i * C + rows, mask=conv, other=0.0).to(tl.float32) * tl.load(
                    window + i * C, mask=conv, other=0.0
                ).to(tl.float32)
            acc += tl.load(weight + (TAPS - 1) * C + rows, mask=conv, other=0.0).to(tl.float32) * xt
            act = (acc / (1.0 + tl.exp(-acc))).to(states.dtype.element_ty).to(tl.float32)
            y = tl.where((toks[:, None] == t) & conv[None, :], act[None, :], y)
            if tl.load(valid + t) > 0:  # the window after the token: rows 1.. of the old one, then the token
                for i in tl.static_range(TAPS - 2):
                    tl.store(window + i * C, tl.load(window + (i + 1) * C, mask=conv, other=0.0), mask=conv)
                tl.store(window + (TAPS - 2) * C, xt.to(states.dtype.element_ty), mask=conv)
    return y


def conv_update(
    x: torch.Tensor, conv_states: torch.Tensor, weight: torch.Tensor, slots: torch.Tensor, valid: torch.Tensor,
    tokens_per_sequence: int, kept: torch.Tensor | None, out: torch.Tensor | None = None,
) -> torch.Tensor:
    """silu(causal depthwise conv) of the B = len(slots) sequences of T tokens in x [N, C] with taps weight [W, C],
    sequence b continuing the window conv_states[slots[b]] of conv_states [slots, W-1, C], which is advanced in
    place over its first valid[b] tokens (the rest are padding: computed, not kept). A
    `kept` [slots, K, W-1, C] receives the window after each token but the last. x's rows may be strided (a
    column slice of a wider product): they are read in place. Returns `out` [N, C] (rows may be strided; x itself
    too: a sequence of up to MAX_BLOCK_T tokens is one program's, which reads its rows before it writes them),
    else a new contiguous tensor."""
    c = x.shape[1]
    if x.stride(1) != 1:
        x = x.contiguous()
    if out is not None and out.stride(1) != 1:
        raise ValueError("conv_update writes rows of contiguous columns")
    if out is not None and out.data_ptr() == x.data_ptr() and tokens_per_sequence > MAX_BLOCK_T:  # blocks read each other's rows
        return out.copy_(conv_update(x, conv_states, weight, slots, valid, tokens_per_sequence, kept))
    taps = weight.shape[0]
    if conv_states.shape[1:] != (taps - 1, c) or conv_states.dtype != x.dtype or not conv_states.is_contiguous():
        raise ValueError(f"conv states must be one contiguous {x.dtype} [slots, {taps - 1}, {c}] tensor")
    if kept is not None:
        _check_kept(kept, conv_states, tokens_per_sequence)
    out = torch.empty(x.shape, dtype=x.dtype, device=x.device) if out is None else out
    block_t = MAX_BLOCK_T if tokens_per_sequence > MAX_BLOCK_T else triton.next_power_of_2(tokens_per_sequence)  # blocks: >= TAPS-1 rows
    _conv_update_kernel[(triton.cdiv(c, CONV_BLOCK_C), slots.shape[0], triton.cdiv(tokens_per_sequence, block_t))](
        x, slots, valid, conv_states, weight.contiguous(), conv_states if kept is None else kept, out,
        tokens_per_sequence, c, x.stride(0), out.stride(0), 0 if kept is None else kept.shape[1],
        TAPS=taps, PREV_PAD=triton.next_power_of_2(taps - 1), BLOCK_T=block_t,
        BLOCK_C=CONV_BLOCK_C, KEEP=kept is not None, **launch_options(x.device),
    )
    return out


def fla_available() -> bool:
    """Whether flash-linear-attention's gated delta rule kernels can be imported."""
    try:
        import fla.ops.gated_delta_rule  # noqa: F401
    except ImportError:
        return False
    return True


_FLA_IMPORT: Future | None = None


def fla_import() -> Future:
    """`fla_available` in a background thread, started once per process: importing flash-linear-attention
    (every op it has, seconds) overlaps whatever the caller does next, such as loading a model."""
    global _FLA_IMPORT
    if _FLA_IMPORT is None:
        _FLA_IMPORT = future = Future()

        def run() -> None:
            try:
                future.set_result(fla_available())
            except BaseException as err:  # handed to whoever waits for the result
                future.set_exception(err)

        threading.Thread(target=run, name="fla-import", daemon=True).start()  # a daemon: an early exit does not wait for it
    return _FLA_IMPORT


def gdn_prefill(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor, state: torch.Tensor
) -> torch.Tensor:
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
