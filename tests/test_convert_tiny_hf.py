"""The tiny HF fixtures are what the oracle tests need: real architecture traps, exact layouts."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import tiny_hf
import torch
from conftest import TINY_SEED


def test_config_exercises_the_conventions(tiny_hf_model):
    cfg = tiny_hf_model.config
    assert cfg.num_hidden_layers >= 6 and set(cfg.layer_types) == {"full_attention", "linear_attention"}
    assert cfg.layer_types[-1] == "full_attention"
    assert cfg.head_dim != cfg.hidden_size // cfg.num_attention_heads
    assert cfg.num_attention_heads > cfg.num_key_value_heads
    assert cfg.linear_key_head_dim != cfg.linear_value_head_dim
    assert cfg.linear_num_value_heads == 2 * cfg.linear_num_key_heads
    assert cfg.num_experts >= 8 and cfg.num_experts_per_tok >= 2 and cfg.vocab_size == 512
    assert cfg.rope_parameters["rope_theta"] == 1e7 and cfg.rope_parameters["partial_rotary_factor"] == 0.25


def test_weights_are_bf16_exact_and_non_degenerate(tiny_hf_model):
    for name, p in tiny_hf_model.named_parameters():
        assert torch.equal(p, p.to(torch.bfloat16).float()), name
        assert p.std() > 0 or p.numel() == 1, name
    layer = tiny_hf_model.model.layers[0].linear_attn
    assert 0 < layer.A_log.min() and layer.A_log.max() < torch.log(torch.tensor(16.0))
    assert -7.5 < layer.dt_bias.min() and layer.dt_bias.max() < -2.0
    logits, _ = tiny_hf.oracle_forward(tiny_hf_model, list(range(1, 24)))
    assert logits.std() > 0.5  # far from the near-zero logits of the default init


def test_a_wrong_query_gate_split_moves_logits_by_order_one(tiny_hf_model):
    """The trap the init must expose: taking the first/last halves of q_proj instead of per head."""
    ids = list(range(3, 30))
    reference, _ = tiny_hf.oracle_forward(tiny_hf_model, ids)
    model = tiny_hf.build_tiny_model(seed=TINY_SEED)
    cfg = model.config
    for layer in model.model.layers:
        if hasattr(layer, "self_attn"):
            q = layer.self_attn.q_proj.weight.data
            halves = q.reshape(2, -1, q.shape[1])  # [all queries | all gates]
            per_head = torch.stack([halves[0].reshape(cfg.num_attention_heads, -1, q.shape[1]),
                                    halves[1].reshape(cfg.num_attention_heads, -1, q.shape[1])], dim=1)
            q.copy_(per_head.reshape_as(q))
    wrong, _ = tiny_hf.oracle_forward(model, ids)
    assert (wrong - reference).abs().max() > 0.5


def test_cache_helper_continues_a_sequence(tiny_hf_model):
    ids = [5, 17, 200, 33, 9, 480, 2, 77]
    full, _ = tiny_hf.oracle_forward(tiny_hf_model, ids)
    prefix, cache = tiny_hf.oracle_forward(tiny_hf_model, ids[:5])
    steps = [prefix[-1]]
    for token in ids[5:]:
        logits, cache = tiny_hf.oracle_forward(tiny_hf_model, [token], cache)
        steps.append(logits[-1])
    assert torch.allclose(torch.stack(steps), full[4:], atol=1e-4)
    assert tiny_hf.cache_keyword(tiny_hf_model) in ("cache", "past_key_values")
    assert tiny_hf.router_margin(tiny_hf_model, ids) > 1e-3


@pytest.mark.parametrize("layout", ["fused", "per_expert", "conditional"])
def test_checkpoints_reload_in_transformers(layout, tiny_hf_model, tmp_path):
    directory = tiny_hf.save_checkpoint(tmp_path, layout, shards=2 if layout == "conditional" else 1, seed=TINY_SEED)
    names = set(json.loads((directory / "model.safetensors.index.json").read_text())["weight_map"]) if layout == "conditional" else None
    modeling = tiny_hf.oracle_module()
    cls = modeling.Qwen3_5MoeForConditionalGeneration if layout == "conditional" else modeling.Qwen3_5MoeForCausalLM
    reloaded = cls.from_pretrained(directory, dtype=torch.float32).eval()
    ids = list(range(1, 12))
    assert torch.equal(tiny_hf.oracle_forward(reloaded, ids)[0], tiny_hf.oracle_forward(tiny_hf_model, ids)[0])
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja", "generation_config.json"):
        assert (directory / name).is_file()
    if layout == "conditional":
        assert any(n.startswith("model.language_model.layers.") for n in names)
        assert any(n.startswith("model.visual.blocks.") for n in names) and "mtp.fc.weight" in names
        assert (directory / "preprocessor_config.json").is_file()
    else:
        from safetensors import safe_open

        with safe_open(str(directory / "model.safetensors"), "pt") as f:
            keys = set(f.keys())
        fused = "model.layers.0.mlp.experts.gate_up_proj" in keys
        assert fused == (layout == "fused")
        assert ("mtp.layers.0.mlp.experts.gate_up_proj" in keys) == fused


_BINDING_PROBE = """
import sys
sys.path[:0] = sys.argv[1:3]
import tiny_hf
if sys.argv[3] == "helper":
    module = tiny_hf.oracle_module()
else:
    import importlib
    module = importlib.import_module("transformers.models.qwen3_5_moe.modeling_qwen3_5_moe")
fast = tiny_hf.binds_fast_kernel(module.torch_chunk_gated_delta_rule)
import fla.ops.gated_delta_rule  # still importable by the engine afterwards
print("fast" if fast else "torch")
"""


@pytest.mark.parametrize("how, bound", [("plain", "fast"), ("helper", "torch")])
def test_oracle_module_hides_an_installed_fla(how, bound, tmp_path):
    """With a (stand-in) flash-linear-attention installed, plain import binds it; the helper does not."""
    package = tmp_path / "fla" / "ops" / "gated_delta_rule"
    package.mkdir(parents=True)
    (tmp_path / "fla" / "__init__.py").write_text("")
    (tmp_path / "fla" / "ops" / "__init__.py").write_text("")
    (package / "__init__.py").write_text(
        "def chunk_gated_delta_rule(*args, **kwargs):\n    raise RuntimeError('CPU tensors in a Triton kernel')\n"
        "fused_recurrent_gated_delta_rule = chunk_gated_delta_rule\n"
    )
    tests = str(Path(__file__).parent)
    probe = [sys.executable, "-c", _BINDING_PROBE, str(tmp_path), tests, how]
    done = subprocess.run(probe, capture_output=True, text=True, timeout=300, cwd=tmp_path)  # not the source root: see conftest
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == bound
