"""TritonBackend ops against ReferenceBackend on tiny odd shapes (interpreter on CPU, CUDA when present)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from kernels_support import DEVICE, needs_cuda, needs_triton_device
from ninfer_offload.artifact.codecs import encode_row_split
from ninfer_offload.artifact.formats import GROUPED_FORMATS
from ninfer_offload.artifact.records import ExpertRecordLayout
from ninfer_offload.model.backend import ReferenceBackend
from ninfer_offload.model.experts import ExpertBank
from ninfer_offload.model.quant import QuantizedMatrix
from ninfer_offload.runtime.step_inputs import step_inputs

pytestmark = needs_triton_device
REF = ReferenceBackend()


def _backend():
    from ninfer_offload.kernels.backend import TritonBackend

    return TritonBackend()


def _close(a: torch.Tensor, b: torch.Tensor, tol: float = 1e-5) -> bool:
    a, b = a.double().cpu(), b.double().cpu()
    return bool(torch.isfinite(a).all()) and float((a - b).norm() / b.norm().clamp_min(1e-30)) < tol


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def _skip_interpreter_tiled(tokens: int, dtype: torch.dtype, fmt: str, n: int) -> None:
    """Tokens of an n-row quantized product past the matrix-vector kernel's (`quant_linear.on_matrix_vector`) take
    the tiled kernels, whose bf16 tl.dot the interpreter gets wrong."""
    from ninfer_offload.kernels import quant_linear

    if not quant_linear.on_matrix_vector(n, tokens) and dtype == torch.bfloat16 and DEVICE.type == "cpu" and fmt != "dense":
        pytest.skip("the interpreter's bf16 tl.dot gives wrong tiled products; runs on CUDA")


def _weight(fmt: str, values: np.ndarray, dtype: torch.dtype):
    """values [n, k] as a `fmt` row-split matrix, or ("dense") as a `dtype` tensor."""
    if fmt == "dense":
        return torch.from_numpy(values).to(dtype)
    n, k = values.shape
    return QuantizedMatrix(GROUPED_FORMATS[fmt], n, k, torch.from_numpy(encode_row_split(values, fmt)))


@pytest.mark.parametrize("tokens", [1, 3, 8, 12])
def test_products_of_a_residual_norm_input(tokens):
    """A layer's first products on a `ResidualNorm`: the outputs, x + delta and the normed rows equal
    `add_rmsnorm` then the products (where the matrix-vector kernel runs it computes the norm itself; beyond,
    `resolve` does), and resolving it again computes nothing more."""
    from ninfer_offload.model.backend import ResidualNorm

    rng = np.random.default_rng(3)
    x, delta = torch.randn(tokens, 256, generator=_gen(2)), torch.randn(tokens, 256, generator=_gen(3))
    weight = torch.randn(256, generator=_gen(4)) * 0.1
    quantized = _weight("q8_g32_fp16", rng.standard_normal((40, 256)).astype(np.float32), torch.float32)
    dense = torch.randn(9, 256, generator=_gen(5))
    total, normed = REF.add_rmsnorm(x, delta, weight, 1e-6, offset=True)
    for op in ("linear", "pair"):
        inp = ResidualNorm(x.to(DEVICE), delta.to(DEVICE), weight.to(DEVICE), 1e-6)
        if op == "linear":
            outs, refs = (_backend().linear(inp, quantized.to(DEVICE)),), (REF.linear(normed, quantized),)
        else:
            outs, refs = _backend().linear_pair(inp, dense.to(DEVICE), quantized.to(DEVICE)), REF.linear_pair(normed, dense, quantized)
        assert all(_close(out, ref) for out, ref in zip(outs, refs))
        assert torch.equal(inp.total.cpu(), total) and _close(inp.normed, normed, 1e-6)
        kept = inp.normed
        assert _backend().resolve(inp) is kept


def test_linear_quantized_and_dense():
    rng = np.random.default_rng(0)
    x = torch.randn(2, 3, 300, generator=_gen(0))
    for fmt in GROUPED_FORMATS:
        w = QuantizedMatrix(
            GROUPED_FORMATS[fmt], 24, 300, torch.from_numpy(encode_row_split(rng.standard_normal((24, 300)).astype(np.float32), fmt))
        )
        out = _backend().linear(x.to(DEVICE), w.to(DEVICE))
        assert out.shape == (2, 3, 24) and _close(out, REF.linear(x, w))
    dense = torch.randn(24, 300, generator=_gen(1))
    assert _close(_backend().linear(x.to(DEVICE), dense.to(DEVICE)), REF.linear(x, dense))


@pytest.mark.parametrize("offset", [True, False])
def test_rmsnorm(offset):
    x, w = torch.randn(5, 96, generator=_gen(2)), torch.randn(96, generator=_gen(3)) * 0.1
    assert _close(_backend().rmsnorm(x.to(DEVICE), w.to(DEVICE), 1e-6, offset), REF.rmsnorm(x, w, 1e-6, offset))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_add_rmsnorm(dtype):
    x, delta = torch.randn(3, 2, 96, generator=_gen(20)).to(dtype), torch.randn(3, 2, 96, generator=_gen(21)).to(dtype)
    w = (torch.randn(96, generator=_gen(22)) * 0.1).to(dtype)
    total, normed = _backend().add_rmsnorm(x.to(DEVICE), delta.to(DEVICE), w.to(DEVICE), 1e-6, True)
    ref_total, ref_normed = REF.add_rmsnorm(x, delta, w, 1e-6, True)
    tol = 1e-6 if dtype == torch.float32 else 1e-2  # the interpreter rounds fp32 -> bf16 toward zero, CUDA to nearest
    assert _close(total, ref_total, tol) and _close(normed, ref_normed, 10 * tol)


# bf16: three roundings, which the interpreter does toward zero (CUDA: to nearest)
@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-6), (torch.bfloat16, 2e-2)])
def test_gated_rmsnorm(dtype, tol):
    """z read as the GDN layer leaves it: a column slice of a wider product, viewed as heads."""
    x, wide = torch.randn(3, 4, 40, generator=_gen(23)).to(dtype), torch.randn(3, 250, generator=_gen(24)).to(dtype)
    w = (1 + torch.randn(40, generator=_gen(25)) * 0.1).to(dtype)
    z = wide[:, 70:230].reshape(3, 4, 40)
    got = _backend().gated_rmsnorm(x.to(DEVICE), w.to(DEVICE), 1e-6, wide.to(DEVICE)[:, 70:230].reshape(3, 4, 40))
    assert got.dtype == dtype and _close(got, REF.gated_rmsnorm(x, w, 1e-6, z), tol)


def test_router_softmax_topk():
    """The logits read as the stacked router/score product leaves them: all columns but the last."""
    scored = torch.randn(4, 11, generator=_gen(4)).to(torch.bfloat16)
    logits = scored[:, :10]
    ids, weights = _backend().route(scored.to(DEVICE)[:, :10], 3, torch.bfloat16)
    ref_ids, ref_weights = REF.route(logits, 3, torch.bfloat16)
    assert torch.equal(ids.cpu(), ref_ids) and _close(weights, ref_weights, 8e-3)  # one bf16 rounding


def test_router_softmax_topk_model_shape():
    """256 experts, top 8, many rows: the same experts in the same order as the reference."""
    logits = torch.randn(64, 256, generator=_gen(5)) * 3
    ids, weights = _backend().route(logits.to(DEVICE), 8, torch.float32)
    ref_ids, ref_weights = REF.route(logits, 8, torch.float32)
    assert torch.equal(ids.cpu(), ref_ids) and _close(weights, ref_weights, 1e-6)


def test_routed_experts_through_bank_slots():
    hidden, inter = 136, 40
    layout = ExpertRecordLayout.create("q4_g64_fp16", "q5_g64_fp16", hidden, inter)
    rng = np.random.default_rng(6)
    records = np.zeros((3, layout.nbytes), dtype=np.uint8)  # 3 slots hold experts 4, 1, 2
    for slot in range(3):
        gu = encode_row_split(rng.standard_normal((2 * inter, hidden)).astype(np.float32) * 0.1, "q4_g64_fp16")
        dn = encode_row_split(rng.standard_normal((hidden, inter)).astype(np.float32) * 0.1, "q5_g64_fp16")
        records[slot, : gu.size] = gu
        records[slot, layout.down_offset : layout.down_offset + dn.size] = dn
    slots = torch.tensor([0, 1, 2, 0, 0])
    bank = ExpertBank(layout, torch.from_numpy(records).reshape(-1), slots * layout.nbytes)
    x = torch.randn(3, hidden, generator=_gen(7))
    ids = torch.tensor([[4, 1], [2, 4], [4, 1]])
    w = torch.softmax(torch.randn(3, 2, generator=_gen(8)), -1)
    device_bank = ExpertBank(layout, bank.arena.to(DEVICE), bank.offsets.to(DEVICE))
    out = _backend().routed_experts(x.to(DEVICE), ids.to(DEVICE), w.to(DEVICE), device_bank)
    assert _close(out, REF.routed_experts(x, ids, w, bank))


def test_routed_experts_split_equals_the_reference():
    """A prefill chunk's routed experts in two passes (a random set of experts after `wait`) against the
    reference, which waits and then runs the one-pass op; both call `wait` once."""
    hidden, inter, experts, tokens = 136, 40, 6, 100  # 300 pairs: the prefill tiles
    layout = ExpertRecordLayout.create("q4_g64_fp16", "q6_g64_fp16", hidden, inter)
    rng = np.random.default_rng(9)
    records = np.zeros((experts, layout.nbytes), dtype=np.uint8)
    for e in range(experts):
        gu = encode_row_split(rng.standard_normal((2 * inter, hidden)).astype(np.float32) * 0.1, "q4_g64_fp16")
        dn = encode_row_split(rng.standard_normal((hidden, inter)).astype(np.float32) * 0.1, "q6_g64_fp16")
        records[e, : gu.size] = gu
        records[e, layout.down_offset : layout.down_offset + dn.size] = dn
    bank = ExpertBank.of_records(layout, torch.from_numpy(records))
    x = torch.randn(tokens, hidden, generator=_gen(10))
    ids = torch.stack([torch.randperm(experts, generator=_gen(11 + t))[:3] for t in range(tokens)])
    w = torch.softmax(torch.randn(tokens, 3, generator=_gen(12)), -1)
    later = torch.rand(experts, generator=_gen(13)) < 0.5
    assert 0 < int(later.sum()) < experts
    waits = []
    device_bank = ExpertBank(layout, bank.arena.to(DEVICE), bank.offsets.to(DEVICE))
    args = (x.to(DEVICE), ids.to(DEVICE), w.to(DEVICE), device_bank, later.to(DEVICE))
    out = _backend().routed_experts_split(*args, lambda: waits.append(1))
    assert _close(out, REF.routed_experts_split(x, ids, w, bank, later, lambda: waits.append(2)))
    assert waits == [1, 2]


# Decode steps: B sequences of T tokens on slots 2, 0, 3 (in that order) of a pool of 4 sequences plus
# the scratch slot 4; the slots left out of a step must not change.
SEQUENCES = 4
SLOTS = [2, 0, 3]
STEPS = [(1, 1), (1, 3), (3, 1), (3, 3)]


def _step(slots: list[int], starts: list[int], tokens: int, capacity: int, keep: bool = False, prefill: bool = False):
    _, ctx = step_inputs([0] * len(slots) * tokens, slots, starts, tokens, capacity, DEVICE, prefill=prefill, keep_states=keep)
    return ctx


def _others(batch: int) -> list[int]:
    return [s for s in range(SEQUENCES + 1) if s not in SLOTS[:batch]]


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)])
@pytest.mark.parametrize("keep", [False, True])
@pytest.mark.parametrize("batch,tokens", STEPS)
def test_gdn_decode(batch, tokens, keep, dtype, tol):
    hk, hv, dk, dv, n = 2, 4, 24, 40, batch * tokens  # dims that are not powers of two
    gen = _gen(9)
    q, k = torch.randn(n, hk, dk, generator=gen).to(dtype), torch.randn(n, hk, dk, generator=gen).to(dtype)
    v = torch.randn(n, hv, dv, generator=gen).to(dtype)
    ab = (torch.randn(n, 2 * hv, generator=gen) * 4).to(dtype)  # a and b as the stacked product leaves them
    ab[0, 0] = 25.0  # above softplus' linear threshold
    a, b = ab[:, :hv], ab[:, hv:]
    a_log, dt_bias = torch.randn(hv, generator=gen), torch.randn(hv, generator=gen)
    states = torch.randn(SEQUENCES + 1, hv, dk, dv, generator=gen)
    kept = torch.randn(SEQUENCES + 1, 3, hv, dk, dv, generator=gen)
    ctx = _step(SLOTS[:batch], [7, 0, 12][:batch], tokens, 16, keep)
    ref_states, ref_kept = states.clone(), kept.clone()
    ref = REF.gdn_decode(q, k, v, a, b, a_log, dt_bias, ref_states, ctx, ref_kept)
    dev_states, dev_kept, dev_ab = states.to(DEVICE), kept.to(DEVICE), ab.to(DEVICE)
    out = _backend().gdn_decode(
        q.to(DEVICE), k.to(DEVICE), v.to(DEVICE), dev_ab[:, :hv], dev_ab[:, hv:], a_log.to(DEVICE), dt_bias.to(DEVICE),
        dev_states, ctx, dev_kept,
    )
    assert out.dtype == dtype and _close(out, ref, tol)
    assert _close(dev_states, ref_states, tol) and _close(dev_kept, ref_kept, tol)  # bf16: beta rounds to bf16 (one ulp apart)
    others = _others(batch)
    assert torch.equal(dev_states.cpu()[others], states[others]) and torch.equal(dev_kept.cpu()[others], kept[others])
    assert keep or torch.equal(dev_kept.cpu(), kept)


def _conv_case(n: int, c: int, dtype: torch.dtype, seed: int) -> tuple[torch.Tensor, ...]:
    gen = _gen(seed)
    x, weight = torch.randn(n, c, generator=gen).to(dtype), torch.randn(4, c, generator=gen).to(dtype)
    states, kept = torch.randn(SEQUENCES + 1, 3, c, generator=gen).to(dtype), torch.randn(SEQUENCES + 1, 3, 3, c, generator=gen).to(dtype)
    return x, weight, states, kept


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)])
@pytest.mark.parametrize("keep", [False, True])
@pytest.mark.parametrize("batch,tokens", STEPS)
def test_conv_update(batch, tokens, keep, dtype, tol):
    x, weight, states, kept = _conv_case(batch * tokens, 300, dtype, 15)  # two column blocks, the second partial
    ctx = _step(SLOTS[:batch], [7, 0, 1][:batch], tokens, 16, keep)
    ref_states, ref_kept = states.clone(), kept.clone()
    ref = REF.conv_update(x, ref_states, weight, ctx, ref_kept)
    dev_states, dev_kept = states.to(DEVICE), kept.to(DEVICE)
    out = _backend().conv_update(x.to(DEVICE), dev_states, weight.to(DEVICE), ctx, dev_kept)
    assert out.dtype == dtype and _close(out, ref, tol)
    assert torch.equal(dev_states.cpu(), ref_states) and torch.equal(dev_kept.cpu(), ref_kept)  # untouched slots included


def test_conv_update_reads_a_column_slice_in_place():
    """The conv input of a multi-token step is a column slice of the stacked GDN product (rows strided):
    the kernel reads it where it is and gives what it gives for a contiguous copy."""
    x, weight, states, kept = _conv_case(2 * 3, 300, torch.float32, 17)
    wide = torch.cat([torch.randn(6, 40, generator=_gen(18)), x, torch.randn(6, 24, generator=_gen(19))], dim=1).to(DEVICE)
    sliced = wide[:, 40 : 40 + 300]
    assert not sliced.is_contiguous()
    ctx = _step(SLOTS[:2], [7, 0], 3, 16, True)
    outs = []
    for rows in (sliced, x.to(DEVICE)):
        dev_states, dev_kept = states.clone().to(DEVICE), kept.clone().to(DEVICE)
        outs.append((_backend().conv_update(rows, dev_states, weight.to(DEVICE), ctx, dev_kept), dev_states, dev_kept))
    assert all(torch.equal(a, b) for a, b in zip(*outs))


@pytest.mark.parametrize("batch,tokens,keep,prefill", [(3, 1, False, False), (2, 4, True, False), (1, 300, False, True)])
def test_conv_update_writes_over_its_input(batch, tokens, keep, prefill):
    """The conv of a product's first columns written back over them (no copy launch): the rows, windows and
    kept windows equal the conv into a new tensor, the other columns untouched; a sequence of more tokens
    than one program holds (300) reads its input before any is overwritten."""
    x, weight, states, kept = _conv_case(batch * tokens, 300, torch.float32, 23)
    wide = torch.cat([x, torch.randn(batch * tokens, 24, generator=_gen(24))], dim=1).to(DEVICE)
    ctx = _step(SLOTS[:batch], [7, 0, 1][:batch], tokens, 512, keep, prefill)
    results = []
    for in_place in (False, True):
        y, dev_states, dev_kept = wide.clone(), states.clone().to(DEVICE), kept.clone().to(DEVICE)
        first = y[:, :300]
        out = _backend().conv_update(first, dev_states, weight.to(DEVICE), ctx, dev_kept, out=first if in_place else None)
        assert (out.data_ptr() == first.data_ptr()) == in_place
        results.append((out.clone(), y[:, 300:].clone(), dev_states, dev_kept))
    assert all(torch.equal(a, b) for a, b in zip(*results)) and torch.equal(results[1][1], wide[:, 300:])


def _padded_step(slot: int, start: int, tokens: int, valid: int, capacity: int):
    """The context of a captured prefill of `valid` real tokens padded to `tokens` rows."""
    from ninfer_offload.runtime.step_inputs import pack_inputs, unpack_inputs

    packed = pack_inputs([0] * tokens, [slot], [start], tokens, capacity, valid=[valid]).to(DEVICE)
    return unpack_inputs(packed, 1, tokens, prefill=False, keep_states=False, host=None)[1]


def test_padding_rows_leave_no_gdn_or_conv_state():
    """A short prefill run as a captured step of a longer bucket: the conv window and the delta-rule state
    after the step are those after the real tokens alone, their rows equal the unpadded step's, and the
    padding rows of the rule's output are zeros (finite inputs for the products after it)."""
    hk, hv, dk, dv, real, padded = 2, 4, 24, 40, 5, 8
    gen = _gen(21)
    q, k = torch.randn(padded, hk, dk, generator=gen), torch.randn(padded, hk, dk, generator=gen)
    v, ab = torch.randn(padded, hv, dv, generator=gen), torch.randn(padded, 2 * hv, generator=gen)
    a_log, dt_bias = torch.randn(hv, generator=gen), torch.randn(hv, generator=gen)
    states = torch.randn(SEQUENCES + 1, hv, dk, dv, generator=gen)
    x, weight, conv_states, _ = _conv_case(padded, 300, torch.float32, 22)
    exact = _step([2], [7], real, 16)
    ref_states, ref_conv = states.clone(), conv_states.clone()
    ref = REF.gdn_decode(q[:real], k[:real], v[:real], ab[:real, :hv], ab[:real, hv:], a_log, dt_bias, ref_states, exact, None)
    ref_x = REF.conv_update(x[:real], ref_conv, weight, exact, None)
    ctx = _padded_step(2, 7, padded, real, 16)
    dev_states, dev_conv, dev_ab = states.to(DEVICE), conv_states.to(DEVICE), ab.to(DEVICE)
    out = _backend().gdn_decode(
        q.to(DEVICE), k.to(DEVICE), v.to(DEVICE), dev_ab[:, :hv], dev_ab[:, hv:], a_log.to(DEVICE), dt_bias.to(DEVICE),
        dev_states, ctx, None,
    )
    out_x = _backend().conv_update(x.to(DEVICE), dev_conv, weight.to(DEVICE), ctx, None)
    assert _close(out[:real], ref) and _close(dev_states, ref_states) and not out[real:].any()
    assert _close(out_x[:real], ref_x) and torch.equal(dev_conv.cpu(), ref_conv)


