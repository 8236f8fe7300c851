"""Compressed-tensors NVFP4 checkpoints: codes and scales copied without requantization, and bad input.

The checkpoints are built here by hand, in the documented layout (docs/format.md §9.1), from a tiny
BF16 checkpoint and our own quantizer, with every block scale and divisor halved: the stored planes
then decode to the quantizer's values but are not what requantizing would produce, so only a copy
reproduces them.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys

import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file

from ninfer_offload import open_artifact
from ninfer_offload.artifact.codecs import decode_row_split, encode_row_split, quantize_nvfp4, unswizzle_scales
from ninfer_offload.artifact.formats import BlockScaleGeometry
from ninfer_offload.convert import convert
from ninfer_offload.convert.compressed import Nvfp4Matrix, dequantize
from ninfer_offload.convert.tiny import tiny_config, write_checkpoint
from ninfer_offload.errors import NinferError

NVFP4_ARGS = {"num_bits": 4, "type": "float", "strategy": "tensor_group", "group_size": 16, "symmetric": True}
W4A4 = {
    "quant_method": "compressed-tensors",
    "format": "nvfp4-pack-quantized",
    "quantization_status": "compressed",
    "config_groups": {
        "group_0": {
            "targets": ["Linear"],
            "weights": {**NVFP4_ARGS, "dynamic": False, "observer": "minmax"},
            "input_activations": {**NVFP4_ARGS, "dynamic": "local", "observer": "minmax"},
        }
    },
    "ignore": ["lm_head", "re:.*mlp.gate$"],
}
QUERY = "model.layers.2.self_attn.q_proj."  # a Q8 target of the recipe: decoded, then Q8-encoded


def _quantized_linears(config: dict) -> list[str]:
    layers, experts = config["num_hidden_layers"], config["num_experts"]
    linears = [QUERY]
    for layer in range(layers):
        p = f"model.layers.{layer}.mlp."
        linears += [f"{p}experts.{e}.{kind}_proj." for e in range(experts) for kind in ("gate", "up", "down")]
        linears += [f"{p}shared_expert.{kind}_proj." for kind in ("gate", "up", "down")]
    return linears


def compress(src, dst, config: dict, quantization: dict = W4A4, edit=None):
    """A copy of the BF16 checkpoint `src` whose Linears of `_quantized_linears` are stored as NVFP4.

    `edit(state)` may then change the stored tensors.
    """
    shutil.copytree(src, dst)
    state = load_file(dst / "model.safetensors")
    for prefix in _quantized_linears(config):
        codes, scales, divisor = quantize_nvfp4(state.pop(f"{prefix}weight").float().numpy())
        assert scales.min() >= 0x10  # normal E4M3FN: subtracting 8 from the byte halves the scale exactly
        state[f"{prefix}weight_packed"] = torch.from_numpy(codes)
        state[f"{prefix}weight_scale"] = torch.from_numpy(scales - 8).view(torch.float8_e4m3fn)
        state[f"{prefix}weight_global_scale"] = torch.tensor([divisor / 2], dtype=torch.float32)
        state[f"{prefix}input_global_scale"] = torch.tensor([100.0], dtype=torch.float32)
    if edit is not None:
        edit(state)
    save_file(state, dst / "model.safetensors")
    (dst / "config.json").write_text(json.dumps({**config, "quantization_config": quantization}))
    return dst


@pytest.fixture(scope="module")
def nvfp4_config():
    return tiny_config(nvfp4=True)


@pytest.fixture(scope="module")
def compressed_source(tmp_path_factory, tiny_nvfp4_checkpoint, nvfp4_config):
    return compress(tiny_nvfp4_checkpoint, tmp_path_factory.mktemp("ct") / "ckpt", nvfp4_config)


def _binding(prefix: str) -> str:
    parts = prefix.split(".")
    layer, rest = parts[2], parts[4:-1]
    if rest[0] == "experts":
        return f"text/layers/{layer}/moe/experts/{rest[1]}/{rest[2].removesuffix('_proj')}"
    return f"text/layers/{layer}/moe/shared/{rest[1].removesuffix('_proj')}"


def test_import_copies_codes_scales_and_divisors(compressed_source, tiny_artifact_nvfp4, nvfp4_config, tmp_path):
    path = convert(compressed_source, tmp_path / "ct.ninfer", recipe="nvfp4", progress=False)
    stored = load_file(compressed_source / "model.safetensors")
    linears = [p for p in _quantized_linears(nvfp4_config) if p != QUERY]
    with open_artifact(path) as artifact, open_artifact(tiny_artifact_nvfp4) as quantized:
        for prefix in linears:
            name = _binding(prefix)
            object_id, r0, r1 = artifact.rows(name)
            obj = artifact.object(object_id)
            geometry = BlockScaleGeometry(*obj.shape, obj.divisors)
            data = artifact.payload(object_id)
            (code_at, code_bytes), (scale_at, scale_bytes) = geometry.row_spans(r0, r1 - r0)
            codes = stored[f"{prefix}weight_packed"].numpy()
            scales = stored[f"{prefix}weight_scale"].view(torch.uint8).numpy()
            divisor = stored[f"{prefix}weight_global_scale"].numpy()
            assert np.array_equal(data[code_at : code_at + code_bytes].reshape(codes.shape), codes), name
            assert np.array_equal(unswizzle_scales(data[scale_at : scale_at + scale_bytes], r1 - r0, obj.shape[1]), scales), name
            assert data[geometry.divisor_offset :].view("<f4")[r0 // (r1 - r0)] == divisor[0], name
            # the halved planes decode to exactly the values our quantizer gives the BF16 source
            assert torch.equal(artifact.tensor(name), quantized.tensor(name)), name
        assert len(linears) == 6 * (3 * nvfp4_config["num_experts"] + 3)
        # a quantized Linear that the recipe stores as Q8 is decoded, then Q8-encoded
        matrix = Nvfp4Matrix(
            stored[f"{QUERY}weight_packed"].numpy(), stored[f"{QUERY}weight_scale"].view(torch.uint8).numpy(),
            np.float32(stored[f"{QUERY}weight_global_scale"][0]),
        )
        q_proj = dequantize(matrix)
        heads, dim = nvfp4_config["num_attention_heads"], nvfp4_config["head_dim"]
        query = q_proj.reshape(heads, 2, dim, -1)[:, 0].reshape(heads * dim, -1)
        codes, scales = artifact.quantized("text/layers/2/attention/query")
        ref_codes, ref_scales = decode_row_split(encode_row_split(query, "q8_g32_fp16"), "q8_g32_fp16", *query.shape)
        assert np.array_equal(codes.numpy(), ref_codes)
        assert np.array_equal(scales.numpy(), ref_scales)
        assert artifact.provenance["recipe"] == "nvfp4"


def _group(**changes) -> dict:
    group = W4A4["config_groups"]["group_0"]
    return {**W4A4, "config_groups": {"group_0": {**group, **changes}}}


@pytest.mark.parametrize(
    "quantization, message",
    [
        ({**W4A4, "quant_method": "fp8"}, "quant_method 'fp8' is not supported"),
        ({**W4A4, "format": "pack-quantized"}, "group 'group_0' has format 'pack-quantized'; only NVFP4 W4A16/W4A4"),
        (
            _group(weights={**NVFP4_ARGS, "type": "int", "strategy": "group", "group_size": 128}),
            "group 'group_0' weights are .*type 'int'.*only NVFP4 W4A16/W4A4",
        ),
        (_group(input_activations={"num_bits": 8, "type": "float", "strategy": "token"}), "input activations are .*num_bits 8"),
    ],
)
def test_other_quantization_configs_are_refused(quantization, message, tiny_nvfp4_checkpoint, nvfp4_config, tmp_path):
    src = compress(tiny_nvfp4_checkpoint, tmp_path / "src", nvfp4_config, quantization=quantization)
    with pytest.raises(NinferError, match=message) as info:
        convert(src, tmp_path / "a.ninfer", recipe="nvfp4", progress=False)
    assert "\n" not in str(info.value)


def test_w4a16_config_converts(tiny_nvfp4_checkpoint, nvfp4_config, tmp_path):
    src = compress(tiny_nvfp4_checkpoint, tmp_path / "src", nvfp4_config, quantization=_group(input_activations=None))
    with open_artifact(convert(src, tmp_path / "a.ninfer", recipe="nvfp4", progress=False)) as artifact:
        assert artifact.object(artifact.rows("text/layers/0/moe/experts/0/up")[0]).format == "nvfp4"


EXPERT = "model.layers.1.mlp.experts.2.up_proj."


def _set(name: str, value: torch.Tensor):
    def edit(state):
        state[name] = value

    return edit


def _nan_scale(state):
    scales = state[f"{EXPERT}weight_scale"].view(torch.uint8).clone()
    scales[3, 1] = 0x7F
    state[f"{EXPERT}weight_scale"] = scales.view(torch.float8_e4m3fn)


@pytest.mark.parametrize(
    "edit, message",
    [
        (_set(f"{EXPERT}weight_global_scale", torch.tensor([0.0])), f"tensor '{EXPERT}weight_global_scale' is 0.0; .*finite and > 0"),
        (_set(f"{EXPERT}weight_global_scale", torch.tensor([-3.0])), f"'{EXPERT}weight_global_scale' is -3.0"),
        (_set(f"{EXPERT}weight_global_scale", torch.tensor([float("inf")])), f"'{EXPERT}weight_global_scale' is inf"),
        (_set(f"{EXPERT}weight_global_scale", torch.tensor([float("nan")])), f"'{EXPERT}weight_global_scale' is nan"),
        (_nan_scale, f"tensor '{EXPERT}weight_scale' has 1 NaN and 0 negative block scales"),
        (_set(f"{EXPERT}weight_scale", torch.zeros(128, 8, dtype=torch.uint8)), f"'{EXPERT}weight_scale' has dtype U8, expected F8_E4M3"),
        (_set(f"{EXPERT}weight_packed", torch.zeros(128, 32, dtype=torch.uint8)), rf"'{EXPERT}weight_packed' has shape \[128, 32\]"),
    ],
)
def test_bad_planes_fail_with_one_line_naming_the_tensor(edit, message, tiny_nvfp4_checkpoint, nvfp4_config, tmp_path):
    src = compress(tiny_nvfp4_checkpoint, tmp_path / "src", nvfp4_config, edit=edit)
    out = tmp_path / "out"
    out.mkdir()
    with pytest.raises(NinferError, match=message) as info:
        convert(src, out / "a.ninfer", recipe="nvfp4", progress=False)
    assert "\n" not in str(info.value)
    assert not list(out.iterdir())


@pytest.mark.parametrize(
    "dims, message",
    [
        ({}, r"'model.layers.0.mlp.experts.0.gate_proj.weight_packed': nvfp4 needs .*got \[32\] rows x 64 columns"),
        ({"hidden_size": 96, "moe_intermediate_size": 128, "shared_expert_intermediate_size": 128},
         r"got \[128\] rows x 96 columns"),
    ],
)
def test_matrices_that_do_not_tile_are_refused(dims, message, tmp_path):
    config = tiny_config()
    config.update(dims)
    bf16 = write_checkpoint(tmp_path / "bf16", config, "per_expert")
    src = compress(bf16, tmp_path / "src", config)
    with pytest.raises(NinferError, match=message):
        convert(src, tmp_path / "a.ninfer", recipe="nvfp4", progress=False)


def test_cli_reports_one_line(tiny_nvfp4_checkpoint, nvfp4_config, tmp_path):
    src = compress(tiny_nvfp4_checkpoint, tmp_path / "src", nvfp4_config, edit=_set(f"{EXPERT}weight_global_scale", torch.tensor([0.0])))
    done = subprocess.run(
        [sys.executable, "-m", "ninfer_offload", "convert", str(src), str(tmp_path / "a.ninfer"), "--recipe", "nvfp4", "--no-progress"],
        capture_output=True, text=True, timeout=300,
    )
    assert done.returncode == 2
    assert done.stderr.strip().splitlines() == [
        f"error: tensor '{EXPERT}weight_global_scale' is 0.0; an NVFP4 global scale must be finite and > 0"
    ]
