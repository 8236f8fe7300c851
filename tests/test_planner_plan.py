"""The planner: feasibility per card, byte accounting, routing stats, infeasibility (budgets: test_planner_budget)."""

from __future__ import annotations

from dataclasses import replace

import pytest

from ninfer_offload.artifact.inventory import Inventory
from ninfer_offload.errors import NinferError
from ninfer_offload.artifact.contract import official_directory
from ninfer_offload.planner import PLAN_SCHEMA, PlanOptions, RoutingStats, load_routing_stats, parse_size, plan
from ninfer_offload.planner.cost import CPU_EXPERT_SHARE_OF_DRAM
from ninfer_offload.planner.memory import SCRATCH_KV_ROWS, pool_bytes
from ninfer_offload.planner.planner import RUNTIME_HOST_BYTES
from ninfer_offload.planner.routing import shipped_routing_stats
from ninfer_offload.planner.schema import schema_errors
from ninfer_offload.profiles import load_profile

GiB = 2**30


@pytest.fixture(scope="module")
def inventory() -> Inventory:
    return Inventory.from_directory(official_directory())


def test_default_rtx5090_is_all_resident(inventory):
    p = plan(inventory, load_profile("rtx5090"))
    assert p.feasible and p.reason is None
    assert p.experts_resident == p.experts_total == 40 * 256
    assert p.routing_mass_resident == pytest.approx(1.0)
    assert p.host_pinned_bytes == 0 and p.staging_slots == 0 and p.runtime["prefill_staging"] == 0
    assert {n: c.placement for n, c in p.components.items()} == {
        "text_dense": "vram", "output_head": "vram", "token_embedding": "vram", "routed_experts": "vram",
        "mtp": "vram", "proposal": "vram", "vision": "unused", "dflash": "unused",
    }
    assert p.kv_capacity_tokens == 262144
    # fp8 KV: 10 full-attention layers + the MTP layer, K and V, 2 heads x 256, 1 byte each, for the
    # context plus the scratch slot's rows (padding of captured batches, see StatePool).
    assert p.runtime["kv_cache"] == 11 * 2 * 2 * 256 * (262144 + SCRATCH_KV_ROWS)  # one sequence and the scratch rows
    assert p.vram_used_bytes <= p.vram_budget_bytes
    assert p.predicted.decode_tok_s > 0 and p.predicted.decode_tok_s_mtp > 0 and p.predicted.prefill_tok_s > 0


def test_rtx5060ti_offloads_part_of_the_experts(inventory):
    p = plan(inventory, load_profile("rtx5060ti"))
    assert p.feasible
    assert 0 < p.experts_resident < p.experts_total
    assert p.vram_used_bytes <= p.vram_budget_bytes == 16 * GiB
    assert p.components["routed_experts"].placement == "split"
    assert p.components["token_embedding"].placement == "host"
    assert p.staging_slots == 2 * 8 * 4  # two layers in flight x top-8 x (1 + 3 drafts)
    # two prefill staging buffers of PREFILL_STAGING_SLOTS records, and a forward of 4 chunks of 4096 tokens: the other
    # three chunks' residual and layer output rows and the four chunks' hidden states, twice (each, then joined), in bf16
    span = (2 * 3 + 2 * 4) * 4096 * 2048 * 2
    assert p.runtime["prefill_staging"] == 2 * 128 * max(p.expert_bytes) + span
    # The load's host pool holds every expert record, the MTP layer's too (as locked: `pool_bytes`); the embedding is on the host.
    layers = [b.expert_bytes * b.num_experts for b in inventory.banks_of("text") + inventory.banks_of("mtp")]
    assert p.host_pinned_bytes == pool_bytes(layers, pinned=True) + p.components["token_embedding"].bytes
    assert p.host_process_bytes == p.host_pinned_bytes + RUNTIME_HOST_BYTES
    assert p.host_pinned_bytes <= p.host_budget_bytes
    assert p.predicted.pcie_bytes_per_token > 0
    assert 0 < p.routing_mass_resident < 1


def test_rtxpro6000_all_resident_with_vision(inventory):
    p = plan(inventory, load_profile("rtxpro6000"), PlanOptions(vision=True))
    assert p.feasible and p.experts_resident == p.experts_total
    assert p.components["vision"].placement == "vram"