@pytest.mark.parametrize("tokens", [2, 300])
def test_conv_update_prefill_chunk(tokens):
    x, weight, states, _ = _conv_case(tokens, 300, torch.float32, 16)
    ctx = _step([3], [40], tokens, 512, prefill=True)
    ref_states = states.clone()
    ref = REF.conv_update(x, ref_states, weight, ctx, None)
    dev_states = states.to(DEVICE)
    out = _backend().conv_update(x.to(DEVICE), dev_states, weight.to(DEVICE), ctx, None)
    assert _close(out, ref) and torch.equal(dev_states.cpu(), ref_states)


def _kv_pools(capacity: int, hkv: int, d: int, slots: list[int], lengths: list[int], gen: torch.Generator):
    """K and V pools of SEQUENCES slots plus 3 scratch rows, NaN except each slot's first `length` rows."""
    pools = []
    for _ in range(2):
        pool = torch.full((SEQUENCES * capacity + 3, hkv, d), float("nan"))
        for slot, length in zip(slots, lengths):
            pool[slot * capacity : slot * capacity + length] = torch.randn(length, hkv, d, generator=gen)
        pools.append(pool)
    return pools


def _check_attention_decode(batch, tokens, starts, capacity, q_dtype, kv_dtype, tol, budget_rows=0):
    hq, hkv, d = 8, 2, 48
    gen = _gen(18)
    slots, starts = SLOTS[:batch], starts[:batch]
    k_pool, v_pool = _kv_pools(capacity, hkv, d, slots, [s + tokens for s in starts], gen)
    q = torch.randn(batch * tokens, hq, d, generator=gen).to(q_dtype)
    ctx = _step(slots, starts, tokens, capacity)
    k_dev, v_dev = k_pool.to(DEVICE).to(kv_dtype), v_pool.to(DEVICE).to(kv_dtype)
    ref = REF.attention_decode(q, k_dev.cpu().to(q_dtype), v_dev.cpu().to(q_dtype), ctx, capacity)
    backend = _backend()
    out = backend.attention_decode(q.to(DEVICE), k_dev, v_dev, ctx, capacity, budget_rows)
    assert out.dtype == q_dtype and _close(out, ref, tol)
    if batch > 1:  # a sequence's result does not depend on the others in its step
        one = backend.attention_decode(
            q[tokens : 2 * tokens].to(DEVICE), k_dev, v_dev, _step(slots[1:2], starts[1:2], tokens, capacity), capacity, budget_rows
        )
        assert torch.equal(one, out[tokens : 2 * tokens])


