"""`plan(inventory, profile, options, routing_stats=None) -> Placement`: a pure function.

Order of claims on the VRAM budget (min(card, --vram-budget) minus the reserve):
1. what every step needs: non-expert text weights, the output head, MTP and the proposal head when
   speculating, vision when enabled, KV cache, GDN state, prefill workspace;
2. routed experts of the text layers, by marginal value (expected hits per token per byte) across
   all layers, hottest first; when not all fit, staging slots for streamed experts and the prefill
   staging buffer (`memory.prefill_staging_slots`) are set aside first and the rest live in pinned
   host memory;
3. the token embedding, only once every expert is resident (a token needs one row of it, which
   costs nothing over PCIe; an expert in VRAM saves a transfer on almost every token).
DFlash and DFlash2 weights are never loaded (speculation uses MTP); they are reported as unused.
"""

from __future__ import annotations

from dataclasses import replace

from ninfer_offload.artifact.dims import ModelDims
from ninfer_offload.artifact.formats import elements
from ninfer_offload.artifact.inventory import COMPONENTS, Inventory
from ninfer_offload.errors import NinferError
from ninfer_offload.planner.cache_split import simulate_decode_cache
from ninfer_offload.planner.cost import WeightTraffic, predict
from ninfer_offload.planner.launches import ForwardWeights
from ninfer_offload.planner.memory import (
    pool_bytes, prefill_span_bytes, prefill_staging_slots, prompt_cache_vram_bytes, staging_slots, state_pool_bytes, workspace_bytes,
)
from ninfer_offload.planner.options import PROMPT_CACHE_HOST, PlanOptions
from ninfer_offload.planner.placement import ComponentPlacement, Placement
from ninfer_offload.planner.routing import RoutingStats, default_routing_stats
from ninfer_offload.profiles import DeviceProfile

HOST_PINNED_SHARE = 0.75  # default pinned budget: 3/4 of host RAM (the rest: OS, page cache, programs)
# Host memory of the process besides its pinned buffers (Python, torch, the CUDA context's host side, the loader's
# buffers): a 15 GiB load on the H200 held 19.5 GB of anonymous memory (RssAnon) with 17.3 GiB of expert records
# (17.5 GiB as locked), 0.7 GiB more; counted as 1 GiB.
RUNTIME_HOST_BYTES = 2**30
ROUTED = ("routed_gate_up", "routed_down")
GiB = 2**30


def _gib(n: float) -> str:
    return f"{n / GiB:.1f} GiB"


