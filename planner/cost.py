"""Cost model: predicted decode and prefill tokens/s from the bytes each token moves and this
engine's measured timings.

A decode forward of T tokens for each of B sequences (one-token decode, verification of drafts, a batch step)
costs its launches (`launches.forward_launches`, each at its kernel family's latency plus its bytes at the
family's share of the memory bandwidth: `launch_cost`), with offloaded experts the cache bookkeeping, and the
routed experts not in VRAM served
by the miss path (read over PCIe zero-copy, or computed on the host at a cost per layer handed over;
"auto" the faster). Which experts a decode step finds in VRAM comes from the simulated adaptive cache of the
load (`cache_split.simulate_decode_cache`) when experts are offloaded: its one-token figures as simulated, a
multi-token step's host reads scaled by the same ratio to the plan's resident set alone. Prefill of a chunk is
compute- or weight-bound on the GPU plus one read of every host-resident expert the chunk touches,
partly overlapped. The timings come from the profile's `[engine]` table, measured by
`bench/resident.py` and `bench/offload.py`, and its `[launches]` table, fitted by `bench/calibrate_launches.py`;
a card without a complete table borrows the missing entries from the shipped profile with a complete one nearest
to it in memory bandwidth (`calibration_profile`), which the assumptions say and `ninfer plan` warns about.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

from ninfer_offload.artifact.dims import ModelDims
from ninfer_offload.planner.cache_split import CACHE_SHARE, SIMULATED_TOKENS, CacheSimulation
from ninfer_offload.planner.launch_cost import LaunchConstants, forward_seconds, launch_keys
from ninfer_offload.planner.launches import ForwardWeights, counts, expected_touched, forward_launches
from ninfer_offload.planner.memory import kv_layer_bytes_per_token
from ninfer_offload.planner.options import PlanOptions
from ninfer_offload.planner.request import DEFAULT_CACHE_POLICY
from ninfer_offload.planner.placement import Prediction
from ninfer_offload.planner.routing import RoutingStats
from ninfer_offload.profiles import ENGINE_KEYS, DeviceProfile, load_profile, shipped_names
# Host expert kernels consume records at this share of DRAM bandwidth, all cores: measured 0.63
# (bf16 activations; 0.59 float32) on the H200 host's 16 Emerald Rapids vCPUs and 0.85 on 2 Zen 5
# cores (bench/results/cpu_experts_*.json).
CPU_EXPERT_SHARE_OF_DRAM = 0.6


TABLES = ("engine", "launches")  # the profile tables of measured constants


def _table(profile: DeviceProfile, table: str) -> dict[str, float]:
    return getattr(profile, table) or {}


def _complete(profile: DeviceProfile, table: str) -> bool:
    keys = ENGINE_KEYS if table == "engine" else launch_keys()
    return all(key in _table(profile, table) for key in keys)


@functools.lru_cache(maxsize=2)
def _calibrated_profiles(table: str) -> tuple[DeviceProfile, ...]:
    """The shipped profiles whose `table` is complete (the cards the benchmarks measured)."""
    return tuple(p for p in map(load_profile, shipped_names()) if _complete(p, table))


def calibration_profile(profile: DeviceProfile, table: str = "engine") -> DeviceProfile | None:
    """The shipped profile whose `table` (`[engine]` or `[launches]`) `profile` borrows: None when its own is
    complete, else the calibrated one nearest in memory bandwidth (ties by name)."""
    if _complete(profile, table):
        return None
    return min(_calibrated_profiles(table), key=lambda p: (abs(p.memory_bandwidth_gbs - profile.memory_bandwidth_gbs), p.name))


def _measured(profile: DeviceProfile, table: str, what: str) -> tuple[dict[str, float], str]:
    """The profile's `table`, completed from `calibration_profile`'s, and where it comes from."""
    own = _table(profile, table)
    reference = calibration_profile(profile, table)
    if reference is None:
        return dict(own), f"{what} measured on {profile.name}"
    return {**_table(reference, table), **own}, (
        f"{what} measured on the {reference.name}, the nearest measured card in memory bandwidth "
        f"({profile.name} has no complete [{table}] table)"
    )


def engine_timings(profile: DeviceProfile) -> tuple[dict[str, float], str]:
    """The profile's measured engine timings, completed from `calibration_profile`'s, and where they come from."""
    return _measured(profile, "engine", "engine timings")


def launch_constants(profile: DeviceProfile) -> tuple[LaunchConstants, str]:
    """The profile's launch constants, completed from `calibration_profile`'s, and where they come from."""
    table, source = _measured(profile, "launches", "launch latencies and bandwidth shares")
    return LaunchConstants.from_table(table, f"profile {profile.name}"), source


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
    forward: ForwardWeights  # the products a forward launches


@dataclass(frozen=True)
class ExpertTraffic:
    """The routed experts one step of some tokens needs: expected distinct ones per layer in VRAM and on the host,
    and the expected layers that need a host-resident one."""

    vram: list[float]
    host: list[float]
    host_layers: float

    def host_bytes(self, expert_bytes: list[int]) -> float:
        return sum(n * size for n, size in zip(self.host, expert_bytes))

    def vram_bytes(self, expert_bytes: list[int]) -> float:
        return sum(n * size for n, size in zip(self.vram, expert_bytes))

    def cached(self, share: float, layer_share: float) -> "ExpertTraffic":
        """The same step with only `share` of its host-resident experts still on the host (the rest found in
        the cache) and `layer_share` of its layers with host work."""
        return ExpertTraffic(
            [v + h * (1.0 - share) for v, h in zip(self.vram, self.host)], [h * share for h in self.host], self.host_layers * layer_share
        )


def _expert_traffic(stats: RoutingStats, resident: list[list[int]], tokens: int) -> ExpertTraffic:
    """The routed experts of one step of `tokens` independently routed tokens, the plan's `resident` in VRAM."""
    vram, host, layers = [], [], 0.0
    for row, ids in zip(stats.hits, resident):
        held = set(ids)
        none_on_host, in_vram, on_host = 1.0, 0.0, 0.0
        for expert, hits in enumerate(row):
            touched = expected_touched(hits, tokens)
            if expert in held:
                in_vram += touched
            else:
                on_host += touched
                none_on_host *= 1.0 - touched
        vram.append(in_vram)
        host.append(on_host)
        layers += 1.0 - none_on_host
    return ExpertTraffic(vram, host, layers)


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
    constants, launch_source = launch_constants(profile)
    vram_rate = profile.memory_bandwidth_gbs * 1e9 * timings["weight_bandwidth_efficiency"]
    zero_copy = profile.h2d_bandwidth_gbs * 1e9 * timings["zero_copy_efficiency"]
    context = min(options.at_context, options.max_context)
    kv_token = kv_layer_bytes_per_token(dims, options.kv_dtype)
    offloaded = any(len(ids) < len(row) for ids, row in zip(resident, stats.hits))
    bookkeeping = timings["offload_step_s"] if offloaded else 0.0
    cpu_rate = profile.dram_bandwidth_gbs * 1e9 * CPU_EXPERT_SHARE_OF_DRAM
    plan_traffic = _expert_traffic(stats, resident, 1)
    plan_host = plan_traffic.host_bytes(expert_bytes)

    def step(tokens: int, sequences: int = 1) -> tuple[float, float, float]:
        """(seconds, VRAM bytes, PCIe bytes) of one target forward over `tokens` positions of `sequences` sequences
        (each with its own KV cache and GDN state), misses served by the miss path ("auto": the faster of the two, as it
        chooses by measured step time)."""
        traffic = _expert_traffic(stats, resident, tokens)
        if cache is not None and plan_host > 0:
            traffic = traffic.cached(cache.host_bytes_per_token / plan_host, cache.host_layers_per_token / plan_traffic.host_layers)
        launches = forward_launches(dims, weights.forward, tokens // sequences, sequences, context, traffic.vram, kv_token)
        embedding = weights.embedding_row_bytes * tokens
        vram = sum(launch.count * launch.bytes for launch in launches) + (embedding if weights.embedding_on_device else 0)
        seconds = forward_seconds(launches, constants, profile) + bookkeeping
        pcie = 0.0 if weights.embedding_on_device else embedding
        seconds += pcie / zero_copy
        expert_host = traffic.host_bytes(expert_bytes)
        # each layer with host work hands it to the host and waits for the answer
        misses = {"pcie": expert_host / zero_copy, "cpu": expert_host / cpu_rate + traffic.host_layers * timings["cpu_request_s"]}
        path = min(misses, key=misses.get) if options.miss_path == "auto" else options.miss_path
        return seconds + misses[path], vram, pcie + (expert_host if path == "pcie" else 0.0)

    seconds, vram_bytes, pcie_bytes = step(1)
    decode_mtp = None
    if options.speculating:
        drafts = options.draft_count
        draft_bytes = weights.mtp_dense_bytes + dims.top_k * weights.mtp_expert_bytes + weights.draft_head_bytes + kv_token * context
        draft_seconds = drafts * max(timings["mtp_draft_step_s"], draft_bytes / vram_rate)
        verify_seconds = step(drafts + 1)[0] + timings["spec_round_s"]
        a = options.mtp_acceptance
        tokens_per_step = (1 - a ** (drafts + 1)) / (1 - a)
        decode_mtp = tokens_per_step / (draft_seconds + verify_seconds)

    decode_batch = None
    if options.concurrency > 1:  # a decode step of one token for each sequence
        batch = options.concurrency
        decode_batch = batch / step(batch, batch)[0]

    chunk = options.prefill_chunk
    expert_params = 3 * dims.hidden_size * dims.moe_intermediate_size * dims.top_k * dims.num_layers
    attention_flops = dims.num_attention_layers * 4 * context * dims.num_attention_heads * dims.head_dim
    flops = chunk * (2 * (weights.dense_text_params + expert_params) + attention_flops)
    compute_seconds = max(timings["prefill_chunk_floor_s"], flops / (profile.tensor_tflops * 1e12 * timings["prefill_efficiency"]))
    chunk_traffic = _expert_traffic(stats, resident, chunk)
    expert_pcie = chunk_traffic.host_bytes(expert_bytes)
    weight_seconds = (weights.dense_text_bytes + weights.head_bytes + chunk_traffic.vram_bytes(expert_bytes)) / vram_rate
    gpu_seconds, transfer_seconds = max(compute_seconds, weight_seconds), expert_pcie / zero_copy
    hidden = timings["prefill_transfer_overlap"] * min(gpu_seconds, transfer_seconds)
    prefill_seconds = gpu_seconds + transfer_seconds - hidden
    one_token = counts(forward_launches(dims, weights.forward, 1, 1, context, plan_traffic.vram, kv_token))
    assumptions = (source, launch_source) + device_assumptions(profile, options.miss_path, timings, constants, one_token)
    assumptions += (cache_assumption(cache),)
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


def device_assumptions(
    profile: DeviceProfile, miss_path: str, timings: dict[str, float], constants: LaunchConstants, one_token: dict[str, int]
) -> tuple[str, ...]:
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
        f"a decode forward: its {sum(one_token.values())} launches for one token (more for several), each its kernel "
        f"family's latency ({min(constants.latency_s.values()) * 1e6:.1f}-{max(constants.latency_s.values()) * 1e6:.1f} us) "
        f"plus its bytes at the family's share of the {profile.memory_bandwidth_gbs:g} GB/s memory bandwidth "
        f"({min(constants.bandwidth_share.values()):.0%}-{max(constants.bandwidth_share.values()):.0%}), "
        f"{constants.forward_gap_s * 1e3:+.2f} ms per forward; {timings['offload_step_s'] * 1e3:.2f} ms more with offloaded experts",
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