# capacity 300: two spans of 256; the first sequence's tokens end at and past the span boundary, the
# second's reach one span (the merge must not read the unwritten partial of the other).
# bf16 on CUDA only: the interpreter's bf16 tl.dot returns garbage (Triton 3.9).
@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), pytest.param(torch.bfloat16, 2e-2, marks=needs_cuda)])
@pytest.mark.parametrize("batch,tokens", STEPS)
def test_attention_decode(batch, tokens, dtype, tol):
    _check_attention_decode(batch, tokens, [255, 0, 296], 300, dtype, dtype, tol)


def test_attention_decode_spans_grow_within_the_partial_budget(monkeypatch):
    """Where a capacity's spans would hold more partial softmaxes than the budget for the engine's most
    rows, each span covers more rows: the result is still the reference's, and a sequence gets the same
    result alone as in its batch (both launches size their spans for the same rows)."""
    from ninfer_offload.kernels import attention
    from ninfer_offload.planner import memory

    assert memory.DECODE_PARTIAL_BYTES == attention.DECODE_PARTIAL_BYTES  # the planner counts what the kernel holds
    rows, per_span = 9, 9 * 8 * (48 + 2) * 4  # 3 sequences x 3 tokens, 8 query heads of 48
    monkeypatch.setattr(attention, "DECODE_PARTIAL_BYTES", 2 * per_span)
    assert attention.decode_span(1000, per_span) == 512 and attention.decode_span(300, per_span) == 256
    _check_attention_decode(3, 3, [700, 0, 296], 1000, torch.float32, torch.float32, 1e-5, budget_rows=rows)