def plan(
    inventory: Inventory, profile: DeviceProfile, options: PlanOptions | None = None, routing_stats: RoutingStats | None = None
) -> Placement:
    """Place every weight of `inventory` for `profile`; `feasible` is False (with `reason`) when it cannot fit."""
    options = options or PlanOptions()
    dims = ModelDims.from_text_config(inventory.text_config)
    banks = inventory.banks_of("text")
    if not banks:
        raise NinferError("artifact has no routed experts in its text component; nothing to plan")
    experts = banks[0].num_experts
    if any(b.num_experts != experts for b in banks) or [b.layer for b in banks] != list(range(len(banks))):
        raise NinferError("artifact's routed experts differ between layers or skip layers; cannot plan it")
    stats = routing_stats or default_routing_stats(inventory.text_config, len(banks), experts)
    stats.check(len(banks), experts)
    if options.speculating and not inventory.select("mtp"):
        raise NinferError("artifact has no MTP component; use --spec none")
    if options.speculating and options.proposal_head and not inventory.select("proposal"):
        raise NinferError("artifact has no proposal head; use --no-proposal-head")
    if options.vision and not inventory.select("vision"):
        raise NinferError("artifact has no vision component; drop --vision")

    text = inventory.select("text")
    dense_text = [t for t in text if t.role not in (*ROUTED, "token_embedding", "output_head")]
    embedding = _bytes(t for t in text if t.role == "token_embedding")
    head = _bytes(t for t in text if t.role == "output_head")
    mtp, proposal = _bytes(inventory.select("mtp")), _bytes(inventory.select("proposal"))
    vision, dflash, dflash2 = (_bytes(inventory.select(c)) for c in ("vision", "dflash", "dflash2"))
    other = _bytes(t for t in inventory.tensors if t.component not in COMPONENTS)
    use_proposal = options.speculating and options.proposal_head

    card = profile.vram_bytes
    budget = min(card, options.vram_budget) if options.vram_budget is not None else card
    host_budget = options.host_budget if options.host_budget is not None else int(profile.ram_bytes * HOST_PINNED_SHARE)
    reserve = options.vram_reserve if options.vram_reserve is not None else profile.reserve_bytes
    pool = state_pool_bytes(
        dims, options.concurrency, options.max_context, options.draft_count, options.speculating, options.kv_dtype
    )
    runtime = {
        "reserve": reserve,
        **pool,
        "workspace": workspace_bytes(dims, options),
        "staging": 0,
        "prefill_staging": 0,
    }
    prompt_cache_host = 0
    if options.prompt_cache:
        runtime["prompt_cache"] = prompt_cache_vram_bytes(options.prompt_cache_vram, budget)
        prompt_cache_host = PROMPT_CACHE_HOST if options.prompt_cache_host is None else options.prompt_cache_host
    fixed_weights = (
        _bytes(dense_text) + head + (mtp if options.speculating else 0) + (proposal if use_proposal else 0)
        + (vision if options.vision else 0)
    )
    fixed = fixed_weights + sum(runtime.values())

    order = _expert_order(stats, [b.expert_bytes for b in banks])
    all_experts = sum(b.expert_bytes * b.num_experts for b in banks)
    slots = 0
    if fixed + all_experts <= budget:
        chosen = len(order)
        embedding_on_device = fixed + all_experts + embedding <= budget
    else:
        embedding_on_device = False
        slots = staging_slots(dims.num_experts, dims.top_k, options.concurrency * (1 + options.draft_count))
        widest = max(b.expert_bytes for b in banks)
        runtime["staging"] = slots * widest
        runtime["prefill_staging"] = prefill_staging_slots(dims.num_experts) * widest + prefill_span_bytes(dims, options)
        room = budget - fixed - runtime["staging"] - runtime["prefill_staging"]
        if room < 0 and options.prompt_cache and options.prompt_cache_vram is None:  # the default share gives way
            given_back = min(runtime["prompt_cache"], -room)
            runtime["prompt_cache"] -= given_back
            fixed -= given_back
            room += given_back
        chosen = 0
        while chosen < len(order) and order[chosen][2] <= room:
            room -= order[chosen][2]
            chosen += 1

    resident: list[list[int]] = [[] for _ in banks]
    for layer, expert, _ in order[:chosen]:
        resident[layer].append(expert)
    resident_bytes = sum(size for _, _, size in order[:chosen])
    host_experts = all_experts - resident_bytes
    # An offloaded load keeps every expert record in its host pool (the cache promotes and evicts from it), the MTP
    # layer's too when it is loaded.
    pool_banks = banks + (inventory.banks_of("mtp") if options.speculating else [])
    pool_layers = [b.expert_bytes * b.num_experts for b in pool_banks]
    expert_pool = pool_bytes(pool_layers, pinned=True) if host_experts else 0
    host_weights = expert_pool + (0 if embedding_on_device else embedding)
    if options.prompt_cache and options.prompt_cache_host is None:  # the default host tier gives way to the expert pool
        prompt_cache_host = max(0, min(prompt_cache_host, host_budget - host_weights - RUNTIME_HOST_BYTES))
    host_pinned = host_weights + prompt_cache_host
    vram_used = fixed + runtime["staging"] + runtime["prefill_staging"] + resident_bytes + (embedding if embedding_on_device else 0)

    routed_stored = sum(b.bank_bytes for b in banks)
    unused, on_device = _placed("unused"), _placed("vram")
    components = {
        "text_dense": on_device(_bytes(dense_text)),
        "output_head": on_device(head),
        "token_embedding": on_device(embedding) if embedding_on_device else ComponentPlacement(embedding, "host", 0, embedding),
        "routed_experts": ComponentPlacement(
            routed_stored, "vram" if not host_experts else ("host" if not resident_bytes else "split"), resident_bytes, host_experts
        ),
        "mtp": on_device(mtp) if options.speculating else unused(mtp),
        "proposal": on_device(proposal) if use_proposal else unused(proposal),
        "vision": on_device(vision) if options.vision else unused(vision),
        "dflash": unused(dflash),
    }
    if dflash2:
        components["dflash2"] = unused(dflash2)
    if other:
        components["other"] = unused(other)

    total_hits = sum(sum(row) for row in stats.hits)
    mass = sum(stats.hits[layer][e] for layer, ids in enumerate(resident) for e in ids) / total_hits
    placement = Placement(
        profile=profile.name,
        options=options,
        feasible=True,
        reason=None,
        vram_total_bytes=card,
        vram_budget_bytes=budget,
        vram_used_bytes=vram_used,
        host_pinned_bytes=host_pinned,
        host_budget_bytes=host_budget,
        host_process_bytes=host_pinned + RUNTIME_HOST_BYTES,
        prompt_cache_host_bytes=prompt_cache_host,
        components=components,
        runtime=runtime,
        resident_experts=resident,
        experts_per_layer=experts,
        expert_bytes=[b.expert_bytes for b in banks],
        routing_mass_resident=min(1.0, mass),
        routing_stats=stats.source,
        staging_slots=slots,
        kv_capacity_tokens=options.max_context * options.concurrency,
    )
    reason = _infeasible(placement, fixed, fixed_weights, options, profile)
    if not reason and placement.host_process_bytes > host_budget:
        placement.notes.append(
            f"host memory {_gib(placement.host_process_bytes)} (pinned {_gib(host_pinned)}, the runtime {_gib(RUNTIME_HOST_BYTES)}) "
            f"is more than {_gib(host_budget)}: little RAM left for the OS, page cache and other programs"
        )
    if reason:
        placement.feasible, placement.reason = False, reason
        return placement
    mtp_banks = inventory.banks_of("mtp")
    weights = WeightTraffic(
        dense_text_bytes=_bytes(dense_text),
        dense_text_params=sum(elements(t.shape) for t in dense_text),
        embedding_row_bytes=-(-embedding // dims.vocab_size),
        embedding_on_device=embedding_on_device,
        head_bytes=head,
        draft_head_bytes=proposal if use_proposal else head,
        mtp_dense_bytes=mtp - sum(b.bank_bytes for b in mtp_banks),
        mtp_expert_bytes=mtp_banks[0].expert_bytes if mtp_banks else 0,
        forward=ForwardWeights.of(inventory),
    )
    cache = simulate_decode_cache(stats, dims.top_k, resident, slots, placement.expert_bytes) if host_experts else None
    placement.predicted = predict(dims, profile, options, weights, stats, resident, placement.expert_bytes, cache)
    return placement


def largest_concurrency(
    inventory: Inventory, profile: DeviceProfile, options: PlanOptions, routing_stats: RoutingStats | None = None
) -> int:
    """The most sequences, up to `options.concurrency`, of `options.max_context` tokens each whose plan fits
    (`plan(...).feasible`; more sequences never fit where fewer do not); 0 when not even one does."""
    fits, refused = 0, options.concurrency + 1
    while refused - fits > 1:
        middle = (fits + refused) // 2
        if plan(inventory, profile, replace(options, concurrency=middle), routing_stats).feasible:
            fits = middle
        else:
            refused = middle
    return fits


def _bytes(tensors) -> int:
    return sum(t.bytes for t in tensors)


def _placed(where: str):
    """Constructor of a component placed wholly in VRAM ("vram") or not loaded ("unused")."""
    return lambda n: ComponentPlacement(n, where, n if where == "vram" else 0, 0)


def _expert_order(stats: RoutingStats, expert_bytes: list[int]) -> list[tuple[int, int, int]]:
    """(layer, expert, bytes) of every text expert, most valuable first: expected hits per byte,
    ties broken by the expert's rank within its layer, then by layer (so uniform routing spreads
    residency evenly over the layers). Each layer's experts appear hottest first."""
    keyed = []
    for layer, (row, size) in enumerate(zip(stats.hits, expert_bytes)):
        ranked = sorted(range(len(row)), key=lambda e: (-row[e], e))
        keyed += [(-row[e] / size, rank, layer, e, size) for rank, e in enumerate(ranked)]
    keyed.sort()
    return [(layer, e, size) for _, _, layer, e, size in keyed]


def _infeasible(p: Placement, fixed: int, fixed_weights: int, options: PlanOptions, profile: DeviceProfile) -> str | None:
    """One line saying what does not fit and which option would make it fit, or None."""
    budget = p.vram_budget_bytes
    cache = p.runtime.get("prompt_cache", 0)
    if cache and p.vram_used_bytes > budget >= p.vram_used_bytes - cache:
        fits = budget - (p.vram_used_bytes - cache)
        return (
            f"the prompt cache's {_gib(cache)} of VRAM does not fit the budget of {_gib(budget)} on {profile.name}: "
            f"at most {fits >> 20} MiB does beside the rest (--prompt-cache-vram)"
        )
    if p.vram_used_bytes > budget:
        kv = p.runtime["kv_cache"]
        hints = []
        if options.max_context > 8192 and kv > GiB // 4:
            hints.append("a lower --max-context")
        if options.kv_dtype == "bf16":
            hints.append("--kv-dtype fp8")
        if options.concurrency > 1:
            hints.append("fewer concurrent sequences")
        if options.speculating:
            hints.append("--spec none" + (" or --no-proposal-head" if options.proposal_head else ""))
        if options.vision:
            hints.append("--no-vision")
        if p.runtime["workspace"] > GiB // 2:
            hints.append("a smaller --prefill-chunk")
        if options.vram_budget is not None and options.vram_budget < profile.vram_bytes:
            hints.append("a larger --vram-budget")
        what = (
            f"weights that must stay resident {_gib(fixed_weights)}, KV cache {_gib(kv)} for {p.kv_capacity_tokens} tokens, "
            f"other runtime buffers {_gib(fixed - fixed_weights - kv)}"
        )
        if p.runtime["staging"]:
            what += f", {p.staging_slots} expert staging slots {_gib(p.runtime['staging'])}"
            what += f", prefill staging {_gib(p.runtime['prefill_staging'])}"
        remedy = "; try " + ", ".join(hints) if hints else "; this card is too small for this model"
        return f"needs {_gib(p.vram_used_bytes)} VRAM ({what}), budget is {_gib(budget)} on {profile.name}{remedy}"
    if p.host_process_bytes > profile.ram_bytes:
        return (
            f"needs {_gib(p.host_process_bytes)} of host memory (pinned expert pool and embedding {_gib(p.host_pinned_bytes)}, "
            f"the runtime {_gib(RUNTIME_HOST_BYTES)}), {profile.name} has {_gib(profile.ram_bytes)} RAM; give a larger "
            "--vram-budget or a profile with more RAM"
        )
    if p.host_pinned_bytes > p.host_budget_bytes:
        given = (
            "given by --host-budget" if options.host_budget is not None
            else f"{HOST_PINNED_SHARE:.0%} of {_gib(profile.ram_bytes)} RAM on {profile.name}"
        )
        return (
            f"needs {_gib(p.host_pinned_bytes)} pinned host memory for the expert pool and embedding"
            f"{' and the prompt cache' if options.prompt_cache else ''}, budget is "
            f"{_gib(p.host_budget_bytes)} ({given}); give a larger --host-budget or --vram-budget, or a profile with more RAM"
        )
    return None
