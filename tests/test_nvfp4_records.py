"""nvfp4 matrices and expert records: whole 128-row tiles cut out verbatim with one divisor per tile,
decoded by the codec and by the torch reference op to the parent's exact values."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from nvfp4_support import random_nvfp4

from ninfer_offload.artifact.codecs import decode_nvfp4, decode_row_split_values, encode_row_split, materialize_rows
from ninfer_offload.artifact.errors import ArtifactError
from ninfer_offload.artifact.formats import BlockScaleGeometry, runtime_geometry
from ninfer_offload.artifact.records import ExpertRecordLayout
from ninfer_offload.model.experts import record_weights
from ninfer_offload.model.nvfp4 import Nvfp4Matrix, dequantize_nvfp4

HIDDEN, INTER, EXPERTS = 128, 64, 6  # gate/up [128, 128] and down [128, 64] per expert: one row tile each


@pytest.mark.parametrize("divisors", [1, 2, 4])
def test_tiles_cut_out_with_their_parents_divisor(divisors):
    n, k = 512, 192
    parent = random_nvfp4(np.random.default_rng(divisors), n, k, divisors)
    values = decode_nvfp4(parent, n, k, divisors)
    for r0, count in ((0, n), (128, 256), (384, 128)):
        piece = materialize_rows(parent, "nvfp4", n, k, r0, count)
        assert piece.size == runtime_geometry("nvfp4", count, k).encoded_size
        assert np.array_equal(decode_nvfp4(piece, count, k, count // 128), values[r0 : r0 + count])
    with pytest.raises(ArtifactError, match="not whole 128-row scale tiles"):
        materialize_rows(parent, "nvfp4", n, k, 64, 128)


def test_reference_op_equals_codec():
    n, k = 256, 128
    data = materialize_rows(random_nvfp4(np.random.default_rng(5), n, k, 2), "nvfp4", n, k, 0, n)
    expected = decode_nvfp4(data, n, k, 2)
    matrix = Nvfp4Matrix(n, k, torch.from_numpy(data))
    assert torch.equal(matrix.dequantize(), torch.from_numpy(expected))
    rows = torch.tensor([255, 0, 37, 130, 37])
    assert torch.equal(matrix.dequantize_rows(rows), torch.from_numpy(expected[rows.numpy()]))
    stacked = torch.from_numpy(np.stack([data, data[::-1].copy()]))  # a leading batch, the second object garbage
    assert torch.equal(dequantize_nvfp4(stacked, matrix.geometry, torch.float32)[0], torch.from_numpy(expected))
    with pytest.raises(ValueError, match="one divisor per row tile"):
        dequantize_nvfp4(torch.from_numpy(data), BlockScaleGeometry(n, k, 1), torch.float32)


@pytest.mark.parametrize("gate_up_fmt,down_fmt,divisors", [("nvfp4", "nvfp4", 1), ("nvfp4", "nvfp4", 3), ("nvfp4", "q5_g64_fp16", 6)])
def test_expert_records_hold_each_experts_exact_rows(gate_up_fmt, down_fmt, divisors):
    rng = np.random.default_rng(divisors)
    gate_up = random_nvfp4(rng, EXPERTS * 2 * INTER, HIDDEN, divisors)
    if down_fmt == "nvfp4":
        down = random_nvfp4(rng, EXPERTS * HIDDEN, INTER, divisors)
        down_values = decode_nvfp4(down, EXPERTS * HIDDEN, INTER, divisors)
    else:
        down = encode_row_split(rng.standard_normal((EXPERTS * HIDDEN, INTER)).astype(np.float32), down_fmt)
        down_values = decode_row_split_values(down, down_fmt, EXPERTS * HIDDEN, INTER)
    gate_up_values = decode_nvfp4(gate_up, EXPERTS * 2 * INTER, HIDDEN, divisors)
    layout = ExpertRecordLayout.create(gate_up_fmt, down_fmt, HIDDEN, INTER)
    out = np.full((EXPERTS, layout.nbytes), 0xAB, dtype=np.uint8)  # stale bytes must not survive in the padding
    layout.pack_all(gate_up, down, EXPERTS, out)
    assert np.array_equal(out, np.stack([layout.pack(gate_up, down, EXPERTS, e) for e in range(EXPERTS)]))
    gu, dn = record_weights(torch.from_numpy(out), layout, torch.float32)
    for e in range(EXPERTS):
        assert torch.equal(gu[e], torch.from_numpy(gate_up_values[2 * INTER * e : 2 * INTER * (e + 1)]))
        assert torch.equal(dn[e], torch.from_numpy(down_values[HIDDEN * e : HIDDEN * (e + 1)]))


def test_record_geometry_of_the_35b_shape():
    layout = ExpertRecordLayout.create("nvfp4", "nvfp4", 2048, 512)
    assert (layout.gate_up.encoded_size, layout.down_offset, layout.down.encoded_size, layout.nbytes) == (1179680, 1179904, 589888, 1769984)
    assert (layout.gate_up.divisors, layout.down.divisors) == (8, 16)


def test_experts_must_be_whole_row_tiles():
    with pytest.raises(ArtifactError, match="N % 128 == 0"):
        ExpertRecordLayout.create("nvfp4", "q4_g64_fp16", 64, 32)  # gate/up [64, 64] per expert