def test_attention_decode_launch_shapes(monkeypatch):
    """Other K/V tile rows, warps, and a merge split over the head dimensions (48 in programs of 16) give the
    reference's result."""
    from ninfer_offload.kernels import attention

    for name, value in (("DECODE_BLOCK_S", 32), ("DECODE_WARPS", 8), ("MERGE_DIMS", 16)):
        monkeypatch.setattr(attention, name, value)
    _check_attention_decode(3, 2, [255, 0, 296], 300, torch.float32, torch.float32, 1e-5)


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("kv_dtype,tol", [(torch.bfloat16, 2e-2), (torch.float8_e4m3fn, 2e-2)])
@pytest.mark.parametrize("batch,tokens", STEPS)
def test_attention_decode_long_and_fp8_cache(batch, tokens, kv_dtype, tol):
    _check_attention_decode(batch, tokens, [4500, 0, 1021], 4700, torch.bfloat16, kv_dtype, tol)


def test_attention_prefill_sdpa():
    hq, hkv, d = 4, 2, 32
    kc, vc = torch.randn(20, hkv, d, generator=_gen(21)), torch.randn(20, hkv, d, generator=_gen(22))
    for start, t in ((0, 7), (5, 6)):
        q = torch.randn(t, hq, d, generator=_gen(23))
        out = _backend().attention_prefill(q.to(DEVICE), kc.to(DEVICE), vc.to(DEVICE), start)
        assert _close(out, REF.attention_prefill(q, kc, vc, start))


