"""Expert record layouts: packing a whole layer at once gives exactly the per-expert records."""

from __future__ import annotations

import numpy as np
import pytest

from ninfer_offload.artifact.codecs import encode_row_split
from ninfer_offload.artifact.records import DenseRecordLayout, ExpertRecordLayout

HIDDEN, INTER, EXPERTS = 256, 128, 5


@pytest.mark.parametrize("gate_up_fmt,down_fmt", [("q4_g64_fp16", "q5_g64_fp16"), ("q8_g32_fp16", "q6_g64_fp16")])
def test_row_split_layer_pack_equals_per_expert_pack(gate_up_fmt, down_fmt):
    rng = np.random.default_rng(0)
    gate_up = encode_row_split(rng.standard_normal((EXPERTS * 2 * INTER, HIDDEN)).astype(np.float32), gate_up_fmt)
    down = encode_row_split(rng.standard_normal((EXPERTS * HIDDEN, INTER)).astype(np.float32), down_fmt)
    layout = ExpertRecordLayout.create(gate_up_fmt, down_fmt, HIDDEN, INTER)
    out = np.full((EXPERTS, layout.nbytes), 0xAB, dtype=np.uint8)  # stale bytes must not survive in the padding
    layout.pack_all(gate_up, down, EXPERTS, out)
    expected = np.stack([layout.pack(gate_up, down, EXPERTS, e) for e in range(EXPERTS)])
    assert np.array_equal(out, expected)


def test_dense_layer_pack_equals_per_expert_pack():
    rng = np.random.default_rng(1)
    layout = DenseRecordLayout("bf16", HIDDEN, INTER)
    gate_up = rng.integers(0, 256, EXPERTS * layout.gate_up_bytes, dtype=np.uint8)
    down = rng.integers(0, 256, EXPERTS * layout.down_bytes, dtype=np.uint8)
    out = np.full((EXPERTS, layout.nbytes), 0xAB, dtype=np.uint8)
    layout.pack_all(gate_up, down, EXPERTS, out)
    assert np.array_equal(out, np.stack([layout.pack(gate_up, down, EXPERTS, e) for e in range(EXPERTS)]))
