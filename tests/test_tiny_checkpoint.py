"""`ninfer tiny`: one builder for the command and the tests, needing no transformers."""

from __future__ import annotations

import subprocess
import sys

import torch
from conftest import TINY_SEED
from safetensors.torch import load_file

from ninfer_offload.convert.tiny import checkpoint_tensors, tiny_config

FILES = {
    "config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json", "chat_template.jinja", "generation_config.json",
    "ranking.counts.i64",
}

# `ninfer tiny` with transformers unimportable (it is only in the test extra).
WITHOUT_TRANSFORMERS = (
    "import sys; sys.modules['transformers'] = None; sys.argv = ['ninfer', *sys.argv[1:]]\n"
    "from ninfer_offload.cli import entry\nentry()"
)


def _tiny(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", WITHOUT_TRANSFORMERS, "tiny", *args], capture_output=True, text=True, timeout=120)


def test_tiny_writes_the_package_checkpoint_without_transformers(tmp_path):
    target = tmp_path / "tiny"
    run = _tiny(str(target), "--seed", "3")
    assert run.returncode == 0, run.stderr
    assert run.stdout.startswith(f"wrote {target}: a random Qwen3_5MoeForCausalLM with 6 layers")
    assert {p.name for p in target.iterdir()} == FILES
    expected = checkpoint_tensors(tiny_config(), seed=3)
    stored = load_file(target / "model.safetensors")
    assert stored.keys() == expected.keys() and any(name.startswith("mtp.") for name in stored)
    assert all(stored[name].dtype == torch.bfloat16 and torch.equal(stored[name].float(), expected[name]) for name in stored)


def test_tiny_never_writes_into_a_used_directory(tmp_path):
    (tmp_path / "used").mkdir()
    (tmp_path / "used" / "notes.txt").write_text("mine")
    run = _tiny(str(tmp_path / "used"))
    assert run.returncode == 2
    assert run.stderr.strip() == f"error: {tmp_path / 'used'} already exists and is not an empty directory; choose a new one"
    assert [p.name for p in (tmp_path / "used").iterdir()] == ["notes.txt"]


def test_the_transformers_oracle_holds_the_package_weights(tiny_hf_model):
    """tests/tiny_hf.py builds no weights of its own: its model holds those of `ninfer tiny`."""
    expected = checkpoint_tensors(tiny_config(), mtp=False, seed=TINY_SEED)
    state = tiny_hf_model.state_dict()
    assert state.keys() == expected.keys()
    assert all(torch.equal(state[name], expected[name]) for name in state)


def test_per_tensor_seeds_make_layouts_agree():
    """The text weights of the nested (ConditionalGeneration) layout are those of the flat one."""
    flat = checkpoint_tensors(tiny_config("fused"), seed=0)
    nested = checkpoint_tensors(tiny_config("conditional"), seed=0)
    for name, value in flat.items():
        assert torch.equal(nested[name.replace("model.", "model.language_model.", 1)], value), name
    assert any(name.startswith("model.visual.") for name in nested)
    per_expert = checkpoint_tensors(tiny_config("per_expert"), "per_expert", seed=0)
    gate_up = flat["model.layers.0.mlp.experts.gate_up_proj"]
    assert torch.equal(per_expert["model.layers.0.mlp.experts.3.up_proj.weight"], gate_up[3, gate_up.shape[1] // 2 :])