@pytest.mark.gpu
@needs_cuda
def test_attention_prefill_takes_flash_attention_at_full_size():
    """A prefill chunk at the model's attention shape (16 query heads over 2 KV heads of 256, bf16) runs flash
    attention, first chunk and later chunk alike: no cuDNN kernel (a plan built per new length), no math
    backend (the whole score matrix), and the reference's result."""
    from torch.profiler import ProfilerActivity, profile

    kc = torch.randn(300, 2, 256, device="cuda", dtype=torch.bfloat16)
    vc = torch.randn(300, 2, 256, device="cuda", dtype=torch.bfloat16)
    for start, t in ((0, 37), (200, 61)):
        q = torch.randn(t, 16, 256, device="cuda", dtype=torch.bfloat16)
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            out = _backend().attention_prefill(q, kc, vc, start)
            torch.cuda.synchronize()
        names = [event.key.lower() for event in prof.key_averages()]
        assert any("flash" in name for name in names) and not any("cudnn" in name for name in names), names
        ref = REF.attention_prefill(q.float(), kc.float(), vc.float(), start)
        assert _close(out.float(), ref, 2e-2)


@pytest.mark.gpu
@needs_cuda
def test_gdn_prefill_through_flash_linear_attention():
    from ninfer_offload.kernels import gdn

    if not gdn.fla_available():
        pytest.skip("flash-linear-attention is not installed")
    t, hk, hv, dk, dv = 200, 2, 4, 128, 128
    gen = _gen(30)
    q, k = torch.randn(t, hk, dk, generator=gen), torch.randn(t, hk, dk, generator=gen)
    v = torch.randn(t, hv, dv, generator=gen)
    g, beta = -torch.rand(t, hv, generator=gen) * 0.5, torch.rand(t, hv, generator=gen)
    state = torch.randn(hv, dk, dv, generator=gen) * 0.1
    ref_state = state.clone()
    ref = REF.gdn_prefill(q, k, v, g, beta, ref_state)
    dev_state = state.cuda()
    out = _backend().gdn_prefill(*(x.cuda().to(torch.bfloat16) for x in (q, k, v)), g.cuda(), beta.cuda().to(torch.bfloat16), dev_state)
    assert _close(out, ref, tol=3e-2) and _close(dev_state, ref_state, tol=3e-2)


