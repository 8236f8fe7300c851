"""bench/spec.py on the CPU (tiny model, float32): every draft count is measured, and the draft oracle's
drafts, the plain greedy continuation, are all accepted at the first attempt (greedy speculation equals
plain greedy in float32)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


def test_spec_benchmark_runs_on_the_cpu(tiny_artifact_official, tmp_path):
    out = tmp_path / "spec.json"
    command = [sys.executable, "bench/spec.py", str(tiny_artifact_official), "--out", str(out), "--device", "cpu", "--budgets",
               "--repeats", "2", "--tokens", "20", "--routing", "model"]
    done = subprocess.run(command, capture_output=True, text=True, cwd=REPO)
    assert done.returncode == 0, done.stderr[-2000:]
    runs = json.loads(out.read_text())["runs"]
    assert [run["draft_tokens"] for run in runs] == [1, 2, 3, 4, 5]
    for run in runs:
        assert run["oracle_attempts"] == 1 and run["oracle_acceptance"] == 1.0
        assert run["verify_step_ratio"] > 0 and run["projected_speedup"] > 0
