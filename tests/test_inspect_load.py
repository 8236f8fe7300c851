"""`ninfer inspect --verify` checks what a load needs: a file it passes loads, a file `generate` refuses fails it."""

from __future__ import annotations

import json
import shutil
import struct
import subprocess
import sys

import pytest

from ninfer_offload.artifact.formats import align_up

HEADER = 32


def ninfer(*args) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "ninfer_offload", *map(str, args)], capture_output=True, text=True, timeout=300)


def _entry(path) -> tuple[bytes, dict, int, bytes]:
    """(header, JSON root, payload start, payload) of a single-file v3 artifact."""
    raw = path.read_bytes()
    (json_bytes,) = struct.unpack("<Q", raw[8:16])
    start = align_up(HEADER + json_bytes, 4096)
    return raw[:HEADER], json.loads(raw[HEADER : HEADER + json_bytes]), start, raw[start:]


def _edit_directory(path, change) -> None:
    """Rewrite the JSON directory after `change(root)`, around the same payload."""
    header, root, _, payload = _entry(path)
    change(root)
    text = json.dumps(root).encode()
    gap = align_up(HEADER + len(text), 4096) - HEADER - len(text)
    path.write_bytes(header[:8] + struct.pack("<Q", len(text)) + header[16:] + text + bytes(gap) + payload)


def drop_binding(root) -> None:
    del root["bindings"]["text/final_norm"]


def shrink_binding(root) -> None:
    """text/layers/1/input_norm bound to half of its vector."""
    binding = root["bindings"]["text/layers/1/input_norm"]
    obj = binding.pop("object", None) or binding["parts"][0]["object"]
    hidden = next(o["shape"][0] for o in root["objects"] if o["id"] == obj)
    root["bindings"]["text/layers/1/input_norm"] = {"parts": [{"object": obj, "range": [0, hidden // 2]}]}


def break_tokenizer(path) -> None:
    """tokenizer.json's bytes replaced by as many bytes of text that is not a tokenizer."""
    _, root, start, _ = _entry(path)
    obj = next(o for o in root["objects"] if o["id"] == root["components"]["text"]["resources"]["tokenizer.json"])
    with open(path, "r+b") as f:
        f.seek(start + obj["offset"])
        f.write(b"{" + b" " * (obj["bytes"] - 1))


@pytest.fixture
def artifact(tiny_artifact_official, tmp_path):
    return shutil.copy(tiny_artifact_official, tmp_path / "model.ninfer")


def test_verify_passes_a_loadable_file(artifact):
    run = ninfer("inspect", artifact, "--verify")
    assert run.returncode == 0, run.stderr
    assert "the resources parse and every binding the loader reads resolves with its shape" in run.stdout
    report = json.loads(ninfer("inspect", artifact, "--verify", "--json").stdout)
    assert report["verify"]["problems"] == {} and report["verify"]["load_problems"] == []


@pytest.mark.parametrize(
    "damage, found",
    [
        (lambda path: _edit_directory(path, drop_binding), "has no binding 'text/final_norm'"),
        (lambda path: _edit_directory(path, shrink_binding), "binding 'text/layers/1/input_norm' has shape [32], expected [64]"),
        (break_tokenizer, "tokenizer.json cannot be loaded"),
    ],
    ids=["missing binding", "binding of the wrong shape", "broken tokenizer"],
)
def test_verify_refuses_what_generate_refuses(damage, found, artifact):
    damage(artifact)
    generate = ninfer("generate", artifact, "--prompt-ids", "1,2,3", "--max-tokens", "1")
    assert generate.returncode == 2 and found in generate.stderr, generate.stderr
    verify = ninfer("inspect", artifact, "--verify")
    assert verify.returncode == 2, verify.stdout
    lines = verify.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: verify: generate and serve would refuse this artifact") and found in lines[0]
    assert "verify: all 96 tensors decode with valid codes and scales" in verify.stdout  # the payload itself is fine