def test_unsupported_gpu_is_a_one_line_error(monkeypatch):
    from ninfer_offload.errors import NinferError
    from ninfer_offload.kernels.backend import TritonBackend

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (7, 5))
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "Tesla T4")
    with pytest.raises(NinferError, match=r"Tesla T4 \(compute capability 7.5\) is not supported.*--device cpu"):
        TritonBackend()


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-6), (torch.bfloat16, 1e-2)])
def test_gdn_gating(dtype, tol):
    a, b = (torch.randn(3, 6, generator=_gen(30)) * 8).to(dtype), (torch.randn(3, 6, generator=_gen(31)) * 4).to(dtype)
    a[0, 0], a[0, 1] = 25.0, -30.0  # both sides of softplus' linear threshold
    a_log, dt_bias = torch.randn(6, generator=_gen(32)), torch.randn(6, generator=_gen(33))
    g, beta = _backend().gdn_gating(*(t.to(DEVICE) for t in (a, b, a_log, dt_bias)))
    ref_g, ref_beta = REF.gdn_gating(a, b, a_log, dt_bias)
    assert g.dtype == torch.float32 and beta.dtype == dtype
    assert _close(g, ref_g, 1e-6) and _close(beta, ref_beta, tol)


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-6), (torch.bfloat16, 2e-2)])
@pytest.mark.parametrize("tokens", [1, 3, 8, 12])  # the norm inside the matrix-vector kernel's input (small products: up to 4 tokens)
@pytest.mark.parametrize("fmt", ["q8_g32_fp16", "q5_g64_fp16", "dense"])
def test_gated_norm_linear(dtype, tol, tokens, fmt):
    """GDN's output: per-head RMSNorm of x times silu(z), flattened, @ w^T, with z a slice of a wider product."""
    heads, d, n = 8, 32, 40
    _skip_interpreter_tiled(tokens, dtype, fmt, n)
    w = _weight(fmt, np.random.default_rng(tokens).standard_normal((n, heads * d)).astype(np.float32) * 0.1, dtype)
    x = (torch.randn(tokens, heads, d, generator=_gen(45)) * 2).to(dtype)
    wide = torch.randn(tokens, 2 * heads * d, generator=_gen(46)).to(dtype)
    norm_w = (torch.rand(d, generator=_gen(47)) + 0.5).to(dtype)
    dev = wide.to(DEVICE)
    got = _backend().gated_norm_linear(
        x.to(DEVICE), dev[:, heads * d :].reshape(tokens, heads, d), norm_w.to(DEVICE), 1e-6, w.to(DEVICE)
    )
    want = REF.gated_norm_linear(x, wide[:, heads * d :].reshape(tokens, heads, d), norm_w, 1e-6, w)
    assert got.dtype == dtype and _close(got, want, tol)


