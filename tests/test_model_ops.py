"""Reference ops on their own: torch row-split decode vs the numpy codecs, expert records, the
delta rule (chunked vs recurrent vs transformers), the causal conv window, attention with a cache."""

from __future__ import annotations

import numpy as np
import pytest
import tiny_hf
import torch
import torch.nn.functional as F

from ninfer_offload.artifact.codecs import decode_row_split_values, encode_row_split
from ninfer_offload.artifact.formats import GROUPED_FORMATS, grouped_format
from ninfer_offload.artifact.records import DenseRecordLayout, ExpertRecordLayout
from ninfer_offload.model.backend import ReferenceBackend
from ninfer_offload.model.experts import ExpertBank, record_weights
from ninfer_offload.model.quant import QuantizedMatrix, dequantize_objects
from ninfer_offload.runtime.step_inputs import step_inputs

backend = ReferenceBackend()
rng = np.random.default_rng(0)


@pytest.mark.parametrize("fmt", sorted(GROUPED_FORMATS))
@pytest.mark.parametrize("shape", [(3, 130), (5, 64), (4, 256), (2, 200)])
def test_quantized_matrix_decodes_like_codecs(fmt, shape):
    values = rng.standard_normal(shape).astype(np.float32)
    encoded = encode_row_split(values, fmt)
    expected = decode_row_split_values(encoded, fmt, *shape)
    matrix = QuantizedMatrix(grouped_format(fmt), *shape, torch.from_numpy(encoded))
    assert np.array_equal(matrix.dequantize().numpy(), expected)
    rows = torch.tensor([shape[0] - 1, 0, shape[0] - 1])
    assert np.array_equal(matrix.dequantize_rows(rows).numpy(), expected[rows.numpy()])
    stacked = torch.stack([torch.from_numpy(encoded)] * 2)
    assert np.array_equal(dequantize_objects(stacked, matrix.geometry, torch.float32)[1].numpy(), expected)
    x = torch.randn(2, shape[1])
    assert torch.allclose(backend.linear(x, matrix), x @ torch.from_numpy(expected).T, atol=1e-5)


def test_quantized_matrix_rejects_wrong_size():
    with pytest.raises(ValueError):
        QuantizedMatrix(grouped_format("q4_g64_fp16"), 2, 64, torch.zeros(10, dtype=torch.uint8))


def _banks(hidden: int, inter: int, experts: int):
    gate_up = rng.standard_normal((experts * 2 * inter, hidden)).astype(np.float32)
    down = rng.standard_normal((experts * hidden, inter)).astype(np.float32)
    return gate_up, down


def test_quantized_records_decode_to_their_bank_rows():
    hidden, inter, experts = 128, 64, 3
    gate_up, down = _banks(hidden, inter, experts)
    gu_bytes, dn_bytes = encode_row_split(gate_up, "q4_g64_fp16"), encode_row_split(down, "q6_g64_fp16")
    layout = ExpertRecordLayout.create("q4_g64_fp16", "q6_g64_fp16", hidden, inter)
    records = torch.from_numpy(np.stack([layout.pack(gu_bytes, dn_bytes, experts, e) for e in range(experts)]))
    gu, dn = record_weights(records, layout, torch.float32)
    ref_gu = decode_row_split_values(gu_bytes, "q4_g64_fp16", *gate_up.shape).reshape(experts, 2 * inter, hidden)
    ref_dn = decode_row_split_values(dn_bytes, "q6_g64_fp16", *down.shape).reshape(experts, hidden, inter)
    assert np.array_equal(gu.numpy(), ref_gu) and np.array_equal(dn.numpy(), ref_dn)


def test_routed_experts_matches_per_expert_math():
    hidden, inter, experts = 32, 16, 4
    gate_up, down = _banks(hidden, inter, experts)
    layout = DenseRecordLayout("fp32", hidden, inter)
    gu_bytes, dn_bytes = gate_up.view(np.uint8).reshape(-1), down.view(np.uint8).reshape(-1)
    records = torch.from_numpy(np.stack([layout.pack(gu_bytes, dn_bytes, experts, e) for e in range(experts)]))
    x = torch.randn(5, hidden)
    ids = torch.tensor([[0, 3], [1, 3], [2, 0], [3, 1], [2, 2]])
    weights = torch.rand(5, 2)
    # records in a shuffled slot order, reached through the offset table
    order = torch.tensor([2, 0, 3, 1])
    slots = torch.empty(experts, dtype=torch.long)
    slots[order] = torch.arange(experts)
    out = backend.routed_experts(x, ids, weights, ExpertBank(layout, records[order].reshape(-1), slots * layout.nbytes))
    gu, dn = torch.from_numpy(gate_up).view(experts, 2 * inter, hidden), torch.from_numpy(down).view(experts, hidden, inter)
    expected = torch.zeros(5, hidden)
    for t in range(5):
        for j in range(2):
            e = int(ids[t, j])
            gate, up = (gu[e] @ x[t]).chunk(2)
            expected[t] += weights[t, j] * (dn[e] @ (F.silu(gate) * up))
    assert torch.allclose(out, expected, atol=1e-4)


