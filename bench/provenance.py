"""Provenance of a benchmark result: the command, the commit it measured, the machine and the date."""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path


def git_commit() -> str:
    """HEAD of the checkout the script runs in ("unknown" outside one)."""
    try:
        return subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True, check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def gpu_report_header(commit: str | None = None) -> dict:
    """`command`, `commit` (given, for a copy without git metadata, else HEAD), `gpu`, `date`, `torch` of a GPU benchmark run."""
    import torch

    return {
        "command": " ".join(["python", f"bench/{Path(sys.argv[0]).name}", *sys.argv[1:]]),
        "commit": commit or git_commit(),
        "gpu": torch.cuda.get_device_name() if torch.cuda.is_available() else "none (cpu)",
        "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "torch": torch.__version__,
    }
