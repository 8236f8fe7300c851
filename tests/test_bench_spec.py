"""bench/spec.py on the CPU (tiny model, float32; drafting with the full output head or the proposal head):
every draft count is measured, and the draft oracle's drafts, the plain greedy continuation, are all
accepted at the first attempt (greedy speculation equals plain greedy in float32)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent


@pytest.mark.parametrize("artifact,flags", [("tiny_artifact_official", []), ("tiny_artifact_proposal", ["--proposal-head"])])
def test_spec_benchmark_runs_on_the_cpu(artifact, flags, request, tmp_path):
    """With the full output head, and drafting with the artifact's proposal head."""
    out = tmp_path / "spec.json"
    command = [sys.executable, "bench/spec.py", str(request.getfixturevalue(artifact)), "--out", str(out), "--device", "cpu",
               "--budgets", "--repeats", "2", "--tokens", "20", "--routing", "model", *flags]
    done = subprocess.run(command, capture_output=True, text=True, cwd=REPO)
    assert done.returncode == 0, done.stderr[-2000:]
    report = json.loads(out.read_text())
    assert report["proposal_head"] == bool(flags)
    runs = report["runs"]
    assert [run["draft_tokens"] for run in runs] == [1, 2, 3, 4, 5]
    for run in runs:
        assert run["oracle_attempts"] == 1 and run["oracle_acceptance"] == 1.0
        assert run["verify_step_ratio"] > 0 and run["projected_speedup"] > 0 and run["plain_s"] > 0
        assert run["verify_step_ratio"] == pytest.approx(run["verify_s"] / run["step_beside_verify_s"])