# bf16: torch's CPU sigmoid in bf16 is sometimes one ulp off the float32 value rounded, as the kernels round it
@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-6), (torch.bfloat16, 2e-2)])
@pytest.mark.parametrize("tokens", [1, 3, 8, 12])  # the gate inside the matrix-vector kernel's input (small products: up to 4 tokens)
@pytest.mark.parametrize("fmt", ["q8_g32_fp16", "q6_g64_fp16", "dense"])
def test_gated_linear(dtype, tol, tokens, fmt):
    """(x * sigmoid(gate)) @ w^T with the gate a column slice of a wider product (the attention output gate)."""
    n, k = 40, 300
    _skip_interpreter_tiled(tokens, dtype, fmt, n)
    w = _weight(fmt, np.random.default_rng(tokens).standard_normal((n, k)).astype(np.float32) * 0.1, dtype)
    x = torch.randn(tokens, k, generator=_gen(40)).to(dtype)
    wide = (torch.randn(tokens, 3 * k, generator=_gen(41)) * 3).to(dtype)
    got = _backend().gated_linear(x.to(DEVICE), wide.to(DEVICE)[:, k : 2 * k], w.to(DEVICE))
    want = REF.gated_linear(x, wide[:, k : 2 * k], w)
    assert got.dtype == dtype and _close(got, want, tol)


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-6), (torch.bfloat16, 2e-2)])  # bf16: three roundings (1.1 % seen)
@pytest.mark.parametrize("tokens", [1, 3, 8, 12])  # one matrix-vector kernel (small products: up to 4 tokens), three launches above
@pytest.mark.parametrize("fmt", ["q8_g32_fp16", "q5_g64_fp16", "dense"])
def test_shared_expert(dtype, tol, tokens, fmt):
    """routed + sigmoid(score) * swiglu(gate, up) @ down^T, with gate/up and score read as the stacked
    products leave them (column slices of one buffer)."""
    hidden, width = 40, 300
    _skip_interpreter_tiled(tokens, dtype, fmt, hidden)
    down = _weight(fmt, np.random.default_rng(tokens).standard_normal((hidden, width)).astype(np.float32) * 0.1, dtype)
    gate_up = torch.randn(tokens, 2 * width, generator=_gen(34)).to(dtype)
    gate, up = gate_up[:, :width], gate_up[:, width:]
    routed = torch.randn(tokens, hidden, generator=_gen(36)).to(dtype)
    score = (torch.randn(tokens, 5, generator=_gen(38)) * 3).to(dtype)[:, 2:3]
    on_device = down.to(DEVICE)
    stacked = gate_up.to(DEVICE)
    got = _backend().shared_expert(stacked[:, :width], stacked[:, width:], on_device, routed.to(DEVICE), score.to(DEVICE))
    want = REF.shared_expert(gate, up, down, routed, score)
    assert got.dtype == dtype and _close(got, want, tol)


