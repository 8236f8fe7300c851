"""bench/serve.py on the CPU (tiny model): a served batch at a VRAM budget with trace routing reports the budget,
the routing, the expert cache over the burst and its fairness."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
CONTEXT = 256


def _half_expert_budget(artifact: Path, card: Path, sequences: int) -> int:
    """A VRAM budget on `card` holding all but half of the routed experts (and the embedding) for `sequences`
    sequences of CONTEXT tokens, plus the prefill staging buffer of an offloaded load."""
    from ninfer_offload import Engine
    from ninfer_offload.planner.memory import prefill_staging_slots

    full = Engine.load(artifact, profile=str(card), max_sequences=sequences, max_context=CONTEXT, spec="none")
    plan, experts = full.expert_plan.plan, full.config.num_experts
    full.close()
    staging = prefill_staging_slots(experts) * max(plan.expert_bytes)
    return plan.vram_used_bytes - plan.components["token_embedding"].bytes - plan.components["routed_experts"].bytes // 2 + staging


def test_serve_benchmark_at_a_budget_with_trace_routing(tiny_artifact_official, small_card, tmp_path):
    out = tmp_path / "serve.json"
    budget = _half_expert_budget(tiny_artifact_official, small_card, 2)
    command = [
        sys.executable, "bench/serve.py", str(tiny_artifact_official), "--out", str(out), "--device", "cpu", "--clients", "2",
        "--max-tokens", "6", "--bursts", "1", "--routing", "trace", "--vram-budget", f"{budget}B",
        f"--serve-arg=--profile={small_card}", f"--serve-arg=--max-context={CONTEXT}",
    ]
    done = subprocess.run(command, capture_output=True, text=True, cwd=REPO)
    assert done.returncode == 0, done.stderr[-2000:]
    report = json.loads(out.read_text())
    assert report["routing"] == "trace" and report["vram_budget_bytes"] == budget
    level = report["levels"][0]
    assert level["clients"] == 2 and len(level["tokens"]) == 2 and all(1 <= n <= 6 for n in level["tokens"])
    assert 0 < level["expert_hit_rate"] < 1 and level["pcie_bytes_per_step"] > 0 and level["pcie_bytes_per_token"] > 0
    assert level["steps"] >= max(level["tokens"])
    assert level["cpu_assignments_per_step"] == 0  # no CPU miss path: every miss over PCIe
    assert level["decode_tok_s_spread"] >= 1 and level["server_decode_tok_s_spread"] >= 1
    assert level["admission_stall_max_s"] >= 0 and level["inter_token_p50_s"] > 0
