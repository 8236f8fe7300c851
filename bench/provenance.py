"""Provenance of a benchmark result: the commit it measured."""

from __future__ import annotations

import subprocess


def git_commit() -> str:
    """HEAD of the checkout the script runs in ("unknown" outside one)."""
    try:
        return subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True, check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"
