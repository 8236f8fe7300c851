"""One memory model: the planner's accounting (`planner.memory`) equals what a load really
allocates, byte for byte on the CPU and against the CUDA allocator on a GPU, and the check that
runs before a CUDA load refuses what cannot fit in one line."""

from __future__ import annotations

import dataclasses
import gc

import pytest
import torch

from ninfer_offload import Engine, NinferError, open_artifact
from ninfer_offload.artifact.inventory import Inventory
from ninfer_offload.model.nvfp4 import Nvfp4Matrix
from ninfer_offload.model.quant import QuantizedMatrix
from ninfer_offload.planner import PlanOptions, plan
from ninfer_offload.planner.memory import LoadOptions, load_footprint, prefill_staging_slots
from ninfer_offload.profiles import load_profile
from ninfer_offload.runtime.memory_check import check_fits, host_tensor

CAPACITY = 96


def footprint(path, **options) -> dict[str, int]:
    with open_artifact(path) as artifact:
        return load_footprint(Inventory.from_artifact(artifact), LoadOptions(**options))


def weight_tensors(module, seen: dict[int, int]) -> dict[int, int]:
    """data_ptr -> bytes of every weight reachable from a model dataclass (not its expert store or rotary table)."""
    if isinstance(module, torch.Tensor):
        seen[module.data_ptr()] = module.nbytes
    elif isinstance(module, (QuantizedMatrix, Nvfp4Matrix)):
        seen[module.data.data_ptr()] = module.data.nbytes
    elif isinstance(module, (list, tuple)):  # layers; the parts of a stacked product
        for item in module:
            weight_tensors(item, seen)
    elif dataclasses.is_dataclass(module):
        for field in dataclasses.fields(module):
            if field.name not in ("experts", "rotary", "config"):
                weight_tensors(getattr(module, field.name), seen)
    return seen


@pytest.mark.parametrize("artifact", ["tiny_artifact", "tiny_artifact_official", "tiny_artifact_nvfp4"])
@pytest.mark.parametrize("experts", ["resident", "host"])
def test_footprint_equals_what_a_load_allocates(artifact, experts, request):
    path = request.getfixturevalue(artifact)
    engine = Engine.load(path, experts=experts, max_context=CAPACITY, max_sequences=3, draft_tokens=2, mtp=True)
    try:
        layers, count, top_k = engine.config.num_layers, engine.config.num_experts, engine.config.top_k
        if experts == "resident":
            pinned, slots, staging = (count,) * (layers + 1), 0, 0
        else:  # the MTP layer's experts stay pinned; a prefill chunk stages the text layers' host experts
            pinned, slots, staging = (0,) * layers + (count,), 2 * min(count, top_k * 3 * 3), prefill_staging_slots(count)
        planned = footprint(
            path, pinned_experts=pinned, cache_slots=slots, staging_slots=staging, sequences=3, capacity=CAPACITY, draft_tokens=2,
            mtp=True, element_bytes=4, kv_dtype="fp32",
        )
        weights = weight_tensors(engine.mtp, weight_tensors(engine.text, {}))
        assert planned["weights"] == sum(weights.values())
        assert [len(ids) for ids in engine.expert_plan.placement.pinned] == list(pinned)
        assert engine.store.staging_slots == staging and planned["experts"] == engine.store.arena.nbytes
        state = engine.state
        assert planned["kv_cache"] == sum(k.nbytes + v.nbytes for k, v in state.kv.values())
        assert planned["gdn_state"] == state.nbytes - planned["kv_cache"]
    finally:
        engine.close()


def test_plan_runtime_items_are_the_state_pool_of_a_load(tiny_artifact):
    """`ninfer plan`'s KV and GDN lines for a context and concurrency are what the engine allocates for them."""
    engine = Engine.load(tiny_artifact, max_context=CAPACITY, max_sequences=2, dtype="bfloat16", mtp=True, draft_tokens=3)
    try:
        options = PlanOptions(max_context=CAPACITY, concurrency=2, kv_dtype="bf16", speculative="mtp", drafts=3, proposal_head=False)
        placement = plan(Inventory.from_artifact(engine.artifact), load_profile("rtx5090"), options)
        kv = sum(k.nbytes + v.nbytes for k, v in engine.state.kv.values())
        assert placement.runtime["kv_cache"] == kv
        assert placement.runtime["gdn_state"] == engine.state.nbytes - kv
    finally:
        engine.close()


def test_a_planned_offloaded_load_allocates_the_expert_vram_of_the_plan(tiny_artifact_official, small_card, half_expert_budget):
    """The plan's VRAM for routed experts (its resident experts, staging slots and prefill staging buffer) is
    the arena an offloaded load allocates, but for the part of a slot the experts handed to the cache leave over."""
    engine = Engine.load(tiny_artifact_official, profile=str(small_card), vram_budget=half_expert_budget, spec="none")
    try:
        plan, store = engine.expert_plan.plan, engine.store
        assert 0 < plan.runtime["prefill_staging"] == store.staging_slots * store.slot_bytes
        planned = plan.components["routed_experts"].vram_bytes + plan.runtime["staging"] + plan.runtime["prefill_staging"]
        assert planned - store.slot_bytes < store.arena.nbytes <= planned
        assert plan.vram_used_bytes <= plan.vram_budget_bytes
    finally:
        engine.close()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("experts", ["resident", "host"])
def test_footprint_matches_the_cuda_allocator(tiny_artifact_official, experts):
    gc.collect()  # engines of earlier tests must not be freed while this one loads
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    engine = Engine.load(tiny_artifact_official, device="cuda", experts=experts, max_context=4096, max_sequences=4, mtp=True)
    try:
        torch.cuda.synchronize()
        allocated = torch.cuda.memory_allocated() - before
        placement = engine.expert_plan.placement
        planned = sum(footprint(
            tiny_artifact_official, pinned_experts=tuple(len(ids) for ids in placement.pinned), cache_slots=placement.cache_slots,
            staging_slots=placement.staging_slots, sequences=4, capacity=4096, draft_tokens=0, mtp=True, element_bytes=2, kv_dtype="bf16",
        ).values())
        # the allocator rounds each tensor up to 512 bytes; small index tables (rotary, expert tables, use counts) are not planned
        assert planned <= allocated <= planned * 1.02 + 512 * 1024
    finally:
        engine.close()


def test_a_load_that_cannot_fit_is_one_line_naming_the_remedy():
    items = {"weights": 3 << 30, "experts": 17 << 30, "kv_cache": 1 << 30, "gdn_state": 1 << 20}
    check_fits(items, 22 << 30, torch.device("cuda:0"))
    with pytest.raises(NinferError) as err:
        check_fits(items, 16 << 30, torch.device("cuda:0"))
    message = str(err.value)
    assert "\n" not in message
    assert message.startswith("needs 21.00 GiB of VRAM (experts 17.00 GiB")
    assert "16.00 GiB free" in message and "--vram-budget" in message


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine that refuses to pin host memory")
def test_refused_pinning_is_one_line_naming_the_remedy():
    """Without a pinned-memory allocator (no CUDA here) pinning is refused: one line that names what the
    memory was for and the option that avoids it."""
    with pytest.raises(NinferError) as err:
        host_tensor((64, 1024), torch.uint8, True, "expert records", "give a larger --vram-budget")
    message = str(err.value)
    assert "\n" not in message and "expert records" in message and "--vram-budget" in message and "ulimit -l" in message
    assert host_tensor((64, 1024), torch.uint8, False, "expert records", "give a larger --vram-budget").shape == (64, 1024)
