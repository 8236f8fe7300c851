"""The plan is a bound on the card: a load's peak VRAM (torch's peak allocated bytes plus what the process held
before any of them: the CUDA context and libraries) stays within the plan's VRAM use, resident and at 12, 15 and 20
GiB, with and without MTP, over a warm-up, a 4K-token prompt and decode steps. On the synthetic full-size artifact
(`bench/make_synthetic.py`, at $NINFER_SYNTHETIC or /tmp/q36.ninfer); skipped without CUDA or the artifact."""

from __future__ import annotations

import gc
import os
from pathlib import Path

import pytest
import torch

from ninfer_offload.runtime.engine import Engine

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]
SYNTHETIC = Path(os.environ.get("NINFER_SYNTHETIC", "/tmp/q36.ninfer"))
GiB = 2**30


def held_outside_torch() -> int:
    """VRAM this process holds besides torch's pool (the CUDA context, libraries' workspaces)."""
    gc.collect()
    torch.cuda.empty_cache()
    free, total = torch.cuda.mem_get_info()
    return total - free - torch.cuda.memory_reserved()


@pytest.mark.skipif(not SYNTHETIC.is_file(), reason=f"no synthetic artifact at {SYNTHETIC} (bench/make_synthetic.py)")
@pytest.mark.parametrize("budget_gib", [None, 12, 15, 20])
@pytest.mark.parametrize("spec", ["none", "mtp"])
def test_peak_vram_stays_within_the_plan(budget_gib, spec):
    context = held_outside_torch()
    budget = (torch.cuda.mem_get_info()[1] - 2 * GiB) if budget_gib is None else budget_gib * GiB  # None: the card, all resident
    torch.cuda.reset_peak_memory_stats()
    engine = Engine.load(SYNTHETIC, device="cuda", profile="auto", vram_budget=budget, spec=spec, max_context=8192)
    try:
        planned = engine.expert_plan.plan.vram_used_bytes
        engine.warm_up()
        session = engine.session()
        prompt = torch.randint(3, engine.config.vocab_size - 1, (4096,), generator=torch.Generator().manual_seed(5)).tolist()
        token = int(session.prefill(prompt).argmax())
        for _ in range(16):
            token = int(session.step(token).argmax())
        session.close()
        torch.cuda.synchronize()
        peak = torch.cuda.max_memory_allocated() + context
        assert peak <= planned, f"peak {peak / GiB:.2f} GiB over the plan's {planned / GiB:.2f} GiB"
    finally:
        engine.close()
