"""bench/prompt_cache.py on the CPU (tiny model, float32): every request of the chat and the agent runs cached and
cold with the same tokens, later requests resume saved prefixes, and the cache stays within its bounds."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


def test_prompt_cache_benchmark_runs_on_the_cpu(tiny_artifact, tmp_path):
    out = tmp_path / "prompt_cache.json"
    command = [
        sys.executable, "bench/prompt_cache.py", str(tiny_artifact), "--out", str(out), "--device", "cpu", "--chat-new", "20", "5",
        "--agent-context", "20", "--agent-calls", "3", "--agent-tails", "2", "4", "--max-tokens", "2", "--every", "16",
        "--max-context", "128", "--prompt-cache-vram", "1MiB", "--prompt-cache-host", "1MiB",
    ]
    done = subprocess.run(command, capture_output=True, text=True, cwd=REPO)
    assert done.returncode == 0, done.stderr[-2000:]
    report = json.loads(out.read_text())
    assert report["command"].startswith("python bench/prompt_cache.py") and report["commit"]
    [load] = report["loads"]
    assert len(load["chat"]) == 2 and len(load["agent"]) == 3
    summary = load["summary"]
    assert summary["all_same_tokens"] and summary["hit_rate"] > 0
    assert [row["cached_tokens"] for row in load["chat"]] == [0, 21]  # the first turn ended holding its prompt and 1 reply token
    assert summary["cache_device_bytes_max"] <= 2**20 and summary["cache_host_bytes_max"] <= 2**20
