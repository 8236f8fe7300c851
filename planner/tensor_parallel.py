"""When one card is not enough: how many cards of a profile vLLM needs to serve the model's Hugging Face
checkpoint with tensor parallelism and MTP for `concurrency` sequences of `max_context` tokens.

Per card: the bf16 checkpoint (text, MTP and vision weights: every parameter in 2 bytes) split K ways, the KV
cache (fp8 where the plan's is, else bf16) of every sequence split over at most the model's KV heads (beyond
that each card holds a copy of a head), and the GDN state split K ways, within vLLM's default share of the
card (`--gpu-memory-utilization` 0.9). Activations are not counted: a first estimate for choosing K, not a plan.
"""

from __future__ import annotations

from dataclasses import dataclass

from ninfer_offload.artifact.dims import ModelDims
from ninfer_offload.artifact.formats import elements
from ninfer_offload.artifact.inventory import Inventory
from ninfer_offload.planner.memory import BF16, gdn_state_bytes, kv_layer_bytes_per_token
from ninfer_offload.planner.options import PlanOptions
from ninfer_offload.profiles import DeviceProfile

CHECKPOINT = "Qwen/Qwen3.6-35B-A3B"
CHECKPOINT_COMPONENTS = ("text", "mtp", "vision")  # what the Hugging Face checkpoint holds
GPU_MEMORY_UTILIZATION = 0.9  # vLLM's default share of each card
TENSOR_PARALLEL_SIZES = (1, 2, 4, 8)


@dataclass(frozen=True)
class TensorParallelPlan:
    """The fewest cards that hold the load (None: more than 8), the checkpoint's and the sequences' bytes, and the
    command that serves it."""

    cards: int | None
    weights_bytes: int
    state_bytes: int
    command: str | None


def tensor_parallel_plan(inventory: Inventory, profile: DeviceProfile, options: PlanOptions) -> TensorParallelPlan:
    """The vLLM load for `options.concurrency` sequences of `options.max_context` tokens on cards of `profile`."""
    dims = ModelDims.from_text_config(inventory.text_config)
    weights = BF16 * sum(elements(t.shape) for t in inventory.tensors if t.component in CHECKPOINT_COMPONENTS)
    tokens = options.concurrency * options.max_context
    kv_dtype = "fp8" if options.kv_dtype == "fp8" else "bf16"
    kv = dims.num_attention_layers * tokens * kv_layer_bytes_per_token(dims, kv_dtype)
    gdn = options.concurrency * gdn_state_bytes(dims)
    room = GPU_MEMORY_UTILIZATION * profile.vram_bytes
    cards = next(
        (k for k in TENSOR_PARALLEL_SIZES if weights / k + kv / min(k, dims.num_kv_heads) + gdn / k <= room), None
    )
    command = None
    if cards is not None:
        command = (
            f"vllm serve {CHECKPOINT} --tensor-parallel-size {cards} --max-model-len {options.max_context} "
            f"--max-num-seqs {options.concurrency} " + ("--kv-cache-dtype fp8 " if kv_dtype == "fp8" else "") +
            f"--speculative-config '{{\"method\": \"mtp\", \"num_speculative_tokens\": {options.drafts}}}'"
        )
    return TensorParallelPlan(cards, weights, kv + gdn, command)