def _gdn_inputs(t: int, nk=2, nv=4, dk=16, dv=8, seed=0):
    g = torch.Generator().manual_seed(seed)
    return (
        torch.randn(t, nk, dk, generator=g),
        torch.randn(t, nk, dk, generator=g),
        torch.randn(t, nv, dv, generator=g),
        -torch.rand(t, nv, generator=g) * 3,
        torch.rand(t, nv, generator=g),
        torch.randn(nv, dk, dv, generator=g),
    )


def _raw_gates(g: torch.Tensor, beta: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """Raw a, b (with a_log = dt_bias = 0) that `gdn_gating` turns into log decay g < 0 and beta."""
    zeros = torch.zeros(g.shape[1])
    a, b = torch.log(torch.expm1(-g.double())).float(), torch.logit(beta.double()).float()
    assert torch.allclose(backend.gdn_gating(a, b, zeros, zeros)[0], g, atol=1e-6)
    return a, b, zeros, zeros


def test_delta_rule_chunked_equals_recurrent_and_transformers():
    q, k, v, g, beta, s0 = _gdn_inputs(150)
    modeling = tiny_hf.oracle_module()
    ref_out, ref_state = modeling.torch_recurrent_gated_delta_rule(
        q[None], k[None], v[None], g[None], beta[None],
        initial_state=s0[None], output_final_state=True, use_qk_l2norm_in_kernel=True,
    )
    chunked_state, recurrent_states = s0.clone(), s0.clone()[None]  # one slot
    chunked = backend.gdn_prefill(q, k, v, g, beta, chunked_state)
    _, ctx = step_inputs([0] * len(q), [0], [0], len(q), len(q), torch.device("cpu"))
    a, b, a_log, dt_bias = _raw_gates(g, beta)
    recurrent = backend.gdn_decode(q, k, v, a, b, a_log, dt_bias, recurrent_states, ctx, None)
    recurrent_state = recurrent_states[0]
    for out, state in ((chunked, chunked_state), (recurrent, recurrent_state)):
        assert torch.allclose(out, ref_out[0], atol=2e-5)
        assert torch.allclose(state, ref_state[0], atol=2e-5)
    split_state = s0.clone()
    first = backend.gdn_prefill(q[:70], k[:70], v[:70], g[:70], beta[:70], split_state)
    second = backend.gdn_prefill(q[70:], k[70:], v[70:], g[70:], beta[70:], split_state)
    assert torch.allclose(torch.cat([first, second]), chunked, atol=2e-5)
    assert torch.allclose(split_state, chunked_state, atol=2e-5)


def test_conv_window_equals_causal_conv1d():
    taps, channels = 4, 6
    weight = torch.randn(taps, channels)
    x = torch.randn(9, channels)
    expected = F.silu(F.conv1d(x.T[None], weight.T.unsqueeze(1), padding=taps - 1, groups=channels)[0, :, :9].T)
    states = torch.zeros(2, taps - 1, channels)  # slot 1 holds the sequence, slot 0 stays untouched

    def update(rows: torch.Tensor, start: int) -> torch.Tensor:
        _, ctx = step_inputs([0] * len(rows), [1], [start], len(rows), 16, torch.device("cpu"))
        return backend.conv_update(rows, states, weight, ctx, None)

    pieces = [update(x[:5], 0)] + [update(x[i : i + 1], i) for i in range(5, 9)]
    assert torch.allclose(torch.cat(pieces), expected, atol=1e-6)
    assert torch.equal(states[1], x[-3:]) and not states[0].any()


def test_attention_prefill_and_decode_use_the_cache_causally():
    heads, kv_heads, dim, t = 4, 2, 8, 6
    q, k, v = torch.randn(t, heads, dim), torch.randn(t, kv_heads, dim), torch.randn(t, kv_heads, dim)
    k_cache, v_cache = torch.zeros(16, kv_heads, dim), torch.zeros(16, kv_heads, dim)
    k_cache[:t], v_cache[:t] = k, v
    expected = F.scaled_dot_product_attention(
        q.transpose(0, 1), k.repeat_interleave(2, 1).transpose(0, 1), v.repeat_interleave(2, 1).transpose(0, 1), is_causal=True
    ).transpose(0, 1)
    assert torch.allclose(backend.attention_prefill(q, k_cache, v_cache, 0), expected, atol=1e-5)
    assert torch.allclose(backend.attention_prefill(q[2:], k_cache, v_cache, 2), expected[2:], atol=1e-5)
    _, ctx = step_inputs([0], [0], [t - 1], 1, 16, torch.device("cpu"))
    assert torch.allclose(backend.attention_decode(q[-1:], k_cache, v_cache, ctx, 16), expected[-1:], atol=1e-5)
