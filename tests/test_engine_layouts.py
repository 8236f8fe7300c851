"""Checkpoints in the other layouts (per-expert tensors; ConditionalGeneration with `model.language_model.*`,
a vision tower, shards, and an artifact split into parts) run to transformers' logits."""

from __future__ import annotations

import pytest
import tiny_hf
import torch

from ninfer_offload import Engine
from ninfer_offload.convert import convert

PROMPT = torch.randint(0, 512, (16,), generator=torch.Generator().manual_seed(11)).tolist()


@pytest.mark.parametrize("layout", ["per_expert", "conditional"])
def test_layout_runs_to_transformers_logits(layout, tmp_path):
    model = tiny_hf.build_tiny_model(seed=0, layout=layout)
    checkpoint = tiny_hf.save_checkpoint(tmp_path / "checkpoint", layout, shards=2 if layout == "conditional" else 1)
    max_file_bytes = 1 << 20 if layout == "conditional" else None  # several part files
    path = convert(checkpoint, tmp_path / "model.ninfer", recipe="bf16", max_file_bytes=max_file_bytes, progress=False)
    if max_file_bytes:
        assert len(list(tmp_path.glob("model.ninfer.part-*"))) >= 1
    engine = Engine.load(path)
    ref, cache = tiny_hf.oracle_forward(model, PROMPT)
    ours = engine.logits(PROMPT)
    assert (ours - ref).abs().max().item() <= 1e-5 * max(1.0, ref.abs().max().item())
    session = engine.session()
    session.prefill(PROMPT)
    token = int(ref[-1].argmax())
    for _ in range(4):
        ref_step, cache = tiny_hf.oracle_forward(model, [token], cache)
        step = session.step(token)
        assert int(step.argmax()) == int(ref_step[0].argmax())
        assert (step - ref_step[0]).abs().max().item() <= 1e-4 * max(1.0, ref_step.abs().max().item())
        token = int(ref_step[0].argmax())
    engine.close()
