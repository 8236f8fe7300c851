"""Conversion streams: peak RSS stays about 2x the largest tensor, and slicing does not change a byte."""

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
from ninfer_offload.convert import convert, encode

MIB = 1 << 20
BIG_VOCAB = 1 << 20  # embedding and head [2^20, 64] bf16: 128 MiB each, the rest of the model < 2 MiB

# Peak = VmHWM, the high-water mark of this process's own address space (ru_maxrss would also
# count the parent's peak, which a fork-exec'd child inherits on Linux).
_MEASURE = """
import json, sys
import psutil
from ninfer_offload.convert import convert

def hwm():
    with open("/proc/self/status") as status:
        return next(int(line.split()[1]) * 1024 for line in status if line.startswith("VmHWM:"))

before = psutil.Process().memory_info().rss
assert hwm() >= before
convert(sys.argv[1], sys.argv[2], recipe="bf16", progress=False)
print(json.dumps({"before": before, "peak": hwm()}))
"""


def _big_vocab_checkpoint(tiny_checkpoint, directory):
    shutil.copytree(tiny_checkpoint, directory)
    state = load_file(directory / "model.safetensors")
    generator = torch.Generator().manual_seed(1)
    for name in ("model.embed_tokens.weight", "lm_head.weight"):
        state[name] = torch.randn(BIG_VOCAB, 64, generator=generator).to(torch.bfloat16)
    save_file(state, directory / "model.safetensors")
    config = json.loads((directory / "config.json").read_text())
    (directory / "config.json").write_text(json.dumps({**config, "vocab_size": BIG_VOCAB}))
    return directory


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads VmHWM from /proc/self/status")
def test_peak_rss_is_about_twice_the_largest_tensor(tiny_checkpoint, tmp_path):
    """bf16 recipe, worst case: two consecutive 128 MiB objects (embedding, then head).

    Bound: the encoded previous object (still referenced while the next one is produced) + the
    current encoded object + a slice window. Reading whole tensors, or the whole checkpoint,
    would exceed it (>= 3x or 4x 128 MiB).
    """
    src = _big_vocab_checkpoint(tiny_checkpoint, tmp_path / "big")
    largest = BIG_VOCAB * 64 * 2
    done = subprocess.run([sys.executable, "-c", _MEASURE, str(src), str(tmp_path / "big.ninfer")],
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    rss = json.loads(done.stdout)
    growth = rss["peak"] - rss["before"]
    print(f"peak RSS growth {growth / MIB:.0f} MiB for a largest tensor of {largest / MIB:.0f} MiB")
    assert growth < 2 * largest + 96 * MIB
    with open_artifact(tmp_path / "big.ninfer") as artifact:
        assert artifact.object(artifact.bindings["text/output_head"].parts[0].object).bytes == largest


def test_slicing_sources_does_not_change_the_artifact(tiny_checkpoint, tmp_path, monkeypatch):
    """Tiny slices (a few rows, fused banks cut between experts) give byte-identical objects."""
    whole = convert(tiny_checkpoint, tmp_path / "whole.ninfer", recipe="official", progress=False)
    monkeypatch.setattr(encode, "CHUNK_ELEMENTS", 200)
    sliced = convert(tiny_checkpoint, tmp_path / "sliced.ninfer", recipe="official", progress=False)
    with open_artifact(whole) as a, open_artifact(sliced) as b:
        assert [o.id for o in a.objects] == [o.id for o in b.objects]
        for obj in a.objects:
            assert np.array_equal(a.payload(obj.id), b.payload(obj.id)), obj.id
