"""Converted tiny checkpoints hold exactly the Hugging Face weights after the docs/format.md §9 transforms.

Expected values are computed here straight from the HF tensors (independently of the converter's
layout code): bf16 is bit-exact, quantized recipes equal the canonical encoder's codes and scales.
"""

from __future__ import annotations

import json
import shutil

import numpy as np
import pytest
import tiny_hf
import torch
from conftest import TINY_SEED
from safetensors.torch import load_file, save_file

from ninfer_offload import Engine, open_artifact
from ninfer_offload.artifact.codecs import decode_row_split, encode_row_split
from ninfer_offload.convert import convert
from ninfer_offload.convert.recipes import q6_down_layers


def _text_expected(t: dict, cfg, name: str, prefix: str) -> torch.Tensor | None:
    """The HF tensor (after §9 transforms) that a text/mtp binding must hold, or None if not text/mtp."""
    parts = name.split("/")
    if name == "text/token_embedding":
        return t[f"{prefix}embed_tokens.weight"]
    if name == "text/output_head":
        return t["lm_head.weight"]
    if name == "text/final_norm":
        return t[f"{prefix}norm.weight"]
    mtp_globals = {
        "mtp/input_projection": "mtp.fc.weight",
        "mtp/embedding_norm": "mtp.pre_fc_norm_embedding.weight",
        "mtp/hidden_norm": "mtp.pre_fc_norm_hidden.weight",
        "mtp/final_norm": "mtp.norm.weight",
    }
    if name in mtp_globals:
        return t[mtp_globals[name]]
    if parts[0] == "text":
        p, rest = f"{prefix}layers.{parts[2]}.", parts[3:]
    elif parts[0] == "mtp":
        p, rest = "mtp.layers.0.", parts[3:]
    else:
        return None
    key = "/".join(rest)
    kd = cfg.linear_num_key_heads * cfg.linear_key_head_dim
    simple = {
        "input_norm": "input_layernorm.weight",
        "post_attention_norm": "post_attention_layernorm.weight",
        "attention/key": "self_attn.k_proj.weight",
        "attention/value": "self_attn.v_proj.weight",
        "attention/query_norm": "self_attn.q_norm.weight",
        "attention/key_norm": "self_attn.k_norm.weight",
        "attention/output": "self_attn.o_proj.weight",
        "gdn/z": "linear_attn.in_proj_z.weight",
        "gdn/a_projection": "linear_attn.in_proj_a.weight",
        "gdn/b_projection": "linear_attn.in_proj_b.weight",
        "gdn/a_log": "linear_attn.A_log",
        "gdn/dt_bias": "linear_attn.dt_bias",
        "gdn/norm": "linear_attn.norm.weight",
        "gdn/output": "linear_attn.out_proj.weight",
        "moe/router": "mlp.gate.weight",
        "moe/shared_score": "mlp.shared_expert_gate.weight",
        "moe/shared/gate": "mlp.shared_expert.gate_proj.weight",
        "moe/shared/up": "mlp.shared_expert.up_proj.weight",
        "moe/shared/down": "mlp.shared_expert.down_proj.weight",
    }
    if key in simple:
        return t[p + simple[key]]
    if key in ("attention/query", "attention/gate"):
        q = t[p + "self_attn.q_proj.weight"]
        heads = q.reshape(cfg.num_attention_heads, 2, cfg.head_dim, q.shape[1])
        return heads[:, 0 if key.endswith("query") else 1].reshape(-1, q.shape[1])
    if key.startswith("gdn/") and key[4:] in ("query", "key", "value"):
        qkv = t[p + "linear_attn.in_proj_qkv.weight"]
        return {"query": qkv[:kd], "key": qkv[kd : 2 * kd], "value": qkv[2 * kd :]}[key[4:]]
    if key == "gdn/convolution":
        return t[p + "linear_attn.conv1d.weight"][:, 0, :].T
    if key.startswith("moe/experts/"):
        e, kind = int(rest[2]), rest[3]
        inter = cfg.moe_intermediate_size
        if kind == "down":
            return t[p + "mlp.experts.down_proj"][e]
        gate_up = t[p + "mlp.experts.gate_up_proj"][e]
        return gate_up[:inter] if kind == "gate" else gate_up[inter:]
    raise AssertionError(f"no expectation for binding {name}")