def test_every_byte_counted_once(inventory):
    for name in ("rtx5090", "rtx5060ti"):
        p = plan(inventory, load_profile(name))
        assert sum(c.bytes for c in p.components.values()) == inventory.total_bytes
        weights_vram = sum(c.vram_bytes for c in p.components.values())
        assert p.vram_used_bytes == weights_vram + sum(p.runtime.values())
        for c in p.components.values():
            assert c.vram_bytes + c.host_bytes == (0 if c.placement == "unused" else c.bytes)


def test_resident_experts_are_hottest_first(inventory):
    stats = shipped_routing_stats()
    p = plan(inventory, load_profile("rtx5060ti"))
    for layer, ids in enumerate(p.resident_experts):
        hits = stats.hits[layer]
        assert [hits[e] for e in ids] == sorted((hits[e] for e in ids), reverse=True)
        coldest_kept = min(hits[e] for e in ids)
        assert all(hits[e] <= coldest_kept for e in set(range(256)) - set(ids))


def test_infeasible_budget_gives_one_line_reason(inventory):
    p = plan(inventory, load_profile("rtx5090"), PlanOptions(vram_budget=2 * GiB))
    assert not p.feasible and p.predicted is None
    assert "\n" not in p.reason and "needs" in p.reason and "--max-context" in p.reason and "budget is 2.0 GiB" in p.reason


def test_host_budget_is_checked(inventory):
    p = plan(inventory, load_profile("rtx5060ti"), PlanOptions(host_budget=1 * GiB))
    assert not p.feasible and "pinned host memory" in p.reason and "budget is 1.0 GiB (given by --host-budget)" in p.reason
    default = plan(inventory, load_profile("rtx5060ti"), PlanOptions(vram_budget=9 * GiB))
    assert default.feasible or "75% of" in default.reason


def test_the_process_host_memory_is_counted_against_the_ram(inventory):
    """Pinned pool, embedding and the runtime's own memory against the card's host RAM: refused past the RAM,
    a note past the pinned budget (little left for the OS), fine within it."""
    options = PlanOptions(speculative="none", max_context=32768, vram_budget=12 * GiB)
    card = load_profile("rtx5060ti")
    fits = plan(inventory, card, options)
    assert fits.feasible and fits.notes == [] and fits.host_process_bytes < fits.host_budget_bytes
    tight = plan(inventory, card, replace(options, host_budget=fits.host_process_bytes - 1))
    assert tight.feasible and tight.notes[0].startswith(f"host memory {fits.host_process_bytes / GiB:.1f} GiB (pinned")
    small = replace(card, ram_bytes=fits.host_process_bytes - 1)
    refused = plan(inventory, small, replace(options, host_budget=fits.host_pinned_bytes))
    assert not refused.feasible and refused.reason.startswith(f"needs {fits.host_process_bytes / GiB:.1f} GiB of host memory")


def test_kv_dtype_and_context_scale_kv(inventory):
    profile = load_profile("rtxpro6000")
    row = 11 * 2 * 2 * 256  # fp8 K and V of one token in the 10 attention layers and the MTP layer
    base = plan(inventory, profile, PlanOptions(kv_dtype="fp8", max_context=1000)).runtime["kv_cache"]
    assert base == row * (1000 + SCRATCH_KV_ROWS)  # the context and the scratch slot's rows
    assert plan(inventory, profile, PlanOptions(kv_dtype="bf16", max_context=1000)).runtime["kv_cache"] == 2 * base
    three = plan(inventory, profile, PlanOptions(kv_dtype="fp8", max_context=1000, concurrency=3))
    assert three.runtime["kv_cache"] == row * (3000 + SCRATCH_KV_ROWS)
    no_mtp = plan(inventory, profile, PlanOptions(kv_dtype="fp8", max_context=1000, speculative="none"))
    assert no_mtp.runtime["kv_cache"] == row // 11 * 10 * (1000 + SCRATCH_KV_ROWS)
    assert no_mtp.components["mtp"].placement == "unused" and no_mtp.predicted.decode_tok_s_mtp is None


def test_routing_stats_file_changes_the_choice(inventory, tmp_path):
    rows = [" ".join(str(1000 if e == 255 - layer % 256 else 1) for e in range(256)) for layer in range(40)]
    path = tmp_path / "counts.txt"
    path.write_text("\n".join(rows) + "\n")
    stats = load_routing_stats(path, top_k=8)
    p = plan(inventory, load_profile("rtx5060ti"), routing_stats=stats)
    assert p.routing_stats == str(path)
    assert all(ids[0] == 255 - layer for layer, ids in enumerate(p.resident_experts))