@pytest.mark.parametrize(
    "dtype,kv_dtype", [(torch.float32, torch.float32), (torch.bfloat16, torch.bfloat16), (torch.bfloat16, torch.float8_e4m3fn)]
)
@pytest.mark.parametrize("tokens", [1, 5])
def test_attention_inputs(dtype, kv_dtype, tokens):
    """q and k normed and rotated, k and v written to their KV rows (the others untouched), from column
    slices of one stacked product; one launch where the pools hold the activations' dtype."""
    from ninfer_offload.model.attention import Rotary

    hq, hkv, d, rows = 4, 2, 24, 16
    wide = torch.randn(tokens, (hq + 2 * hkv) * d + 8, generator=_gen(42)).to(dtype)
    q = wide[:, : hq * d].reshape(tokens, hq, d)
    k = wide[:, hq * d : (hq + hkv) * d].reshape(tokens, hkv, d)
    v = wide[:, (hq + hkv) * d : (hq + 2 * hkv) * d].reshape(tokens, hkv, d)
    q_norm, k_norm = (torch.randn(2, d, generator=_gen(43)) * 0.1).to(dtype)
    positions = torch.tensor([3, 4, 5, 900, 30001][:tokens])
    kv_rows = torch.tensor([9, 2, 14, 0, 7][:tokens])
    pools = [torch.randn(rows, hkv, d, generator=_gen(44 + i)).to(kv_dtype) for i in range(2)]
    ref_pools = [p.clone() for p in pools]
    want = REF.attention_inputs(q, k, v, q_norm, k_norm, 1e-6, Rotary(12, 1e7, torch.device("cpu")), positions, *ref_pools, kv_rows)
    dev_pools = [p.to(DEVICE) for p in pools]
    dev = wide.to(DEVICE)
    got = _backend().attention_inputs(
        dev[:, : hq * d].reshape(tokens, hq, d), dev[:, hq * d : (hq + hkv) * d].reshape(tokens, hkv, d),
        dev[:, (hq + hkv) * d : (hq + 2 * hkv) * d].reshape(tokens, hkv, d), q_norm.to(DEVICE), k_norm.to(DEVICE), 1e-6,
        Rotary(12, 1e7, DEVICE), positions.to(DEVICE), *dev_pools, kv_rows.to(DEVICE),
    )
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    assert _close(got, want, tol)
    for got_pool, want_pool in zip(dev_pools, ref_pools):
        assert _close(got_pool.float(), want_pool.float(), tol)
        untouched = [r for r in range(rows) if r not in kv_rows.tolist()]
        assert torch.equal(got_pool.cpu()[untouched].float(), want_pool[untouched].float())


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)])
@pytest.mark.parametrize("heads,dim,rotated", [(4, 32, 8), (2, 24, 12), (3, 16, 16)])
def test_qk_norm_rotary(dtype, tol, heads, dim, rotated):
    from ninfer_offload.model.attention import Rotary

    x = torch.randn(3, heads, dim, generator=_gen(39)).to(dtype)
    w = (torch.randn(dim, generator=_gen(40)) * 0.1).to(dtype)
    positions = torch.tensor([0, 7, 30001])
    ref = REF.qk_norm_rotary(x, w, 1e-6, Rotary(rotated, 1e7, torch.device("cpu")), positions)
    got = _backend().qk_norm_rotary(x.to(DEVICE), w.to(DEVICE), 1e-6, Rotary(rotated, 1e7, DEVICE), positions.to(DEVICE))
    assert got.shape == ref.shape and _close(got, ref, tol)
