"""`LoadRequest`: one check of a load's options, one-line errors naming the flags, and the options
the load and the planner derive from it."""

from __future__ import annotations

import pytest

from ninfer_offload.errors import NinferError
from ninfer_offload.planner.options import PlanOptions
from ninfer_offload.planner.request import DEFAULT_MAX_CONTEXT, LoadRequest


@pytest.mark.parametrize(
    "options, message",
    [
        ({"experts": "disk"}, "--experts must be one of auto, resident, host, got 'disk'"),
        ({"miss_path": "gpu"}, "--miss-path must be one of pcie, cpu, auto, got 'gpu'"),
        ({"cache_policy": "fifo"}, "--cache-policy must be one of static, lru, decayed, batch, got 'fifo'"),
        ({"experts": "resident", "vram_budget": "8GiB"}, "--experts resident keeps every expert in VRAM"),
        ({"miss_path": "cpu"}, "--miss-path cpu computes experts kept in host memory: add --experts host or a --vram-budget"),
        ({"vram_budget": 0}, "--vram-budget must be more than 0"),
        ({"vram_budget": "12"}, "size '12' has no unit"),
        ({"spec": "dflash2"}, "--spec dflash2: drafting with a DFlash model is not supported"),
        ({"spec": "eagle"}, "--spec must be one of auto, none, mtp, got 'eagle'"),
        ({"spec": "mtp", "draft_tokens": 0}, "--draft-tokens must be 1..5, got 0"),
        ({"draft_tokens": 6}, "--draft-tokens must be 0..5 without speculation, got 6"),
        ({"max_context": 0}, "--max-context must be at least 1, got 0"),
        ({"max_sequences": 0}, "--max-concurrency must be >= 1, got 0"),
        ({"prefill_chunk": 0}, "--prefill-chunk must be >= 1, got 0"),
        ({"kv_dtype": "int4"}, "unsupported KV dtype 'int4'"),
        ({"dtype": "float16"}, "unsupported dtype 'float16': use float32 or bfloat16"),
        ({"backend": "cuda"}, "unknown backend 'cuda': use auto, reference or triton"),
    ],
)
def test_a_bad_option_is_one_line_naming_it(options, message):
    with pytest.raises(NinferError) as err:
        LoadRequest(**options)
    assert message in str(err.value) and "\n" not in str(err.value)


def test_values_are_read_once():
    request = LoadRequest(vram_budget="1.5GiB", profile="rtx5090", miss_path=None)
    assert request.vram_budget == 3 * 2**29 and request.miss_path == "pcie" and request.planned
    assert not LoadRequest().planned
    assert LoadRequest(miss_path="cpu", experts="host").miss_path == "cpu"


def test_capacity_follows_the_model():
    assert LoadRequest().capacity(4096) == 4096
    assert LoadRequest().capacity(10**6) == DEFAULT_MAX_CONTEXT
    assert LoadRequest(max_context=100).capacity(4096) == 100
    with pytest.raises(NinferError, match="max context 5000 must be between 1 and the model's maximum context of 4096"):
        LoadRequest(max_context=5000).capacity(4096)


def test_the_load_and_the_plan_derive_their_options():
    request = LoadRequest(vram_budget="8GiB", profile="rtx5090", miss_path="auto", max_sequences=3, prefill_chunk=512, proposal_head=True)
    load = request.load_options(capacity=2048, draft_tokens=2, mtp=True, element_bytes=2, kv_dtype="fp8")
    assert (load.sequences, load.capacity, load.draft_tokens, load.mtp, load.proposal_head) == (3, 2048, 2, True, True)
    assert (load.pinned_experts, load.cache_slots, load.staging_slots) == ((), 0, 0)
    assert request.plan_options(load) == PlanOptions(
        max_context=2048, concurrency=3, kv_dtype="fp8", speculative="mtp", drafts=2, proposal_head=True, prefill_chunk=512,
        vram_budget=8 * 2**30, miss_path="auto",
    )
    plain = LoadRequest().load_options(capacity=64, draft_tokens=0, mtp=False, element_bytes=4, kv_dtype="fp32")
    options = LoadRequest().plan_options(plain)
    assert (options.kv_dtype, options.speculative, options.drafts) == ("bf16", "none", 1)
