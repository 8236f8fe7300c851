"""Attention over the KV cache: split-sequence decode kernel (bf16 or fp8 cache) and SDPA prefill.

Reference ops: `ReferenceBackend.attention_decode` / `attention_prefill` (causal GQA, scale
D^-1/2, fp32 softmax). Decode takes B sequences of T new tokens each in one launch: each
sequence's rows of the flat KV pools start at its slot (a device tensor) times the capacity, and
token t of a sequence sees its first lengths[b] - (T-1-t) rows. The kernel splits those rows across
programs (one program per KV head, span and token row, all of the head's query heads at once with
`tl.dot`), each writing a partial softmax (max, sum, weighted values) that a fixed-order merge
kernel combines over the spans the token's length reaches. Every span of the capacity is launched
and spans past a token's length exit at once without writing, so the launch shape is fixed (graph
capture) while the sequences grow, and neither kernel's work grows with the capacity. An fp8 (e4m3) cache
is widened in registers.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
import triton
import triton.language as tl
from torch.nn.attention import SDPBackend, sdpa_kernel

from ninfer_offload.kernels import fitting
from ninfer_offload.kernels.launch import await_producer, launch_options

# Cached positions per program in decode: fewer make more partial softmaxes to merge; 256 was the fastest
# at long contexts and close to the fastest at 1K cached rows (docs/performance.md, Kernels).
SPAN = 256
# Bytes of partial softmaxes (fp32 max, sum and weighted values per token row, query head and span) a
# decode launch may hold: where a sequence's capacity in SPAN-row spans would exceed it, the spans grow
# (powers of two) instead. 32 rows (a captured prompt chunk, 8 sequences verifying 3 drafts) keep one
# span per SPAN rows up to a 38K capacity; at a 256K capacity they take 2,048-row spans (68 MB of partials
# instead of 0.54 GB). The planner counts this much workspace
# (`planner.memory.DECODE_PARTIAL_BYTES`, the same number).
DECODE_PARTIAL_BYTES = 80 << 20
# Spans the merge combines per step, and head dimensions per merge program (a head's dimensions in
# ceil(D / MERGE_DIMS) programs: more programs read a long context's partials in parallel). 64 dimensions per
# program beat a program per head at every length swept (docs/performance.md, Kernels).
MERGE_BLOCK = 16
MERGE_DIMS = 64
# Cached rows per K/V tile of the decode kernel and its warps (the best of the same sweep). Module-level so
# benchmarks can sweep them.
DECODE_BLOCK_S = 64
DECODE_WARPS = 4
# Pipeline stages of the decode kernel's K/V tile loads (Triton's default depth; 138 KB of shared memory for bf16
# tiles of 64 rows x 256 dims; where the device has less, as the sm_120 cards, `fitting.launch` takes fewer).
DECODE_STAGES = 3
# SDPA backends a prefill may take: not cuDNN's, which torch prefers on Hopper and which builds an
# execution plan for every new shape (reported at 0.1-0.4 s per first call), so that every new prompt or
# chunk length would pay it; flash attention needs no plan. The math backend is the fallback elsewhere (CPU).
PREFILL_BACKENDS = [SDPBackend.FLASH_ATTENTION, SDPBackend.MATH]


@triton.jit(do_not_specialize=["span"])
def _decode_partial_kernel(
    q,
    k_pool,
    v_pool,
    slots,
    lengths,
    part_out,
    part_max,
    part_sum,
    scale,
    stride_kv,
    capacity,
    T,
    span,
    HQ: tl.constexpr,
    HKV: tl.constexpr,
    D: tl.constexpr,
    D_PAD: tl.constexpr,
    GROUP_PAD: tl.constexpr,
    BLOCK_S: tl.constexpr,
    IEEE: tl.constexpr,
    PDL: tl.constexpr,
):
    await_producer(PDL)
    hkv = tl.program_id(0)
    split = tl.program_id(1)
    row = tl.program_id(2)
    nsplit = tl.num_programs(1)
    group: tl.constexpr = HQ // HKV
    seq = row // T
    length = (tl.load(lengths + seq) - (T - 1 - row % T)).to(tl.int32)  # rows this token sees (itself included)
    first = tl.load(slots + seq).to(tl.int64) * capacity * stride_kv  # offset of the sequence's first pool row
    k_rows = k_pool + first
    v_rows = v_pool + first
    heads = tl.arange(0, GROUP_PAD)
    head_mask = heads < group
    dims = tl.arange(0, D_PAD)
    dmask = dims < D
    qrows = row * HQ + hkv * group + heads
    qt = tl.load(q + qrows[:, None] * D + dims[None, :], mask=head_mask[:, None] & dmask[None, :], other=0.0)
    m = tl.full([GROUP_PAD], float("-inf"), dtype=tl.float32)
    l = tl.zeros([GROUP_PAD], dtype=tl.float32)
    acc = tl.zeros([GROUP_PAD, D_PAD], dtype=tl.float32)
    start = split * span
    for s0 in range(start, tl.minimum(start + span, length), BLOCK_S):
        pos = s0 + tl.arange(0, BLOCK_S)
        pmask = pos < length
        off = pos[:, None].to(tl.int64) * stride_kv + hkv * D + dims[None, :]
        kt = tl.load(k_rows + off, mask=pmask[:, None] & dmask[None, :], other=0.0).to(qt.dtype)
        vt = tl.load(v_rows + off, mask=pmask[:, None] & dmask[None, :], other=0.0).to(qt.dtype)
        if IEEE:
            scores = tl.dot(qt, tl.trans(kt), input_precision="ieee") * scale
        else:
            scores = tl.dot(qt, tl.trans(kt)).to(tl.float32) * scale
        scores = tl.where(pmask[None, :], scores, float("-inf"))
        m_new = tl.maximum(m, tl.max(scores, axis=1))
        alpha = tl.exp(m - m_new)
        p = tl.exp(scores - m_new[:, None])
        l = l * alpha + tl.sum(p, axis=1)
        if IEEE:
            acc = acc * alpha[:, None] + tl.dot(p, vt, input_precision="ieee")
        else:
            acc = acc * alpha[:, None] + tl.dot(p.to(vt.dtype), vt).to(tl.float32)
        m = m_new
    base = qrows.to(tl.int64) * nsplit + split
    used = head_mask & (heads * 0 + start < length)  # spans past the token's length are never merged: nothing to store
    tl.store(part_max + base, m, mask=used)
    tl.store(part_sum + base, l, mask=used)
    tl.store(part_out + base[:, None] * D + dims[None, :], acc, mask=used[:, None] & dmask[None, :])


@triton.jit(do_not_specialize=["NSPLIT", "span"])  # a batched prefill's rows change both: no new compile
def _decode_merge_kernel(
    part_out, part_max, part_sum, lengths, out, NSPLIT, T, span,
    HQ: tl.constexpr, D: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_SPLIT: tl.constexpr, PDL: tl.constexpr,
):
    await_producer(PDL)
    # One (token row, query head, BLOCK_D dimensions): the partial softmaxes of the spans its length reaches,
    # combined in a fixed order (the first span of a token always holds its own row; later ones may be empty lanes).
    h = tl.program_id(0).to(tl.int64)
    row = h // HQ
    length = tl.load(lengths + row // T) - (T - 1 - row % T)
    spans = tl.minimum(tl.cdiv(length, span), NSPLIT)
    dims = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)
    dmask = dims < D
    top = tl.full([BLOCK_SPLIT], float("-inf"), dtype=tl.float32)
    for s0 in range(0, spans, BLOCK_SPLIT):
        splits = s0 + tl.arange(0, BLOCK_SPLIT)
        top = tl.maximum(top, tl.load(part_max + h * NSPLIT + splits, mask=splits < spans, other=float("-inf")))
    m = tl.max(top)
    total = tl.zeros([BLOCK_SPLIT], dtype=tl.float32)
    acc = tl.zeros([BLOCK_SPLIT, BLOCK_D], dtype=tl.float32)
    for s0 in range(0, spans, BLOCK_SPLIT):
        splits = s0 + tl.arange(0, BLOCK_SPLIT)
        smask = splits < spans
        weight = tl.exp(tl.load(part_max + h * NSPLIT + splits, mask=smask, other=float("-inf")) - m)
        total += tl.load(part_sum + h * NSPLIT + splits, mask=smask, other=0.0) * weight
        rows = tl.load(part_out + (h * NSPLIT + splits)[:, None] * D + dims[None, :], mask=smask[:, None] & dmask[None, :], other=0.0)
        acc += rows * weight[:, None]
    result = tl.sum(acc, axis=0) / tl.sum(total)
    tl.store(out + h * D + dims, result.to(out.dtype.element_ty), mask=dmask)


def decode_span(capacity: int, bytes_per_span: int) -> int:
    """Cached rows per decode program: SPAN, or the smallest larger power of two that keeps the partial
    softmaxes of a capacity's spans (`bytes_per_span` each) within DECODE_PARTIAL_BYTES."""
    span = SPAN
    while span < capacity and triton.cdiv(capacity, span) * bytes_per_span > DECODE_PARTIAL_BYTES:
        span *= 2
    return span