def test_routing_stats_shape_mismatch(inventory, tmp_path):
    path = tmp_path / "short.txt"
    path.write_text("1 2 3\n")
    with pytest.raises(NinferError, match="1 x 3"):
        plan(inventory, load_profile("rtx5090"), routing_stats=load_routing_stats(path, top_k=8))
    path.write_text("1 x 3\n")
    with pytest.raises(NinferError, match="not an integer"):
        load_routing_stats(path, top_k=8)


def test_shipped_stats_and_uniform():
    stats = shipped_routing_stats()
    assert len(stats.hits) == 40 and all(len(r) == 256 for r in stats.hits)
    assert all(sum(r) == pytest.approx(8) for r in stats.hits)
    uniform = RoutingStats.uniform(3, 16, 2)
    assert uniform.hits[0][0] == pytest.approx(2 / 16)


def test_json_matches_schema(inventory):
    for name, options in [("rtx5090", PlanOptions()), ("rtx5060ti", PlanOptions()), ("rtx5090", PlanOptions(vram_budget=GiB))]:
        document = plan(inventory, load_profile(name), options).to_json()
        assert schema_errors(document, PLAN_SCHEMA) == []
        assert len(document["experts_resident_per_layer"]) == 40


def test_schema_checker_rejects_bad_documents(inventory):
    document = plan(inventory, load_profile("rtx5090")).to_json()
    broken = dict(document, feasible="yes", extra=1)
    del broken["kv_capacity_tokens"]
    broken["components"] = dict(broken["components"], text_dense={"bytes": -1, "placement": "gpu", "vram_bytes": 0, "host_bytes": 0})
    errors = schema_errors(broken, PLAN_SCHEMA)
    assert any("feasible" in e for e in errors)
    assert any("unexpected 'extra'" in e for e in errors)
    assert any("missing 'kv_capacity_tokens'" in e for e in errors)
    assert any("text_dense.bytes" in e for e in errors) and any("'gpu' not in" in e for e in errors)


@pytest.mark.parametrize(
    "text, expected",
    [
        ("2GiB", 2 * GiB), ("24GB", 24 * 10**9), ("512MiB", 512 * 2**20), ("1.5G", 1_500_000_000), ("4096B", 4096), ("7 gib", 7 * GiB),
        ("0", 0),
    ],
)
def test_parse_size(text, expected):
    assert parse_size(text) == expected


def test_sizes_without_a_unit_are_refused():
    with pytest.raises(NinferError, match=r"size '12' has no unit; write e.g. 12GiB \(binary\) or 12GB \(decimal\)"):
        parse_size("12")


def test_at_context_is_within_the_context():
    assert PlanOptions(max_context=1000).at_context == 1000 and PlanOptions().at_context == 4096
    with pytest.raises(NinferError, match="--at-context 4096 is beyond the context of 2048 tokens"):
        PlanOptions(max_context=2048, at_context=4096)


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"kv_dtype": "fp4"}, "--kv-dtype"), ({"drafts": 6}, "--drafts"), ({"max_context": 0}, "--max-context"),
        ({"speculative": "eagle"}, "--spec"),
    ],
)
def test_bad_options(kwargs, message):
    with pytest.raises(NinferError, match=message):
        PlanOptions(**kwargs)
    with pytest.raises(NinferError, match="cannot read size"):
        parse_size("lots")


def test_miss_paths(inventory):
    profile = load_profile("rtx5060ti")
    pcie, cpu, auto = (plan(inventory, profile, PlanOptions(miss_path=m)) for m in ("pcie", "cpu", "auto"))
    assert pcie.resident_experts == cpu.resident_experts == auto.resident_experts
    assert cpu.predicted.pcie_bytes_per_token == pytest.approx(pcie.components["token_embedding"].bytes / 248320, rel=0.01)
    # auto chooses by measured step time, so the plan predicts the faster path, with that path's traffic
    faster = max((pcie, cpu), key=lambda p: p.predicted.decode_tok_s)
    assert auto.predicted.decode_tok_s == faster.predicted.decode_tok_s
    assert auto.predicted.pcie_bytes_per_token == faster.predicted.pcie_bytes_per_token
    # the CPU path pays its record bytes at the host's expert rate plus a hand-off per layer with host work
    from ninfer_offload.planner.cost import engine_timings

    request = engine_timings(profile)[0]["cpu_request_s"]
    host_bytes = pcie.predicted.pcie_bytes_per_token - cpu.predicted.pcie_bytes_per_token
    cpu_extra = 1 / cpu.predicted.decode_tok_s - 1 / pcie.predicted.decode_tok_s
    rates = host_bytes / (CPU_EXPERT_SHARE_OF_DRAM * profile.dram_bandwidth_gbs * 1e9) - host_bytes / (profile.h2d_bandwidth_gbs * 1e9)
    layers = (cpu_extra - rates) / request  # the expected layers handed over, between none and all
    assert 0 < layers <= len(pcie.resident_experts)
    assert auto.predicted.prefill_tok_s == pcie.predicted.prefill_tok_s
    with pytest.raises(NinferError, match="--miss-path"):
        PlanOptions(miss_path="gpu")


