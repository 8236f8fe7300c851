"""Provenance of a benchmark result: the command, the commit it measured, the machine and the date."""

from __future__ import annotations

import os
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


def host_speed() -> dict:
    """How fast this host runs the engine's host side, so runs on different hosts compare: microseconds per
    torch operator call on a tiny CPU tensor (the dispatch every launch pays) and nanoseconds per Python loop
    step, each the best of 5. (The H200 host measured imports and the host-bound prefill 2x slower on some days.)"""
    import torch

    x = torch.zeros(4)

    def best(run, count: int) -> float:
        timings = []
        for _ in range(5):
            began = time.perf_counter()
            run(count)
            timings.append((time.perf_counter() - began) / count)
        return min(timings)

    def dispatch(count: int) -> None:
        for _ in range(count):
            x.view(-1)

    def loop(count: int) -> None:
        total = 0
        for i in range(count):
            total += i

    return {"torch_op_us": best(dispatch, 20_000) * 1e6, "python_loop_ns": best(loop, 200_000) * 1e9, "cpus": os.cpu_count()}


def gpu_report_header(commit: str | None = None) -> dict:
    """`command`, `commit` (given, for a copy without git metadata, else HEAD), `gpu`, `date`, `torch`, `host` (`host_speed`)
    of a GPU benchmark run."""
    import torch

    return {
        "command": " ".join(["python", f"bench/{Path(sys.argv[0]).name}", *sys.argv[1:]]),
        "commit": commit or git_commit(),
        "gpu": torch.cuda.get_device_name() if torch.cuda.is_available() else "none (cpu)",
        "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "torch": torch.__version__,
        "host": host_speed(),
    }
