"""`ninfer plan` when no single card serves the load: the vLLM tensor-parallel recipe with the K that fits."""

from __future__ import annotations

import subprocess
import sys

from ninfer_offload.artifact.contract import official_directory
from ninfer_offload.artifact.inventory import Inventory
from ninfer_offload.planner import PlanOptions
from ninfer_offload.planner.tensor_parallel import GPU_MEMORY_UTILIZATION, tensor_parallel_plan
from ninfer_offload.profiles import load_profile

GiB = 2**30
INVENTORY = Inventory.from_directory(official_directory())


def test_the_fewest_cards_that_hold_the_checkpoint_and_the_sequences():
    card = load_profile("rtx5090")
    one = tensor_parallel_plan(INVENTORY, card, PlanOptions(concurrency=1, max_context=32768))
    assert 60 * GiB < one.weights_bytes < 70 * GiB  # about 35B parameters in bf16
    assert one.cards == 4  # 67 GiB / 2 = 33.5 GiB per card does not fit 0.9 x 32 GiB; a quarter does
    assert one.weights_bytes / 2 > GPU_MEMORY_UTILIZATION * card.vram_bytes
    many = tensor_parallel_plan(INVENTORY, card, PlanOptions(concurrency=8, max_context=262144, kv_dtype="bf16"))
    assert many.cards == 8 and many.state_bytes > 8 * one.state_bytes
    assert "--tensor-parallel-size 8 --max-model-len 262144 --max-num-seqs 8 --speculative-config" in many.command
    assert "--kv-cache-dtype fp8" in one.command and "--kv-cache-dtype" not in many.command
    assert """--speculative-config '{"method": "mtp", "num_speculative_tokens": 3}'""" in many.command
    too_many = tensor_parallel_plan(INVENTORY, card, PlanOptions(concurrency=64, max_context=262144, kv_dtype="bf16"))
    assert too_many.cards is None and too_many.command is None


def test_plan_prints_the_way_out_when_no_card_serves_it():
    result = subprocess.run(
        [sys.executable, "-m", "ninfer_offload", "plan", "--concurrency", "8", "--context", "262144", "--kv-dtype", "bf16"],
        capture_output=True, text=True, timeout=120,
    )
    assert result.returncode == 2 and result.stderr.startswith("error: needs")
    assert "no single rtx5090 serves 8 sequences of 262,144 tokens; vLLM serving the Hugging Face checkpoint" in result.stdout
    assert "  vllm serve Qwen/Qwen3.6-35B-A3B --tensor-parallel-size 8 --max-model-len 262144 --max-num-seqs 8" in result.stdout
