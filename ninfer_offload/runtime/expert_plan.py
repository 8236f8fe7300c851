"""The plan drives the load: which routed experts `Engine.load` pins in VRAM and how many cache slots
it gives the adaptive cache.

`--experts resident` pins every expert, `--experts host` none (the cache gets `num_slots` slots).
`--experts auto` (the default) plans when a profile or VRAM budget is given, or on CUDA when the
model does not fit the card's free memory: the planner's resident experts are pinned, its staging
slots become cache slots, and `planner.cache_split.CACHE_SHARE` of its expert VRAM, its coldest experts first, is
handed to the cache instead of being pinned (the cache starts out holding them, then follows the
traffic). The MTP layer's experts are always pinned (the plan counts the MTP module as resident).
An offloaded load also gets `planner.memory.prefill_staging_slots` slots that a prefill chunk copies
its host experts into (the plan sets their bytes aside as `runtime["prefill_staging"]`).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from ninfer_offload.artifact.inventory import Inventory
from ninfer_offload.errors import NinferError
from ninfer_offload.planner.cache_split import hand_to_cache
from ninfer_offload.planner.memory import LoadOptions, expert_arena_bytes, pool_bytes, prefill_staging_slots, staging_slots
from ninfer_offload.planner.placement import Placement
from ninfer_offload.planner.planner import largest_concurrency, plan
from ninfer_offload.planner.request import LoadRequest
from ninfer_offload.planner.routing import default_routing_stats
from ninfer_offload.profiles import DeviceProfile, load_profile
from ninfer_offload.runtime.expert_store import ExpertPlacement

GiB = 2**30


def _size(n: int) -> str:
    return f"{n / GiB:.1f} GiB" if n >= GiB else f"{n / 2**20:.1f} MiB"


@dataclass(frozen=True)
class LoadPlan:
    placement: ExpertPlacement
    plan: Placement | None  # the planner's answer, when the load was planned
    expert_bytes: list[int]  # record bytes per MoE layer

    @property
    def arena_bytes(self) -> int:
        counts = tuple(len(ids) for ids in self.placement.pinned)
        return expert_arena_bytes(self.expert_bytes, counts, self.placement.cache_slots, self.placement.staging_slots)

    @property
    def host_bytes(self) -> int:
        """Bytes of the expert records in host memory."""
        return self.host_ram_bytes(pinned=False)

    def host_ram_bytes(self, pinned: bool) -> int:
        """RAM the host pool takes (`planner.memory.pool_bytes`: its page-locked chunks when `pinned`)."""
        if not self.placement.offloaded:
            return 0
        experts = self.placement.scores.shape[1]
        return pool_bytes([experts * b for b in self.expert_bytes], pinned)

    def summary(self, device: torch.device) -> str:
        """One line: where the experts go on `device` (and the plan behind it)."""
        pinned = sum(len(ids) for ids in self.placement.pinned)
        total = self.placement.scores.size
        arena = "pinned in VRAM" if device.type == "cuda" else f"in {device.type} memory (no VRAM on a {device.type} load)"
        line = (
            f"{pinned:,} of {total:,} experts {arena}, {self.placement.cache_slots:,} cache slots, "
            f"{self.placement.staging_slots:,} prefill staging slots "
            f"(expert arena {_size(self.arena_bytes)}), {_size(self.host_bytes)} of expert records in host memory"
        )
        if self.plan is not None:
            p = self.plan
            line = (
                f"plan {p.profile} (VRAM budget {_size(p.vram_budget_bytes)}, planned use {_size(p.vram_used_bytes)}): " + line
            )
        return line


def expert_load_plan(
    inventory: Inventory, device: torch.device, request: LoadRequest, load: LoadOptions, free_vram: int | None
) -> LoadPlan:
    """Where each routed expert goes for `request`, as the load resolved it (`load`: its sequences, context,
    drafts, MTP module; see the module docstring)."""
    text_banks = inventory.banks_of("text")
    mtp_banks = inventory.banks_of("mtp") if load.mtp else []
    layers, experts = len(text_banks), text_banks[0].num_experts
    expert_bytes = [bank.expert_bytes for bank in text_banks + mtp_banks]
    stats = default_routing_stats(inventory.text_config, layers, experts)
    top_k = int(inventory.text_config.get("num_experts_per_tok", 1))
    scores = np.vstack([np.array(stats.hits), np.full((len(mtp_banks), experts), top_k / experts)])
    all_ids = list(range(experts))
    mtp_pinned = [all_ids for _ in mtp_banks]
    everything = ExpertPlacement([all_ids] * (layers + len(mtp_banks)), 0, scores)
    if request.experts == "resident":
        return LoadPlan(everything, None, expert_bytes)
    if request.experts == "host":
        slots = staging_slots(experts, top_k, load.sequences * (1 + load.draft_tokens), request.num_slots)
        placement = ExpertPlacement([[] for _ in range(layers)] + mtp_pinned, slots, scores, prefill_staging_slots(experts))
        return LoadPlan(placement, None, expert_bytes)
    if not request.planned:
        fits = LoadPlan(everything, None, expert_bytes)
        if free_vram is None or fits.arena_bytes <= free_vram:
            return fits
    profile = _profile(request.profile, device)
    options = request.plan_options(load)
    placement = plan(inventory, profile, options, stats)
    if not placement.feasible:
        fitting = largest_concurrency(inventory, profile, options, stats) if load.sequences > 1 else 0
        if fitting:
            raise NinferError(
                f"cannot load for {profile.name}: {load.sequences} sequences of {load.capacity} tokens do not fit, at most "
                f"{fitting} do (--max-concurrency {fitting}): {placement.reason}"
            )
        raise NinferError(f"cannot load for {profile.name}: {placement.reason}")
    if device.type == "cuda":
        total = torch.cuda.get_device_properties(device).total_memory
        if placement.vram_budget_bytes > total:
            raise NinferError(
                f"profile {profile.name} plans for {placement.vram_budget_bytes / GiB:.1f} GiB of VRAM but {device} has "
                f"{total / GiB:.1f} GiB; use --profile auto or --vram-budget {total // GiB}GiB"
            )
    if placement.components["routed_experts"].host_bytes == 0:
        return LoadPlan(everything, placement, expert_bytes)
    pinned, cache_slots = hand_to_cache(placement.resident_experts, placement.staging_slots, scores[:layers], expert_bytes[:layers])
    staging = prefill_staging_slots(experts)
    return LoadPlan(ExpertPlacement(pinned + mtp_pinned, cache_slots, scores, staging), placement, expert_bytes)


def _profile(spec: str | DeviceProfile | None, device: torch.device) -> DeviceProfile:
    if isinstance(spec, DeviceProfile):
        return spec
    if spec is None and device.type != "cuda":
        raise NinferError("a VRAM budget without a GPU needs a device profile too (--profile NAME|FILE)")
    return load_profile(spec or "auto")
