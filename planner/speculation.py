"""`--spec auto`'s decision: one function for the load (`runtime.spec_choice`) and for `ninfer plan`, so the
plan shows what the load would do.

Two plans are made for the card: one with MTP speculation (the MTP layer and, if asked, the proposal head
resident) and one without (their VRAM goes to experts). Speculation is on where the first plan fits and
its decode with MTP is at least `SPECULATION_MIN_SPEEDUP` times the second plan's plain decode. The
chosen plan is returned with both rates in its prediction: `decode_tok_s` is the plain decode of the plan
without MTP, `decode_tok_s_mtp` the MTP plan's projection (None where MTP does not fit), so its
`speculation_speedup` and `speculates` state the decision.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from ninfer_offload.artifact.inventory import Inventory
from ninfer_offload.planner.options import SPECULATION_MIN_SPEEDUP, PlanOptions
from ninfer_offload.planner.placement import Placement
from ninfer_offload.planner.planner import plan
from ninfer_offload.planner.routing import RoutingStats
from ninfer_offload.profiles import DeviceProfile


@dataclass(frozen=True)
class SpeculationDecision:
    """The plan to load (with MTP when it speculates, else without the MTP layer and proposal head), the decision
    and its reason in a few words (for a log line or the plan's report)."""

    placement: Placement
    speculates: bool
    reason: str


def decide_speculation(
    inventory: Inventory, profile: DeviceProfile, options: PlanOptions, routing_stats: RoutingStats | None = None
) -> SpeculationDecision:
    """Whether MTP speculation pays on `profile` for `options` (as they are with speculation: drafts,
    proposal head, acceptance), and the plan that follows from it (see the module docstring)."""
    speculating = replace(options, speculative="mtp")
    with_mtp = plan(inventory, profile, speculating, routing_stats)
    plain = plan(inventory, profile, replace(options, speculative="none", proposal_head=False), routing_stats)
    if not plain.feasible:
        return SpeculationDecision(plain, False, f"off, the model does not fit {profile.name}: {plain.reason}")
    if not with_mtp.feasible:
        return SpeculationDecision(plain, False, f"off, MTP does not fit {profile.name}: {with_mtp.reason}")
    rate, rate_mtp = plain.predicted.decode_tok_s, with_mtp.predicted.decode_tok_s_mtp
    speedup = rate_mtp / rate
    speculates = speedup >= SPECULATION_MIN_SPEEDUP
    chosen = with_mtp if speculates else plain
    chosen.predicted = replace(chosen.predicted, decode_tok_s=rate, decode_tok_s_mtp=rate_mtp)
    reason = (
        f"{'on' if speculates else 'off'}, x{speedup:.2f} projected for {profile.name} at {options.mtp_acceptance:g} acceptance "
        f"(on from x{SPECULATION_MIN_SPEEDUP:g})"
    )
    return SpeculationDecision(chosen, speculates, reason)


def plan_load(
    inventory: Inventory, profile: DeviceProfile, options: PlanOptions, routing_stats: RoutingStats | None = None, auto: bool = False
) -> Placement:
    """The plan of a load asking for `options`; with `auto` (`--spec auto`) and speculative options, the plan
    `decide_speculation` chooses, its reason in the plan's notes where it fits."""
    if not (auto and options.speculating):
        return plan(inventory, profile, options, routing_stats)
    decision = decide_speculation(inventory, profile, options, routing_stats)
    if decision.placement.feasible:  # (else its reason says what does not fit)
        decision.placement.notes.append(f"--spec auto: {decision.reason}")
    return decision.placement
