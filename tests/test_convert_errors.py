"""Bad input to `convert` / `ninfer convert`: one-line errors naming the cause, nothing half-written."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys

import pytest
import torch
from safetensors.torch import load_file, save_file
from ninfer_offload.convert.tiny_tokenizer import write_tokenizer_files

from ninfer_offload import open_artifact
from ninfer_offload.convert import convert
from ninfer_offload.errors import NinferError

EXPERT = "model.layers.1.mlp.experts.gate_up_proj"


def _edited(checkpoint, directory, tensors=None, config=None, drop_files=()):
    """A copy of `checkpoint` with `tensors(dict) -> dict` / `config(dict) -> dict` applied."""
    shutil.copytree(checkpoint, directory)
    if tensors is not None:
        state = load_file(directory / "model.safetensors")
        save_file(tensors(state), directory / "model.safetensors")
    if config is not None:
        path = directory / "config.json"
        path.write_text(json.dumps(config(json.loads(path.read_text()))))
    for name in drop_files:
        (directory / name).unlink()
    return directory


def _without(name):
    return lambda state: {k: v for k, v in state.items() if k != name}


def _replaced(name, value):
    return lambda state: {**state, name: value}


def _assert_nothing_written(out_dir):
    assert list(out_dir.iterdir()) == []


@pytest.mark.parametrize(
    "edit, message",
    [
        (dict(config=lambda c: {**c, "architectures": ["Qwen3NextForCausalLM"]}), "unsupported architecture Qwen3NextForCausalLM"),
        (dict(config=lambda c: {k: v for k, v in c.items() if k != "moe_intermediate_size"}), "missing 'moe_intermediate_size'"),
        (dict(tensors=_without("model.layers.3.linear_attn.A_log")), "missing tensor 'model.layers.3.linear_attn.A_log'"),
        (dict(tensors=_without(EXPERT)), f"missing tensor '{EXPERT}'"),
        (
            dict(tensors=_replaced("model.layers.2.self_attn.q_proj.weight", torch.zeros(128, 64, dtype=torch.bfloat16))),
            r"tensor 'model.layers.2.self_attn.q_proj.weight' has shape \[128, 64\], expected \[256, 64\]",
        ),
        (
            dict(tensors=_replaced("model.layers.0.self_attn.q_proj.bias", torch.zeros(4))),
            "'model.layers.0.self_attn.q_proj.bias' is not part",
        ),
        (dict(tensors=_replaced("model.norm.weight", torch.zeros(64, dtype=torch.int32))), "dtype I32"),
        (dict(drop_files=("tokenizer.json",)), "missing tokenizer.json"),
        (dict(drop_files=("chat_template.jinja",)), "missing chat_template.jinja"),
    ],
)
def test_bad_checkpoints_fail_with_one_line_and_write_nothing(edit, message, tiny_checkpoint, tmp_path):
    src = _edited(tiny_checkpoint, tmp_path / "src", **edit)
    out_dir = tmp_path / "out"
    out_dir.mkdir()
    with pytest.raises(NinferError, match=message) as info:
        convert(src, out_dir / "a.ninfer", recipe="q8", progress=False)
    assert "\n" not in str(info.value)
    _assert_nothing_written(out_dir)


def test_failure_while_streaming_leaves_no_file(tiny_checkpoint, tmp_path):
    """A non-finite weight is only found when its object is encoded, after other objects were written."""
    nan_bank = torch.full((8, 64, 64), float("nan"), dtype=torch.bfloat16)
    src = _edited(tiny_checkpoint, tmp_path / "src", tensors=_replaced("model.layers.5.mlp.experts.gate_up_proj", nan_bank))
    out_dir = tmp_path / "out"
    out_dir.mkdir()
    with pytest.raises(NinferError, match="model.layers.5.mlp.experts.gate_up_proj.*non-finite"):
        convert(src, out_dir / "a.ninfer", recipe="official", max_file_bytes=100_000, progress=False)
    _assert_nothing_written(out_dir)


def test_existing_output_is_never_replaced(tiny_checkpoint, tmp_path):
    out = tmp_path / "a.ninfer"
    out.write_bytes(b"keep me")
    with pytest.raises(NinferError, match="already exists"):
        convert(tiny_checkpoint, out, recipe="bf16", progress=False)
    assert out.read_bytes() == b"keep me"
    with pytest.raises(NinferError, match="nowhere: not a directory"):
        convert(tmp_path / "nowhere", tmp_path / "b.ninfer", recipe="bf16", progress=False)
    with pytest.raises(NinferError, match="output directory does not exist"):
        convert(tiny_checkpoint, tmp_path / "missing" / "b.ninfer", recipe="bf16", progress=False)
    with pytest.raises(NinferError, match="unknown recipe 'q3'"):
        convert(tiny_checkpoint, tmp_path / "b.ninfer", recipe="q3", progress=False)


def test_chat_template_inside_tokenizer_config(tiny_checkpoint, tmp_path):
    src = _edited(tiny_checkpoint, tmp_path / "src", drop_files=("chat_template.jinja",))
    write_tokenizer_files(src, vocab_size=512, template_in_config=True)
    assert not (src / "chat_template.jinja").exists()
    template = json.loads((src / "tokenizer_config.json").read_text())["chat_template"]
    with open_artifact(convert(src, tmp_path / "a.ninfer", recipe="bf16", progress=False)) as artifact:
        assert artifact.resource("chat_template.jinja") == template.encode()


def _cli(*args):
    return subprocess.run([sys.executable, "-m", "ninfer_offload", "convert", *map(str, args)], capture_output=True, text=True, timeout=300)


def test_cli_end_to_end(tiny_checkpoint, tmp_path):
    out = tmp_path / "tiny.ninfer"
    done = _cli(tiny_checkpoint, out, "--recipe", "q8", "--max-file-bytes", "300000", "--no-progress")
    assert done.returncode == 0, done.stderr
    assert done.stdout.startswith(f"wrote {out} (text, mtp;")
    with open_artifact(out) as artifact:
        assert artifact.version == 3 and len(artifact.directory["files"]) > 1
        assert artifact.object(artifact.bindings["text/token_embedding"].parts[0].object).format == "q8_g32_fp16"
    again = _cli(tiny_checkpoint, out)
    assert again.returncode == 2
    assert again.stderr.strip() == f"error: {out} already exists; remove it or choose another output path"


def test_unreadable_checkpoint_files(tiny_checkpoint, tmp_path):
    src = _edited(tiny_checkpoint, tmp_path / "src", drop_files=("config.json",))
    with pytest.raises(NinferError, match="config.json: not found"):
        convert(src, tmp_path / "a.ninfer", progress=False)
    src = _edited(tiny_checkpoint, tmp_path / "garbage")
    (src / "model.safetensors").write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00not json at all!")
    with pytest.raises(NinferError, match="not a valid safetensors file"):
        convert(src, tmp_path / "b.ninfer", progress=False)
    src = _edited(tiny_checkpoint, tmp_path / "sharded")
    index = {"weight_map": {"model.norm.weight": "model-00001-of-00002.safetensors", "lm_head.weight": "model.safetensors"}}
    (src / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(NinferError, match="model-00001-of-00002.safetensors: not found"):
        convert(src, tmp_path / "c.ninfer", progress=False)
    assert not list(tmp_path.glob("*.ninfer*"))
