"""The plan over VRAM budgets: monotone in the budget for the shipped cards, and `--spec auto` planned as the load decides it."""

from __future__ import annotations

from dataclasses import replace

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ninfer_offload.artifact.contract import official_directory
from ninfer_offload.artifact.inventory import Inventory
from ninfer_offload.planner import PlanOptions, plan
from ninfer_offload.planner.options import SPECULATION_MIN_SPEEDUP
from ninfer_offload.planner.speculation import decide_speculation, plan_load
from ninfer_offload.profiles import load_profile, shipped_names

GiB = 2**30
INVENTORY = Inventory.from_directory(official_directory())
LOAD = PlanOptions(max_context=32768, proposal_head=False)  # a load's defaults (`LoadRequest`), as `ninfer plan` plans


def _pair(profile, low: float, high: float) -> tuple[int, int]:
    """Two budgets on the card, 4 GiB up to all of it, `low` <= `high` as shares of that range."""
    span = profile.vram_bytes - 4 * GiB
    a, b = sorted((low, high))
    return 4 * GiB + int(a * span), 4 * GiB + int(b * span)


def _monotone(smaller, larger) -> None:
    """What a larger budget must never lose against a smaller one."""
    if not smaller.feasible:
        return
    assert larger.feasible, "a larger budget became infeasible"
    assert larger.experts_resident >= smaller.experts_resident
    assert all(set(a) <= set(b) for a, b in zip(smaller.resident_experts, larger.resident_experts))
    assert larger.predicted.decode_tok_s >= smaller.predicted.decode_tok_s * (1 - 1e-12)
    assert larger.predicted.prefill_tok_s >= smaller.predicted.prefill_tok_s * (1 - 1e-12)
    if smaller.options.speculating:
        assert larger.predicted.decode_tok_s_mtp >= smaller.predicted.decode_tok_s_mtp * (1 - 1e-12)


@settings(max_examples=12, deadline=None, derandomize=True)
@given(name=st.sampled_from(shipped_names()), low=st.floats(0, 1), high=st.floats(0, 1), spec=st.sampled_from(["none", "mtp"]))
def test_more_vram_never_predicts_less(name, low, high, spec):
    """With the speculation fixed, more VRAM never makes a plan infeasible, never drops a resident expert and never
    predicts a slower decode (the simulated cache included) or prefill."""
    profile = load_profile(name)
    small, large = _pair(profile, low, high)
    options = replace(LOAD, speculative=spec)
    _monotone(*(plan(INVENTORY, profile, replace(options, vram_budget=b)) for b in (small, large)))


@settings(max_examples=8, deadline=None, derandomize=True)
@given(name=st.sampled_from(shipped_names()), low=st.floats(0, 1), high=st.floats(0, 1))
def test_auto_is_monotone_in_what_it_compares(name, low, high):
    """`--spec auto` over budgets: a larger budget stays feasible, its plain decode and its MTP projection never fall.
    (The decision itself may turn off where the budget grows: a resident load gains less from MTP than an offloaded one.)"""
    profile = load_profile(name)
    smaller, larger = (plan_load(INVENTORY, profile, replace(LOAD, vram_budget=b), auto=True) for b in _pair(profile, low, high))
    if smaller.feasible:
        assert larger.feasible
        assert larger.predicted.decode_tok_s >= smaller.predicted.decode_tok_s * (1 - 1e-12)
        if smaller.predicted.decode_tok_s_mtp is not None:
            assert larger.predicted.decode_tok_s_mtp >= smaller.predicted.decode_tok_s_mtp * (1 - 1e-12)


def test_an_8_gib_budget_on_the_5060_ti_plans_without_mtp():
    """Where MTP does not pay (or fit), `auto` plans no MTP layer or proposal head: the 5060 Ti's 8 GiB budget, refused
    when the MTP module claimed its VRAM ahead of every expert, plans, and holds more experts than the MTP plan would."""
    card, options = load_profile("rtx5060ti"), replace(LOAD, proposal_head=True, max_context=262144, vram_budget=8 * GiB)
    assert not plan(INVENTORY, card, options).feasible
    auto = plan_load(INVENTORY, card, options, auto=True)
    assert auto.feasible and not auto.options.speculating
    assert auto.components["mtp"].placement == auto.components["proposal"].placement == "unused"
    assert "--spec auto: off, MTP does not fit rtx5060ti: needs" in auto.notes[0]
    nine = replace(options, vram_budget=9 * GiB)
    with_mtp, without = plan(INVENTORY, card, nine), plan_load(INVENTORY, card, nine, auto=True)
    assert with_mtp.feasible and without.experts_resident > with_mtp.experts_resident
    assert without.predicted.decode_tok_s_mtp == with_mtp.predicted.decode_tok_s_mtp  # both rates shown, the decision by them
    assert without.predicted.decode_tok_s > with_mtp.predicted.decode_tok_s and not without.predicted.speculates


@pytest.mark.parametrize("name, speculates", [("rtx5060ti", False), ("rtx5090", True), ("speculating_card", True)])
def test_the_plan_and_the_load_decide_alike(name, speculates, speculating_card):
    """`ninfer plan`'s auto plan is the one the load's decision chooses: with MTP exactly where it speculates."""
    profile = load_profile(str(speculating_card) if name == "speculating_card" else name)
    decision = decide_speculation(INVENTORY, profile, LOAD)
    planned = plan_load(INVENTORY, profile, LOAD, auto=True)
    assert decision.speculates is speculates is planned.options.speculating is planned.predicted.speculates
    assert planned.notes == [f"--spec auto: {decision.reason}"]
    speedup = planned.predicted.decode_tok_s_mtp / planned.predicted.decode_tok_s
    assert (speedup >= SPECULATION_MIN_SPEEDUP) is speculates and f"x{speedup:.2f} projected for {profile.name}" in decision.reason