def attention_decode(
    q: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor, slots: torch.Tensor, lengths: torch.Tensor,
    tokens_per_sequence: int, capacity: int, budget_rows: int = 0,
) -> torch.Tensor:
    """The B = len(slots) sequences of T new tokens q [N, Hq, D] over their slots' rows of the flat pools
    k_pool/v_pool [rows, Hkv, D] (slot s owns rows [s * capacity, (s + 1) * capacity)); token t of
    sequence b sees its first lengths[b] - (T-1-t) rows. The span length keeps the partial softmaxes of
    max(N, budget_rows) rows within DECODE_PARTIAL_BYTES: an engine passes the most rows any of its
    steps attends with, so every launch splits alike and a token's result does not depend on its
    step's other rows. Returns [N, Hq, D]."""
    n, hq, d = q.shape
    hkv = k_pool.shape[1]
    span = decode_span(capacity, max(n, budget_rows) * hq * (d + 2) * 4)
    nsplit = max(1, triton.cdiv(capacity, span))
    part_out = torch.empty(n, hq, nsplit, d, dtype=torch.float32, device=q.device)
    part_max = torch.empty(n, hq, nsplit, dtype=torch.float32, device=q.device)
    part_sum = torch.empty(n, hq, nsplit, dtype=torch.float32, device=q.device)
    fitting.launch(
        _decode_partial_kernel, (hkv, nsplit, n),
        q.contiguous(), k_pool, v_pool, slots, lengths, part_out, part_max, part_sum, d**-0.5, k_pool.stride(0), capacity,
        tokens_per_sequence, span, HQ=hq, HKV=hkv, D=d, D_PAD=triton.next_power_of_2(d),
        GROUP_PAD=max(16, triton.next_power_of_2(hq // hkv)), BLOCK_S=DECODE_BLOCK_S, IEEE=q.dtype == torch.float32,
        num_stages=DECODE_STAGES, num_warps=DECODE_WARPS, **launch_options(q.device),
    )
    out = torch.empty(n, hq, d, dtype=q.dtype, device=q.device)
    block_d = min(MERGE_DIMS, triton.next_power_of_2(d))
    _decode_merge_kernel[(n * hq, triton.cdiv(d, block_d))](
        part_out, part_max, part_sum, lengths, out, nsplit, tokens_per_sequence, span,
        HQ=hq, D=d, BLOCK_D=block_d, BLOCK_SPLIT=MERGE_BLOCK, **launch_options(q.device),
    )
    return out


def attention_prefill(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, start: int) -> torch.Tensor:
    """Causal GQA of q [T, Hq, D] (positions start..start+T-1) over cache rows [0, start+T) via torch SDPA
    (flash attention, `PREFILL_BACKENDS`).

    A first chunk (start 0) is plain causal attention; a later one masks with the lower-right causal bias,
    which SDPA hands to flash attention with the K/V heads shared natively (an explicit mask with
    `enable_gqa` would take its unfused math backend: K/V repeated, the full score matrix in fp32). The
    bias is imported here, when first needed: its module imports torch's compiler stack (1.7 s)."""
    t = q.shape[0]
    keys = k_cache[: start + t].to(q.dtype).transpose(0, 1)  # [Hkv, S, D]
    values = v_cache[: start + t].to(q.dtype).transpose(0, 1)
    causal = {"is_causal": True}
    if start:
        from torch.nn.attention.bias import causal_lower_right

        causal = {"attn_mask": causal_lower_right(t, start + t)}
    with sdpa_kernel(PREFILL_BACKENDS):
        out = F.scaled_dot_product_attention(
            q.transpose(0, 1).unsqueeze(0), keys.unsqueeze(0), values.unsqueeze(0), **causal, enable_gqa=True,
        )
    return out.squeeze(0).transpose(0, 1)
