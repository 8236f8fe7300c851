"""A VRAM budget too small for --max-concurrency sequences at --max-context is refused before the load, in one
line naming the largest concurrency that fits; that many load, one more does not."""

from __future__ import annotations

import re
import subprocess
import sys

import pytest

from ninfer_offload import Engine, NinferError

CONTEXT = 256
ASKED = 16


@pytest.fixture(scope="module")
def one_sequence_budget(tiny_artifact_official, small_card) -> int:
    """What the plan of one sequence of CONTEXT tokens uses on `small_card`: room for a few sequences, not for ASKED."""
    engine = Engine.load(tiny_artifact_official, profile=str(small_card), max_context=CONTEXT, spec="none")
    used = engine.expert_plan.plan.vram_used_bytes
    engine.close()
    return used


def _load(artifact, card, budget: int, sequences: int) -> Engine:
    return Engine.load(artifact, profile=str(card), vram_budget=budget, max_context=CONTEXT, max_sequences=sequences, spec="none")


def test_serve_refuses_too_many_sequences_naming_the_most_that_fit(tiny_artifact_official, small_card, one_sequence_budget):
    run = subprocess.run(
        [sys.executable, "-m", "ninfer_offload", "serve", str(tiny_artifact_official), "--profile", str(small_card),
         "--vram-budget", f"{one_sequence_budget}B", "--max-context", str(CONTEXT), "--max-concurrency", str(ASKED), "--port", "0"],
        capture_output=True, text=True, timeout=120,
    )
    lines = run.stderr.strip().splitlines()
    assert run.returncode == 2 and lines[-1].startswith("error: cannot load for small_card: "), run.stderr
    assert not any(" loaded " in line for line in lines), run.stderr  # refused before any weight was read
    found = re.search(rf"{ASKED} sequences of {CONTEXT} tokens do not fit, at most (\d+) do \(--max-concurrency (\d+)\)", lines[-1])
    assert found and found[1] == found[2], lines[-1]
    fitting = int(found[1])
    assert 1 <= fitting < ASKED
    _load(tiny_artifact_official, small_card, one_sequence_budget, fitting).close()
    with pytest.raises(NinferError, match=rf"at most {fitting} do \(--max-concurrency {fitting}\)"):
        _load(tiny_artifact_official, small_card, one_sequence_budget, fitting + 1)


def test_one_sequence_that_does_not_fit_gets_the_plans_reason(tiny_artifact_official, small_card, one_sequence_budget):
    with pytest.raises(NinferError, match="cannot load for small_card: needs .* VRAM") as refused:
        Engine.load(tiny_artifact_official, profile=str(small_card), vram_budget=one_sequence_budget // 2, max_context=CONTEXT, spec="none")
    assert "--max-concurrency" not in str(refused.value)
