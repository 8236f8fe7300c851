"""Cost model: predicted decode and prefill tokens/s from the bytes each token moves and this
engine's measured timings.

A decode forward costs its fixed work (small kernels, launches), the weight-reading kernels (at
least their latency floor, at most the weight bytes at the reachable share of the memory
bandwidth), with offloaded experts the cache bookkeeping, and the routed experts not in VRAM served
by the miss path (read over PCIe zero-copy, or computed on the host at a cost per layer handed over;
"auto" the faster). Which experts a decode step finds in VRAM comes from the simulated adaptive cache of the
load (`cache_split.simulate_decode_cache`) when experts are offloaded: its one-token figures as simulated, a
multi-token step's host reads scaled by the same ratio to the plan's resident set alone. Prefill of a chunk is
compute- or weight-bound on the GPU plus one read of every host-resident expert the chunk touches,
partly overlapped. The timings come from the profile's `[engine]` table, measured by
`bench/resident.py` and `bench/offload.py`; a card without a complete one borrows the missing ones from
the shipped profile with a complete table nearest to it in memory bandwidth (`calibration_profile`),
which the assumptions say and `ninfer plan` warns about.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

from ninfer_offload.artifact.dims import ModelDims
from ninfer_offload.planner.cache_split import CACHE_SHARE, SIMULATED_TOKENS, CacheSimulation
from ninfer_offload.planner.launches import expected_touched
from ninfer_offload.planner.memory import gdn_state_bytes, kv_layer_bytes_per_token
from ninfer_offload.planner.options import PlanOptions
from ninfer_offload.planner.request import DEFAULT_CACHE_POLICY
from ninfer_offload.planner.placement import Prediction
from ninfer_offload.planner.routing import RoutingStats
from ninfer_offload.profiles import ENGINE_KEYS, DeviceProfile, load_profile, shipped_names
# Host expert kernels consume records at this share of DRAM bandwidth, all cores: measured 0.63
# (bf16 activations; 0.59 float32) on the H200 host's 16 Emerald Rapids vCPUs and 0.85 on 2 Zen 5
# cores (bench/results/cpu_experts_*.json).
CPU_EXPERT_SHARE_OF_DRAM = 0.6


def _complete(profile: DeviceProfile) -> bool:
    return all(key in (profile.engine or {}) for key in ENGINE_KEYS)


@functools.lru_cache(maxsize=1)
def _calibrated_profiles() -> tuple[DeviceProfile, ...]:
    """The shipped profiles whose `[engine]` table is complete (the cards the benchmarks measured)."""
    return tuple(p for p in map(load_profile, shipped_names()) if _complete(p))


def calibration_profile(profile: DeviceProfile) -> DeviceProfile | None:
    """The shipped profile whose engine timings `profile` borrows: None when its own `[engine]` table is
    complete, else the calibrated one nearest in memory bandwidth (ties by name)."""
    if _complete(profile):
        return None
    return min(_calibrated_profiles(), key=lambda p: (abs(p.memory_bandwidth_gbs - profile.memory_bandwidth_gbs), p.name))


def engine_timings(profile: DeviceProfile) -> tuple[dict[str, float], str]:
    """The profile's measured engine timings, completed from `calibration_profile`'s, and where they come from."""
    own = profile.engine or {}
    reference = calibration_profile(profile)
    if reference is None:
        return dict(own), f"engine timings measured on {profile.name}"
    return {**reference.engine, **own}, (
        f"engine timings measured on the {reference.name}, the nearest measured card in memory bandwidth "
        f"({profile.name} has no complete [engine] table)"
    )


@dataclass(frozen=True)
class WeightTraffic:
    """Bytes (and parameters) of the weights a token reads, from the inventory."""

    dense_text_bytes: int  # text weights except routed experts, embedding and output head
    dense_text_params: int
    embedding_row_bytes: int
    embedding_on_device: bool
    head_bytes: int
    draft_head_bytes: int  # proposal head if used, else the output head
    mtp_dense_bytes: int  # MTP weights except its routed experts
    mtp_expert_bytes: int  # one MTP expert record


def _expert_traffic(stats: RoutingStats, resident: list[list[int]], expert_bytes: list[int], tokens: int) -> tuple[float, float, float]:
    """(VRAM bytes, host-resident bytes, expected layers that need a host-resident expert) of routed
    experts for one step of `tokens` tokens."""
    vram = host = layers = 0.0
    for row, ids, size in zip(stats.hits, resident, expert_bytes):
        held = set(ids)
        none_on_host = 1.0
        for expert, hits in enumerate(row):
            touched = expected_touched(hits, tokens)
            if expert in held:
                vram += touched * size
            else:
                host += touched * size
                none_on_host *= 1.0 - touched
        layers += 1.0 - none_on_host
    return vram, host, layers


def predict(
    dims: ModelDims,
    profile: DeviceProfile,
    options: PlanOptions,
    weights: WeightTraffic,
    stats: RoutingStats,
    resident: list[list[int]],
    expert_bytes: list[int],
    cache: CacheSimulation | None = None,
) -> Prediction:
    """Decode tokens/s (without and, when speculating, with MTP) and prefill tokens/s of a placement; `cache`: the
    load's simulated expert cache, where experts are offloaded."""
    timings, source = engine_timings(profile)
    vram_rate = profile.memory_bandwidth_gbs * 1e9 * timings["weight_bandwidth_efficiency"]
    zero_copy = profile.h2d_bandwidth_gbs * 1e9 * timings["zero_copy_efficiency"]
    context = min(options.at_context, options.max_context)
    kv_layer = kv_layer_bytes_per_token(dims, options.kv_dtype) * context
    offloaded = any(len(ids) < len(row) for ids, row in zip(resident, stats.hits))
    bookkeeping = timings["offload_step_s"] if offloaded else 0.0
    cpu_rate = profile.dram_bandwidth_gbs * 1e9 * CPU_EXPERT_SHARE_OF_DRAM
    _, plan_host, plan_layers = _expert_traffic(stats, resident, expert_bytes, 1)

    def step(tokens: int, sequences: int = 1) -> tuple[float, float, float]:
        """(seconds, VRAM bytes, PCIe bytes) of one target forward over `tokens` positions of `sequences` sequences
        (each with its own KV cache and GDN state), misses served by the miss path ("auto": the faster of the two, as it
        chooses by measured step time)."""
        expert_vram, expert_host, host_layers = _expert_traffic(stats, resident, expert_bytes, tokens)
        if cache is not None and plan_host > 0:
            cached_host = expert_host * cache.host_bytes_per_token / plan_host
            expert_vram, expert_host = expert_vram + expert_host - cached_host, cached_host
            host_layers *= cache.host_layers_per_token / plan_layers
        embedding = weights.embedding_row_bytes * tokens
        vram = weights.dense_text_bytes + weights.head_bytes + expert_vram + sequences * dims.num_attention_layers * kv_layer
        vram += gdn_state_bytes(dims) * (sequences + tokens)  # read each sequence's state, write one per position
        pcie = 0.0 if weights.embedding_on_device else embedding
        if weights.embedding_on_device:
            vram += embedding
        seconds = timings["decode_fixed_s"] + max(timings["decode_weight_floor_s"], vram / vram_rate) + bookkeeping
        seconds += 0.0 if weights.embedding_on_device else embedding / zero_copy
        # each layer with host work hands it to the host and waits for the answer
        misses = {"pcie": expert_host / zero_copy, "cpu": expert_host / cpu_rate + host_layers * timings["cpu_request_s"]}
        path = min(misses, key=misses.get) if options.miss_path == "auto" else options.miss_path
        return seconds + misses[path], vram, pcie + (expert_host if path == "pcie" else 0.0)

    seconds, vram_bytes, pcie_bytes = step(1)
    decode_mtp = None
    if options.speculating:
        drafts = options.draft_count
        draft_bytes = weights.mtp_dense_bytes + dims.top_k * weights.mtp_expert_bytes + weights.draft_head_bytes + kv_layer
        draft_seconds = drafts * max(timings["mtp_draft_step_s"], draft_bytes / vram_rate)
        verify_seconds = step(drafts + 1)[0] + drafts * timings["verify_token_s"] + timings["spec_round_s"]
        a = options.mtp_acceptance
        tokens_per_step = (1 - a ** (drafts + 1)) / (1 - a)
        decode_mtp = tokens_per_step / (draft_seconds + verify_seconds)

    decode_batch = None
    if options.concurrency > 1:  # a decode step of one token for each sequence: the verify step's per-token cost for each
        batch = options.concurrency
        decode_batch = batch / (step(batch, batch)[0] + (batch - 1) * timings["verify_token_s"])

    chunk = options.prefill_chunk
    expert_params = 3 * dims.hidden_size * dims.moe_intermediate_size * dims.top_k * dims.num_layers
    attention_flops = dims.num_attention_layers * 4 * context * dims.num_attention_heads * dims.head_dim
    flops = chunk * (2 * (weights.dense_text_params + expert_params) + attention_flops)
    compute_seconds = max(timings["prefill_chunk_floor_s"], flops / (profile.tensor_tflops * 1e12 * timings["prefill_efficiency"]))
    expert_vram, expert_pcie, _ = _expert_traffic(stats, resident, expert_bytes, chunk)
    weight_seconds = (weights.dense_text_bytes + weights.head_bytes + expert_vram) / vram_rate
    gpu_seconds, transfer_seconds = max(compute_seconds, weight_seconds), expert_pcie / zero_copy
    hidden = timings["prefill_transfer_overlap"] * min(gpu_seconds, transfer_seconds)
    prefill_seconds = gpu_seconds + transfer_seconds - hidden
    assumptions = (source,) + device_assumptions(profile, options.miss_path, timings) + (cache_assumption(cache),)
    assumptions += general_assumptions(options, stats.source)
    return Prediction(
        decode_tok_s=1.0 / seconds,
        decode_tok_s_mtp=decode_mtp,
        decode_tok_s_batch=decode_batch,
        prefill_tok_s=chunk / prefill_seconds,
        vram_bytes_per_token=int(vram_bytes),
        pcie_bytes_per_token=pcie_bytes,
        assumptions=assumptions,
        cache_hit_rate=None if cache is None else cache.hit_rate,
    )