def _vision_expected(t: dict, name: str) -> torch.Tensor:
    v = "model.visual."
    globals_ = {
        "vision/patch_embedding": v + "patch_embed.proj.weight",
        "vision/patch_embedding_bias": v + "patch_embed.proj.bias",
        "vision/position_embedding": v + "pos_embed.weight",
        "vision/merger/norm_weight": v + "merger.norm.weight",
        "vision/merger/norm_bias": v + "merger.norm.bias",
        "vision/merger/fc1": v + "merger.linear_fc1.weight",
        "vision/merger/fc1_bias": v + "merger.linear_fc1.bias",
        "vision/merger/fc2": v + "merger.linear_fc2.weight",
        "vision/merger/fc2_bias": v + "merger.linear_fc2.bias",
    }
    if name in globals_:
        value = t[globals_[name]]
        return value.reshape(value.shape[0], -1) if name == "vision/patch_embedding" else value
    parts = name.split("/")
    b, key = f"{v}blocks.{parts[2]}.", "/".join(parts[3:])
    which = {"query": 0, "key": 1, "value": 2}
    if key.startswith("attention/") and key[10:].removesuffix("_bias") in which:
        base = key[10:].removesuffix("_bias")
        full = t[b + ("attn.qkv.bias" if key.endswith("_bias") else "attn.qkv.weight")]
        return full.chunk(3, dim=0)[which[base]]
    simple = {
        "norm1_weight": "norm1.weight",
        "norm1_bias": "norm1.bias",
        "norm2_weight": "norm2.weight",
        "norm2_bias": "norm2.bias",
        "attention/output": "attn.proj.weight",
        "attention/output_bias": "attn.proj.bias",
        "mlp/fc1": "mlp.linear_fc1.weight",
        "mlp/fc1_bias": "mlp.linear_fc1.bias",
        "mlp/fc2": "mlp.linear_fc2.weight",
        "mlp/fc2_bias": "mlp.linear_fc2.bias",
    }
    return t[b + simple[key]]


def _hf_tensors(model, with_vision: bool) -> tuple:
    """(text config, HF name -> tensor incl. mtp.*, text prefix) of the checkpoint of `model`."""
    cfg = tiny_hf.text_config_of(model)
    t = tiny_hf.checkpoint_tensors("conditional" if with_vision else "fused")
    prefix = "model.language_model." if with_vision else "model."
    return cfg, t, prefix


@pytest.fixture(scope="module")
def conditional_model():
    return tiny_hf.build_tiny_model(seed=0, layout="conditional")


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    root = tmp_path_factory.mktemp("roundtrip")
    return {
        "fused": tiny_hf.save_checkpoint(root / "fused", "fused"),
        "per_expert": tiny_hf.save_checkpoint(root / "per_expert", "per_expert"),
        "conditional": tiny_hf.save_checkpoint(root / "conditional", "conditional", shards=3),
    }


def _expected(model, layout: str):
    """binding name -> the float32 tensor a converted artifact must hold for it."""
    cfg, t, prefix = _hf_tensors(model, layout == "conditional")

    def lookup(name: str) -> torch.Tensor:
        value = _text_expected(t, cfg, name, prefix)
        return _vision_expected(t, name) if value is None else value

    return lookup


@pytest.mark.parametrize("layout", ["fused", "per_expert", "conditional"])
def test_bf16_recipe_is_bit_exact(layout, checkpoints, tiny_hf_model, conditional_model, tmp_path):
    model = conditional_model if layout == "conditional" else tiny_hf_model
    path = convert(checkpoints[layout], tmp_path / "a.ninfer", recipe="bf16", progress=False)
    expected = _expected(model, layout)
    with open_artifact(path) as artifact:
        components = set(artifact.components)
        assert components == ({"text", "mtp", "vision"} if layout == "conditional" else {"text", "mtp"})
        for name in artifact.bindings:
            want = expected(name).to(torch.float32)
            got = artifact.tensor(name)
            assert got.numel() == want.numel(), name
            assert torch.equal(got.reshape(want.shape), want), name
        if layout == "conditional":
            roles = {"preprocessor_config.json", "video_preprocessor_config.json"}
            assert set(artifact.components["vision"].resources) == roles
            assert artifact.components["vision"].target == "text"
        # exact FP32 widening of the BF16 controls, tap-major convolution
        a_log = artifact.object(artifact.bindings["text/layers/0/gdn/a_log"].parts[0].object)
        assert a_log.format == "fp32"
        conv = artifact.object(artifact.bindings["text/layers/0/gdn/convolution"].parts[0].object)
        assert conv.shape == (4, 2 * 2 * 16 + 4 * 24)


@pytest.mark.parametrize("recipe", ["official", "q8"])
def test_quantized_recipes_hold_canonical_encoder_codes(recipe, checkpoints, conditional_model, tmp_path):
    path = convert(checkpoints["conditional"], tmp_path / "q.ninfer", recipe=recipe, progress=False)
    expected = _expected(conditional_model, "conditional")
    checked = 0
    with open_artifact(path) as artifact:
        for name in artifact.bindings:
            obj = artifact.object(artifact.bindings[name].parts[0].object)
            want = expected(name).to(torch.float32)
            if obj.layout != "row_split_k128_v1":
                assert torch.equal(artifact.tensor(name).reshape(want.shape), want), name
                continue
            want = want.reshape(want.shape[0], -1).numpy()
            codes, scales = artifact.quantized(name)
            ref_codes, ref_scales = decode_row_split(encode_row_split(want, obj.format), obj.format, *want.shape)
            assert np.array_equal(codes.numpy(), ref_codes), name
            assert np.array_equal(scales.numpy().view(np.uint16), ref_scales.view(np.uint16)), name
            checked += 1
        assert checked > 100
        fmt = {n: artifact.object(artifact.bindings[n].parts[0].object).format for n in artifact.bindings}
    if recipe == "q8":
        assert {f for n, f in fmt.items() if "/moe/experts/" in n or n.startswith("vision/layers")} <= {"q8_g32_fp16", "bf16"}
        return
    layers = tiny_hf.text_config_of(conditional_model).num_hidden_layers
    assert q6_down_layers(layers) == {5}
    for layer in range(layers):
        assert fmt[f"text/layers/{layer}/moe/experts/0/gate"] == "q4_g64_fp16"
        assert fmt[f"text/layers/{layer}/moe/experts/7/down"] == ("q6_g64_fp16" if layer == 5 else "q5_g64_fp16")
        assert fmt[f"text/layers/{layer}/moe/router"] == "bf16"
    assert fmt["text/token_embedding"] == "q8_g32_fp16"
    assert fmt["text/output_head"] == "q6_g64_fp16"
    assert fmt["mtp/layers/0/moe/experts/3/down"] == "q8_g32_fp16"
    assert fmt["vision/patch_embedding"] == "q6_g64_fp16"
    assert fmt["vision/layers/1/attention/key"] == "q4_g64_fp16"
    assert fmt["vision/layers/1/mlp/fc2"] == "q5_g64_fp16"
    assert fmt["vision/merger/fc1"] == "q8_g32_fp16"


