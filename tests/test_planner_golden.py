"""`ninfer plan` for the four shipped profiles at 80 columns, against golden files.

Regenerate after an intended change (and read the diff):
    for p in h200 rtx5060ti rtx5090 rtxpro6000; do COLUMNS=80 .venv/bin/python -m ninfer_offload plan --profile $p \
        > tests/golden/plan_$p.txt; done
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

GOLDEN = Path(__file__).parent / "golden"


@pytest.mark.parametrize("profile", ["h200", "rtx5060ti", "rtx5090", "rtxpro6000"])
def test_plan_matches_its_golden_output(profile):
    result = subprocess.run(
        [sys.executable, "-m", "ninfer_offload", "plan", "--profile", profile],
        capture_output=True, text=True, timeout=120, env={**os.environ, "COLUMNS": "80"},
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout == (GOLDEN / f"plan_{profile}.txt").read_text()
    if profile != "h200":  # config text is printed as it is, rich markup included
        assert "has no complete [engine] table" in result.stdout.replace("\n ", " ")