def cache_assumption(cache: CacheSimulation | None) -> str:
    """Which experts decode finds in VRAM."""
    if cache is None:
        return "decode finds every routed expert in VRAM"
    return (
        f"decode finds {cache.hit_rate:.1%} of its experts in VRAM: the load pins the plan's experts but the coldest "
        f"{CACHE_SHARE:.0%} of their bytes, which with the staging slots make {cache.cache_slots:,} slots of the "
        f"{DEFAULT_CACHE_POLICY} cache, simulated on {SIMULATED_TOKENS} tokens of routing drawn from the statistics "
        "(prefill: the plan's experts alone)"
    )


def device_assumptions(profile: DeviceProfile, miss_path: str, timings: dict[str, float]) -> tuple[str, ...]:
    """The assumptions that depend on the device profile."""
    cpu = f"{CPU_EXPERT_SHARE_OF_DRAM:.0%} of the {profile.dram_bandwidth_gbs:g} GB/s host DRAM bandwidth"
    pcie = f"{timings['zero_copy_efficiency']:.0%} of the {profile.h2d_bandwidth_gbs:g} GB/s pinned H2D bandwidth"
    misses = {
        "pcie": f"decode reads host-resident experts over PCIe at {pcie}",
        "cpu": f"decode computes host-resident experts on the host, streaming them at {cpu}, "
        f"{timings['cpu_request_s'] * 1e3:.2f} ms per layer handed to the host",
        "auto": f"decode serves host-resident experts by the faster of PCIe reads at {pcie} and host compute at {cpu} "
        f"({timings['cpu_request_s'] * 1e3:.2f} ms per layer handed to the host)",
    }[miss_path]
    return (
        f"a decode forward: {timings['decode_fixed_s'] * 1e3:.2f} ms of fixed work + the weight kernels, at least "
        f"{timings['decode_weight_floor_s'] * 1e3:.2f} ms, at most {timings['weight_bandwidth_efficiency']:.0%} of the "
        f"{profile.memory_bandwidth_gbs:g} GB/s memory bandwidth; {timings['offload_step_s'] * 1e3:.2f} ms more with offloaded experts",
        misses,
        f"prefill reads host-resident experts at {pcie}, {timings['prefill_transfer_overlap']:.0%} of the shorter of "
        "transfer and compute overlapped",
        f"quantized prefill reaches {timings['prefill_efficiency']:.0%} of the {profile.tensor_tflops:g} TFLOPS tensor throughput, "
        f"a chunk taking at least {timings['prefill_chunk_floor_s'] * 1e3:.0f} ms (the host launching its kernels)",
    )


def general_assumptions(options: PlanOptions, routing_source: str) -> tuple[str, ...]:
    """The assumptions shared by every device."""
    context = min(options.at_context, options.max_context)
    draft_head = "proposal head" if options.proposal_head else "output head"
    speculation = (
        f"MTP: {options.draft_count} drafts per step, per-draft acceptance {options.mtp_acceptance:g} (assumed), "
        f"drafting with the {draft_head}"
        if options.speculating
        else "no speculation"
    )
    return (
        f"decode at batch 1 and context {context} tokens; KV and GDN state traffic included",
        f"routing from {routing_source}; tokens of one step route independently",
        speculation,
        f"prefill in chunks of {options.prefill_chunk}; every host-resident expert a chunk needs moves once per chunk",
    )