def test_text_only_and_parts_hold_the_same_tensors(checkpoints, tmp_path):
    whole = convert(checkpoints["conditional"], tmp_path / "whole.ninfer", recipe="official", text_only=True, progress=False)
    split = convert(checkpoints["conditional"], tmp_path / "split.ninfer", recipe="official", text_only=True,
                    max_file_bytes=200_000, progress=False)
    with open_artifact(whole) as a, open_artifact(split) as b:
        assert set(a.components) == {"text", "mtp"}
        assert not any(n.startswith("vision/") for n in a.bindings)
        assert len(a.directory["files"]) == 1 and len(b.directory["files"]) > 3
        assert all((tmp_path / f["path"]).is_file() for f in b.directory["files"][1:])
        assert a.bindings.keys() == b.bindings.keys()
        for name in a.bindings:
            assert torch.equal(a.tensor(name), b.tensor(name)), name
        for role in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja", "generation_config.json"):
            assert a.resource(role) == (checkpoints["conditional"] / role).read_bytes()


def test_uses_and_head_inputs(tiny_artifact):
    with open_artifact(tiny_artifact) as artifact:
        uses = {(u.parameter, u.input) for u in artifact.uses}
        assert ("text/output_head", "text/final_hidden") in uses
        assert ("text/output_head", "mtp/final_hidden") in uses
        assert ("text/layers/2/attention/output", "text/layers/2/attention/gated_output") in uses
        assert ("text/layers/0/moe/experts/7/down", "text/layers/0/moe/experts/7/product") in uses
        assert ("mtp/input_projection", "mtp/stem_input") in uses
        assert all(u.activation_policy == "A16Only" for u in artifact.uses)
        assert artifact.components["mtp"].config == {"architectures": ["Qwen3_5MoeMTP"]}
        assert artifact.provenance["recipe"] == "bf16"


def test_float32_checkpoint_gives_the_same_artifact(tiny_artifact, tmp_path):
    """bf16-representable float32 weights convert to the very bytes of their bf16 checkpoint."""
    src = tiny_hf.save_checkpoint(tmp_path / "fp32", "fused", dtype=torch.float32, seed=TINY_SEED)
    path = convert(src, tmp_path / "fp32.ninfer", recipe="bf16", progress=False)
    with open_artifact(path) as a, open_artifact(tiny_artifact) as b:
        assert [o.id for o in a.objects] == [o.id for o in b.objects]
        for obj in a.objects:
            assert np.array_equal(a.payload(obj.id), b.payload(obj.id)), obj.id


def test_tied_checkpoint_without_lm_head_uses_the_embedding(tiny_checkpoint, tmp_path):
    src = shutil.copytree(tiny_checkpoint, tmp_path / "tied")
    state = load_file(src / "model.safetensors")
    del state["lm_head.weight"]
    save_file(state, src / "model.safetensors")
    config = json.loads((src / "config.json").read_text())
    (src / "config.json").write_text(json.dumps({**config, "tie_word_embeddings": True}))
    with open_artifact(convert(src, tmp_path / "tied.ninfer", recipe="bf16", progress=False)) as artifact:
        assert artifact.components["text"].config["tie_word_embeddings"] is True
        assert torch.equal(artifact.tensor("text/output_head"), state["model.embed_tokens.weight"].float())
    hf = tiny_hf.oracle_module().Qwen3_5MoeForCausalLM.from_pretrained(src, dtype=torch.float32)
    assert hf.lm_head.weight.data_ptr() == hf.model.embed_tokens.weight.data_ptr()
    prompt = list(range(3, 40, 3))
    ref, _ = tiny_hf.oracle_forward(hf, prompt)
    engine = Engine.load(tmp_path / "tied.ninfer")
    ours = engine.logits(prompt)
    engine.close()
    assert (ours - ref).abs().max().item() <= 1e-4 * max(1.0, ref.abs().max().item())
