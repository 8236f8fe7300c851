"""The prompt cache in the memory plan: its device tier is taken from the VRAM budget (by default a tenth of it, at most
4 GiB), its host tier counted as pinned host memory; a device tier that does not fit is refused, by `ninfer plan`
and by a load at startup, with the largest that does; bad sizes are one-line errors."""

from __future__ import annotations

import re
import subprocess
import sys

import pytest

from ninfer_offload.artifact.contract import official_directory
from ninfer_offload.artifact.inventory import Inventory
from ninfer_offload.errors import NinferError
from ninfer_offload.planner import PlanOptions, plan
from ninfer_offload.planner.options import PROMPT_CACHE_HOST, PROMPT_CACHE_VRAM
from ninfer_offload.planner.request import LoadRequest
from ninfer_offload.profiles import load_profile

GiB = 2**30


@pytest.fixture(scope="module")
def inventory():
    return Inventory.from_directory(official_directory())


def test_the_plan_counts_both_tiers(inventory):
    card = load_profile("h200")
    without = plan(inventory, card, PlanOptions())
    with_cache = plan(inventory, card, PlanOptions(prompt_cache=True))
    assert with_cache.runtime["prompt_cache"] == PROMPT_CACHE_VRAM  # a tenth of the card is more than the cap
    assert with_cache.vram_used_bytes == without.vram_used_bytes + PROMPT_CACHE_VRAM
    assert with_cache.host_pinned_bytes == without.host_pinned_bytes + PROMPT_CACHE_HOST
    budgeted = plan(inventory, card, PlanOptions(prompt_cache=True, vram_budget=15 * GiB, prompt_cache_host=GiB))
    assert budgeted.runtime["prompt_cache"] == int(1.5 * GiB)
    assert budgeted.vram_used_bytes <= 15 * GiB and budgeted.feasible
    fewer = plan(inventory, card, PlanOptions(vram_budget=15 * GiB))
    assert sum(map(len, budgeted.resident_experts)) < sum(map(len, fewer.resident_experts))  # its room comes from the experts


def test_a_device_tier_beyond_the_budget_is_refused_with_the_largest_that_fits(inventory):
    card = load_profile("h200")
    refused = plan(inventory, card, PlanOptions(prompt_cache=True, vram_budget=15 * GiB, prompt_cache_vram=14 * GiB))
    assert not refused.feasible
    largest = int(re.search(r"at most (\d+) MiB", refused.reason)[1]) * 2**20
    fits = plan(inventory, card, PlanOptions(prompt_cache=True, vram_budget=15 * GiB, prompt_cache_vram=largest))
    assert fits.feasible and fits.vram_used_bytes <= 15 * GiB
    done = subprocess.run(
        [sys.executable, "-m", "ninfer_offload", "plan", "--profile", "h200", "--vram-budget", "15GiB", "--prompt-cache",
         "--prompt-cache-vram", "14GiB"],
        capture_output=True, text=True, timeout=120,
    )
    assert done.returncode == 2 and "at most" in done.stderr and "--prompt-cache-vram" in done.stderr
    assert "Traceback" not in done.stderr


def test_a_load_refuses_a_device_tier_that_does_not_fit_at_startup(tiny_artifact_official, small_card, half_expert_budget):
    from ninfer_offload.runtime.engine import Engine

    with pytest.raises(NinferError, match=r"prompt cache's .* does not fit .* at most \d+ MiB"):
        Engine.load(
            tiny_artifact_official, device="cpu", profile=str(small_card), vram_budget=half_expert_budget, prompt_cache=True,
            prompt_cache_vram=half_expert_budget,
        )


@pytest.mark.parametrize(
    "options,message",
    [
        ({"prompt_cache_vram": "lots"}, "cannot read size"),
        ({"prompt_cache_host": "-1GiB"}, "cannot read size"),
        ({"prompt_cache_vram": -1}, "--prompt-cache-vram must not be negative"),
        ({"prompt_cache_every": 0}, "prompt_cache_every must be >= 1"),
    ],
)
def test_bad_sizes_are_one_line_errors(options, message):
    with pytest.raises(NinferError, match=message):
        LoadRequest(prompt_cache=True, **options)


def test_the_default_device_tier_gives_way_to_a_tight_budget(inventory):
    """A budget that holds the load's fixed needs but not also a tenth of itself for the cache: the default tier shrinks
    to what is left (the load still plans); a tier asked for by size is refused instead."""
    card = load_profile("rtx5060ti")
    bare = plan(inventory, card, PlanOptions(speculative="none", max_context=4096, vram_budget=8 * GiB))
    assert bare.feasible
    need = bare.vram_used_bytes - sum(bare.expert_bytes[layer] * len(ids) for layer, ids in enumerate(bare.resident_experts))
    tight = need + (need // 20)  # room for 5 % of the fixed needs: less than the default tenth of the budget
    default = plan(inventory, card, PlanOptions(speculative="none", max_context=4096, vram_budget=tight, prompt_cache=True))
    assert default.feasible and 0 <= default.runtime["prompt_cache"] < tight // 10
    assert default.vram_used_bytes <= tight
    asked = plan(inventory, card, PlanOptions(speculative="none", max_context=4096, vram_budget=tight, prompt_cache=True,
                                              prompt_cache_vram=tight // 10))
    assert not asked.feasible and "--prompt-cache-vram" in asked.reason


def test_the_default_host_tier_gives_way_to_the_expert_pool(inventory):
    """On a 32 GiB desktop with a 16 GB card the pinned expert pool takes most of the pinned budget: the default host tier
    takes what is left of it (beside the process's own share), so the load still plans; one asked for by size is counted
    as asked."""
    card = load_profile("rtx5060ti")
    default = plan(inventory, card, PlanOptions(speculative="none", max_context=32768, prompt_cache=True))
    without = plan(inventory, card, PlanOptions(speculative="none", max_context=32768))
    assert default.feasible and 0 < default.prompt_cache_host_bytes < PROMPT_CACHE_HOST
    assert default.host_pinned_bytes == without.host_pinned_bytes + default.prompt_cache_host_bytes
    assert default.host_process_bytes <= default.host_budget_bytes
    asked = plan(inventory, card, PlanOptions(speculative="none", max_context=32768, prompt_cache=True, prompt_cache_host=GiB))
    assert asked.prompt_cache_host_bytes == GiB
