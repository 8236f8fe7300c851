"""`--recipe nvfp4` from a BF16 checkpoint: our NVFP4 quantizer (docs/format.md §7.1) and where its
codes, scales and divisors land in the stacked expert parents."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from ninfer_offload import open_artifact
from ninfer_offload.artifact.codecs import E2M1_VALUES, E4M3FN_VALUES, quantize_nvfp4, round_e4m3fn, unswizzle_scales
from ninfer_offload.artifact.formats import BlockScaleGeometry
from ninfer_offload.convert import convert
from ninfer_offload.convert.tiny import checkpoint_tensors, tiny_config, write_checkpoint


@pytest.fixture(scope="module")
def nvfp4_config():
    return tiny_config(nvfp4=True)


@pytest.fixture(scope="module")
def bf16_checkpoints(tmp_path_factory, nvfp4_config):
    root = tmp_path_factory.mktemp("nvfp4_bf16")
    return {layout: write_checkpoint(root / layout, nvfp4_config, layout) for layout in ("fused", "per_expert")}


def test_quantizer_worked_example():
    """The example of docs/format.md §7.1, byte for byte."""
    row = np.zeros((1, 32), dtype=np.float32)
    row[0, :4] = [1.0, -0.3, 2.5, 0.0]  # block 0, amax 2.5 (the matrix maximum)
    row[0, 16:18] = [0.01, -0.004]  # block 1, amax 0.01
    codes, scales, divisor = quantize_nvfp4(row)
    assert divisor == np.float32(1075.2)
    assert scales.tolist() == [[0x7E, 0x3E]]  # 448 and 1.75
    assert codes[0].tolist() == [0x94, 0x07, 0, 0, 0, 0, 0, 0, 0xC7, 0, 0, 0, 0, 0, 0, 0]


def test_e4m3fn_rounding_is_to_nearest_even():
    assert round_e4m3fn(np.array([0.0, 2.0**-10, 3 * 2.0**-10, 1.0625, 1.1875, 500.0, 448.0])).tolist() == [
        0x00, 0x00, 0x02, 0x38, 0x3A, 0x7E, 0x7E,
    ]
    every = E4M3FN_VALUES[:0x7F]
    assert np.array_equal(round_e4m3fn(every), np.arange(0x7F, dtype=np.uint8))


def _member_bound(source: np.ndarray, divisor: float) -> np.ndarray:
    """The documented per-element NVFP4 error bound of §7.1: (17/16) * block amax / 6 + 2**-10 / d."""
    blocks = np.abs(source.reshape(source.shape[0], -1, 16)).max(axis=-1)
    return np.repeat(blocks * (17 / 16) / 6 + 2.0**-10 / divisor, 16, axis=1)


def _expected_members(tensors: dict, layer: int, experts: int, width: int):
    """(binding, source matrix) of every NVFP4 member of one text layer, from the HF tensors."""
    p = f"model.layers.{layer}.mlp."
    gate_up, down = tensors[f"{p}experts.gate_up_proj"], tensors[f"{p}experts.down_proj"]
    name = f"text/layers/{layer}/moe"
    for e in range(experts):
        yield f"{name}/experts/{e}/gate", gate_up[e, :width]
        yield f"{name}/experts/{e}/up", gate_up[e, width:]
        yield f"{name}/experts/{e}/down", down[e]
    for kind in ("gate", "up", "down"):
        yield f"{name}/shared/{kind}", tensors[f"{p}shared_expert.{kind}_proj.weight"]


@pytest.mark.parametrize("layout", ["fused", "per_expert"])
def test_bf16_checkpoint_converts_to_nvfp4_experts(layout, bf16_checkpoints, nvfp4_config, tmp_path):
    path = convert(bf16_checkpoints[layout], tmp_path / "a.ninfer", recipe="nvfp4", progress=False)
    tensors = checkpoint_tensors(nvfp4_config, "fused")
    experts, width = nvfp4_config["num_experts"], nvfp4_config["moe_intermediate_size"]
    checked = 0
    with open_artifact(path) as artifact:
        for layer in range(nvfp4_config["num_hidden_layers"]):
            for name, source in _expected_members(tensors, layer, experts, width):
                object_id, r0, r1 = artifact.rows(name)
                obj = artifact.object(object_id)
                assert (obj.format, obj.layout) == ("nvfp4", "block_scale_k16_m128x4_v1"), name
                assert obj.divisors == obj.shape[0] // (r1 - r0), name  # one divisor per member
                geometry = BlockScaleGeometry(*obj.shape, obj.divisors)
                data = artifact.payload(object_id)
                (code_at, code_bytes), (scale_at, scale_bytes) = geometry.row_spans(r0, r1 - r0)
                codes, scales, divisor = quantize_nvfp4(source.numpy())
                assert np.array_equal(data[code_at : code_at + code_bytes].reshape(codes.shape), codes), name
                assert np.array_equal(unswizzle_scales(data[scale_at : scale_at + scale_bytes], r1 - r0, obj.shape[1]), scales)
                assert data[geometry.divisor_offset :].view("<f4")[r0 // (r1 - r0)] == divisor, name
                decoded = artifact.tensor(name).numpy()
                assert np.all(np.abs(decoded - source.numpy()) <= _member_bound(source.numpy(), float(divisor))), name
                checked += 1
        formats = {n: artifact.object(b.parts[0].object).format for n, b in artifact.bindings.items()}
    assert checked == 6 * (3 * experts + 3)
    assert formats["text/layers/2/attention/query"] == "q8_g32_fp16"
    assert formats["text/layers/0/gdn/output"] == "q8_g32_fp16"
    assert formats["text/token_embedding"] == "q8_g32_fp16" and formats["text/output_head"] == "q6_g64_fp16"
    assert formats["mtp/layers/0/moe/experts/1/gate"] == formats["mtp/layers/0/moe/shared/down"] == "q8_g32_fp16"
    assert formats["text/layers/1/moe/router"] == "bf16"


def test_default_tiny_dims_are_refused(tiny_checkpoint, tmp_path):
    with pytest.raises(Exception, match=r"tensor 'model.layers.0.mlp.experts.gate_up_proj': nvfp4 needs matrices of a multiple"):
        convert(tiny_checkpoint, tmp_path / "a.ninfer", recipe="nvfp4", progress=False)
    assert not list(tmp_path.iterdir())


def test_decoded_values_are_code_times_scale_over_divisor():
    """A decoded element is exactly e2m1(code) * e4m3fn(scale) / divisor."""
    values = torch.randn(128, 64, generator=torch.Generator().manual_seed(3)).numpy()
    codes, scales, divisor = quantize_nvfp4(values)
    lanes = np.stack([codes & 0x0F, codes >> 4], axis=-1).reshape(128, 64)
    rebuilt = E2M1_VALUES[lanes] * np.repeat(E4M3FN_VALUES[scales], 16, axis=1) / divisor
    assert np.all(np.abs(rebuilt - values) <= _member_bound(values, float(divisor)))
