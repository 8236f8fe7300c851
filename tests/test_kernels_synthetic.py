"""The synthetic full-size artifact's random weights are valid encodings with the intended scale."""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np

from ninfer_offload.artifact.codecs import E4M3FN_VALUES, decode_nvfp4, decode_row_split, decode_row_split_values, unswizzle_scales
from ninfer_offload.artifact.formats import BlockScaleGeometry

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "bench"))
import make_synthetic  # noqa: E402


def test_random_row_split_objects_are_valid_and_keep_unit_gain(monkeypatch):
    monkeypatch.setattr(make_synthetic, "POOL_BYTES", 1 << 20)
    weights = make_synthetic.RandomWeights(seed=1)
    x = np.random.default_rng(2).standard_normal(1024).astype(np.float32)
    for fmt in ("q4_g64_fp16", "q5_g64_fp16", "q6_g64_fp16", "q8_g32_fp16"):
        data = weights.row_split(fmt, [256, 1024], unit_rows=False)
        codes, scales = decode_row_split(data, fmt, 256, 1024)
        assert codes.min() > -128 and np.all(scales > 0) and np.all(np.isfinite(scales.astype(np.float32)))
        y = decode_row_split_values(data, fmt, 256, 1024) @ x
        gain = np.sqrt(np.mean(y**2) / np.mean(x**2))  # rms out / rms in
        assert 0.8 < gain < 1.4, (fmt, gain)


def test_random_nvfp4_objects_are_valid_and_keep_unit_gain(monkeypatch):
    monkeypatch.setattr(make_synthetic, "POOL_BYTES", 1 << 20)
    weights = make_synthetic.RandomWeights(seed=1)
    x = np.random.default_rng(2).standard_normal(1024).astype(np.float32)
    obj = {"format": "nvfp4", "layout": "block_scale_k16_m128x4_v1", "shape": [512, 1024], "divisors": 4}
    data = weights.source(obj, ["text/layers/0/moe/experts/0/gate"])()
    geometry = BlockScaleGeometry(512, 1024, 4)
    scales = E4M3FN_VALUES[unswizzle_scales(data[geometry.scale_offset : geometry.divisor_offset], 512, 1024)]
    divisors = data[geometry.divisor_offset :].view("<f4")
    assert np.all(np.isfinite(scales)) and scales.min() >= 8 and scales.max() <= 24
    assert np.all(np.isfinite(divisors) & (divisors > 0))
    assert len(np.unique(data[: geometry.code_bytes] & 0x0F)) == 16  # every code occurs
    y = decode_nvfp4(data, 512, 1024, divisors=4) @ x
    gain = np.sqrt(np.mean(y**2) / np.mean(x**2))
    assert 0.8 < gain < 1.4, gain


def test_vectors_follow_their_role():
    weights = make_synthetic.RandomWeights.__new__(make_synthetic.RandomWeights)
    weights.rng = np.random.default_rng(0)
    norm = weights.vector("bf16", [128], ["text/layers/0/gdn/norm"]).view("<u2")
    assert np.all(norm == 0x3F80)  # bf16 1.0
    ids = weights.vector("int32", [1000], ["proposal/token_ids"]).view("<i4")
    assert len(set(ids.tolist())) == 1000 and ids.max() < make_synthetic.PUBLIC_VOCAB
    a_log = weights.vector("fp32", [32], ["text/layers/0/gdn/a_log"]).view("<f4")
    assert np.all((a_log >= 0) & (a_log <= np.log(16)))