def test_prediction_follows_the_launch_model_and_the_measured_engine_timings(inventory):
    """On the benchmark machine the resident step is the launch model's forward, within 15 % of the measured 509.7
    tok/s at 1K context (bench/results/resident_h200_a0d2a21.json); offloading adds the bookkeeping and the misses
    at PCIe speed; a card without constants borrows the nearest measured card's and says so."""
    h200 = load_profile("h200")
    timings = h200.engine
    options = PlanOptions(max_context=32768, at_context=1024, speculative="none", kv_dtype="bf16", prefill_chunk=1024)
    resident = plan(inventory, h200, options)
    assert resident.predicted.decode_tok_s == pytest.approx(509.7, rel=0.15)
    split = plan(inventory, h200, replace(options, vram_budget=15 * 2**30))
    misses = split.predicted.pcie_bytes_per_token / (h200.h2d_bandwidth_gbs * 1e9 * timings["zero_copy_efficiency"])
    step = 1 / resident.predicted.decode_tok_s + timings["offload_step_s"] + misses
    assert 1 / split.predicted.decode_tok_s == pytest.approx(step, rel=0.03)
    assert "measured on h200" in resident.predicted.assumptions[0]
    assert "launch latencies and bandwidth shares measured on h200" in resident.predicted.assumptions[1]
    small = plan(inventory, load_profile("rtx5060ti"), options).predicted.assumptions
    assert "measured on the h200" in small[0] and "measured on the h100" in small[1]


def test_speculation_is_on_where_the_projected_speedup_pays(inventory):
    """The plan's speculation decision (`--spec auto`) follows the cost model's projection: with drafts that are always
    accepted the projected speed-up passes SPECULATION_MIN_SPEEDUP, with drafts never accepted it cannot; without
    speculation there is no decision to take."""
    from ninfer_offload.planner.options import SPECULATION_MIN_SPEEDUP

    card = load_profile("rtx5090")
    for acceptance, on in ((0.99, True), (0.0, False)):
        predicted = plan(inventory, card, PlanOptions(mtp_acceptance=acceptance)).predicted
        assert predicted.speculation_speedup == pytest.approx(predicted.decode_tok_s_mtp / predicted.decode_tok_s)
        assert predicted.speculates is on and (predicted.speculation_speedup >= SPECULATION_MIN_SPEEDUP) is on
    plain = plan(inventory, card, PlanOptions(speculative="none")).predicted
    assert plain.speculation_speedup is None and not plain.speculates


def test_a_batch_of_sequences_is_predicted_against_its_measurement(inventory):
    """Decoding 8 sequences together: between one sequence's rate and 8x it, and within 15 % of the all-resident
    batch-8 step measured on the H200 at 1K context (`bench/results/resident_h200_a0d2a21.json`)."""
    import json
    from pathlib import Path

    measured = json.loads((Path(__file__).parent.parent / "bench/results/resident_h200_a0d2a21.json").read_text())
    batch8 = next(b["aggregate_tok_s"] for b in measured["batched_decode"] if b["batch"] == 8)
    options = PlanOptions(max_context=4096, at_context=1024, speculative="none", concurrency=8)
    predicted = plan(inventory, load_profile("h200"), options).predicted
    assert predicted.decode_tok_s < predicted.decode_tok_s_batch < 8 * predicted.decode_tok_s
    assert predicted.decode_tok_s_batch == pytest.approx(batch8, rel=0.15)
    one = plan(inventory, load_profile("h200"), replace(options, concurrency=1)).predicted
    assert one.decode_tok_s_batch is None
