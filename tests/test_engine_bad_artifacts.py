"""Artifacts the engine cannot run give one-line errors naming what is wrong (API and CLI)."""

from __future__ import annotations

import subprocess
import sys

import pytest

from ninfer_offload import ArtifactError, Engine, NinferError, open_artifact
from ninfer_offload.artifact.writer import ArtifactWriter


def rewrite(src, dst, bindings=None, text_config=None):
    """Copy artifact `src` to `dst` with edited bindings ({name: binding JSON or None to drop}) and
    text config (keys merged over the original)."""
    with open_artifact(src) as artifact:
        root = artifact.directory
        writer = ArtifactWriter(dst)
        for cid, component in root["components"].items():
            config = {**component["config"], **(text_config or {})} if cid == "text" else component["config"]
            writer.add_component(cid, config, component.get("target"), component.get("proposal"))
        roles = {oid: (cid, role) for cid, c in root["components"].items() for role, oid in c.get("resources", {}).items()}
        for obj in root["objects"]:
            data = artifact.payload(obj["id"]).copy()
            if obj["kind"] == "resource":
                writer.add_resource(obj["id"], data.tobytes(), *roles[obj["id"]])
            else:
                writer.add_tensor(obj["id"], obj["shape"], obj["format"], obj["layout"], lambda data=data: data)
        edits = bindings or {}
        for name, binding in root["bindings"].items():
            binding = edits.get(name, binding)
            if binding is None:
                continue
            if "object" in binding:
                writer.bind(name, binding["object"])
            else:
                writer.bind_parts(name, [(p["object"], *p["range"]) for p in binding["parts"]])
        for use in root["uses"]:
            if edits.get(use["parameter"], True) is not None:
                writer.use(use["parameter"], use["input"], use.get("activation_policy", "A16Only"))
        return writer.write()


def test_missing_tensor_is_named(tiny_artifact, tmp_path):
    path = rewrite(tiny_artifact, tmp_path / "missing.ninfer", bindings={"text/layers/1/gdn/z": None})
    with pytest.raises(ArtifactError, match="text/layers/1/gdn/z") as err:
        Engine.load(path)
    assert "\n" not in str(err.value)


def test_misshaped_tensor_is_named(tiny_artifact, tmp_path):
    with open_artifact(tiny_artifact) as artifact:
        parts = artifact.directory["bindings"]["text/layers/0/gdn/a_projection"]["parts"]
    begin, end = parts[0]["range"]
    bad = {"parts": [{"object": parts[0]["object"], "range": [begin, end - 64]}]}  # one row short
    path = rewrite(tiny_artifact, tmp_path / "misshaped.ninfer", bindings={"text/layers/0/gdn/a_projection": bad})
    with pytest.raises(ArtifactError, match="text/layers/0/gdn/a_projection.*expected"):
        Engine.load(path)


def test_unsupported_architecture_cli_one_line(tiny_artifact, tmp_path):
    path = rewrite(tiny_artifact, tmp_path / "llama.ninfer", text_config={"architectures": ["LlamaForCausalLM"]})
    with pytest.raises(NinferError, match="unsupported architecture"):
        Engine.load(path)
    result = subprocess.run(
        [sys.executable, "-m", "ninfer_offload", "generate", str(path), "--prompt-ids", "1,2,3", "--max-tokens", "2"],
        capture_output=True,
        text=True,
    )
    assert result.returncode == 2
    assert result.stderr.strip().count("\n") == 0 and "unsupported architecture" in result.stderr
