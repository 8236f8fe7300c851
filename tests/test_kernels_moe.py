"""Fused routed-experts kernels vs a direct float64 evaluation of the dequantized expert records."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from kernels_support import DEVICE, needs_triton_device
from ninfer_offload.artifact.codecs import decode_row_split_values, encode_row_split
from ninfer_offload.artifact.records import ExpertRecordLayout
from ninfer_offload.kernels.arrivals import arrival_counts

pytestmark = needs_triton_device

HIDDEN, INTER, EXPERTS = 200, 72, 6


def _records(gate_up_fmt: str, down_fmt: str, seed: int):
    rng = np.random.default_rng(seed)
    layout = ExpertRecordLayout.create(gate_up_fmt, down_fmt, HIDDEN, INTER)
    records = np.zeros(EXPERTS * layout.nbytes, dtype=np.uint8)
    weights = []
    for e in range(EXPERTS):
        gu = encode_row_split(rng.standard_normal((2 * INTER, HIDDEN)).astype(np.float32) / HIDDEN**0.5, gate_up_fmt)
        dn = encode_row_split(rng.standard_normal((HIDDEN, INTER)).astype(np.float32) / INTER**0.5, down_fmt)
        at = e * layout.nbytes
        records[at : at + gu.size] = gu
        records[at + layout.down_offset : at + layout.down_offset + dn.size] = dn
        weights.append(
            (
                torch.from_numpy(decode_row_split_values(gu, gate_up_fmt, 2 * INTER, HIDDEN)).double(),
                torch.from_numpy(decode_row_split_values(dn, down_fmt, HIDDEN, INTER)).double(),
            )
        )
    return layout, torch.from_numpy(records).to(DEVICE), weights


def _reference(x, ids, w, weights):
    out = torch.zeros(x.shape, dtype=torch.float64)
    for t in range(x.shape[0]):
        for j in range(ids.shape[1]):
            gu, dn = weights[int(ids[t, j])]
            h = gu @ x[t].double()
            act = torch.nn.functional.silu(h[:INTER]) * h[INTER:]
            out[t] += float(w[t, j]) * (dn @ act)
    return out


def _assert_matches_reference(records: tuple, x: torch.Tensor, ids: torch.Tensor, w: torch.Tensor, **options) -> torch.Tensor:
    """routed_experts over every expert's record (expert e in row e) equals the float64 evaluation; returns it."""
    from ninfer_offload.kernels.moe import record_table, routed_experts

    layout, data, weights = records
    table = record_table(torch.arange(EXPERTS, device=DEVICE), layout.nbytes)
    out = routed_experts(x.to(DEVICE), ids.to(DEVICE), w.to(DEVICE), data, table, layout, **options)
    ref = _reference(x, ids, w, weights)
    assert float((out.double().cpu() - ref).norm() / ref.norm()) < 1e-5
    return out


@pytest.mark.parametrize("gate_up_fmt,down_fmt", [("q4_g64_fp16", "q5_g64_fp16"), ("q8_g32_fp16", "q6_g64_fp16")])
def test_routed_experts_match_reference(gate_up_fmt, down_fmt):
    records = _records(gate_up_fmt, down_fmt, seed=3)
    gen = torch.Generator().manual_seed(0)
    for t in (1, 2, 5, 8, 30, 90):  # matrix-vector kernels up to 64 pairs; 30 x 3: sorted blocks; 90 x 3: prefill tiles
        x = torch.randn(t, HIDDEN, generator=gen)
        ids = torch.stack([torch.randperm(EXPERTS, generator=gen)[:3] for _ in range(t)])
        ids[-1] = ids[0]  # experts repeated within the batch
        w = torch.softmax(torch.randn(t, 3, generator=gen), dim=-1)
        _assert_matches_reference(records, x, ids, w)


@pytest.mark.parametrize("shared_fmt", ["q8_g32_fp16", "q6_g64_fp16"])
@pytest.mark.parametrize("tokens", [1, 2, 30])
def test_the_shared_expert_with_the_routed_ones_equals_it_after_them(shared_fmt, tokens):
    """With the MoE block's shared expert given, routed_experts returns the block's output: one token's
    shared rows come from programs of the routed down launch (the last arriving program adds them to the
    rounded routed sum), more tokens' from `shared_expert` after the routed experts; both equal the
    routed output followed by `shared_expert` (the shared rows reduced by other programs: to rounding)."""
    from ninfer_offload.kernels.moe import record_table, routed_experts
    from ninfer_offload.kernels.shared_expert import shared_expert
    from ninfer_offload.artifact.formats import GROUPED_FORMATS
    from ninfer_offload.model.backend import SharedExpert
    from ninfer_offload.model.quant import QuantizedMatrix

    layout, data, _ = _records("q4_g64_fp16", "q5_g64_fp16", seed=5)
    table = record_table(torch.arange(EXPERTS, device=DEVICE), layout.nbytes)
    gen = torch.Generator().manual_seed(6)
    width = 128  # the shared expert's intermediate size
    values = np.random.default_rng(7).standard_normal((HIDDEN, width)).astype(np.float32) / width**0.5
    down = QuantizedMatrix(GROUPED_FORMATS[shared_fmt], HIDDEN, width, torch.from_numpy(encode_row_split(values, shared_fmt)).to(DEVICE))
    x = torch.randn(tokens, HIDDEN, generator=gen).to(DEVICE)
    ids = torch.stack([torch.randperm(EXPERTS, generator=gen)[:3] for _ in range(tokens)]).to(DEVICE)
    w = torch.softmax(torch.randn(tokens, 3, generator=gen), dim=-1).to(DEVICE)
    stacked = torch.randn(tokens, 2 * width + 7, generator=gen).to(DEVICE)  # gate and up: column slices of one product
    gate, up, score = stacked[:, :width], stacked[:, width : 2 * width], stacked[:, 2 * width + 3 : 2 * width + 4]
    got = routed_experts(x, ids, w, data, table, layout, shared=SharedExpert(gate, up, down, score))
    want = shared_expert(gate, up, down, routed_experts(x, ids, w, data, table, layout), score)
    assert got.shape == want.shape and float((got - want).double().norm() / want.double().norm()) < 1e-6


def test_tokens_sharing_every_expert():
    """Eight tokens routed to the same three experts (in different slots): each pair's programs read its expert.
    The down launch leaves its arrival counts zeroed, so a second call gives the same bits."""
    records = _records("q4_g64_fp16", "q5_g64_fp16", seed=5)
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(8, HIDDEN, generator=gen)
    ids = torch.stack([torch.tensor([2, 4, 5]).roll(t) for t in range(8)])
    w = torch.softmax(torch.randn(8, 3, generator=gen), dim=-1)
    first = _assert_matches_reference(records, x, ids, w)
    assert int(arrival_counts("moe.down_split", first.device).abs().sum()) == 0
    assert torch.equal(first, _assert_matches_reference(records, x, ids, w))


def _with_a_shared_expert(tokens: int, seed: int, experts: int = EXPERTS) -> tuple:
    """(layout, records, table, x, ids, weights, the MoE block's Q8 shared expert) on the device: `tokens` tokens, each
    routed to 3 of the first `experts` experts."""
    from ninfer_offload.artifact.formats import GROUPED_FORMATS
    from ninfer_offload.kernels.moe import record_table
    from ninfer_offload.model.backend import SharedExpert
    from ninfer_offload.model.quant import QuantizedMatrix

    layout, data, _ = _records("q4_g64_fp16", "q6_g64_fp16", seed=seed)
    table = record_table(torch.arange(EXPERTS, device=DEVICE), layout.nbytes)
    gen = torch.Generator().manual_seed(seed + 1)
    width = 128
    values = np.random.default_rng(seed + 2).standard_normal((HIDDEN, width)).astype(np.float32) / width**0.5
    encoded = torch.from_numpy(encode_row_split(values, "q8_g32_fp16")).to(DEVICE)
    down = QuantizedMatrix(GROUPED_FORMATS["q8_g32_fp16"], HIDDEN, width, encoded)
    x = torch.randn(tokens, HIDDEN, generator=gen).to(DEVICE)
    ids = torch.stack([torch.randperm(experts, generator=gen)[:3] for _ in range(tokens)])
    w = torch.softmax(torch.randn(tokens, 3, generator=gen), dim=-1).to(DEVICE)
    gate_up = torch.randn(tokens, 2 * width + 1, generator=gen).to(DEVICE)
    shared = SharedExpert(gate_up[:, :width], gate_up[:, width : 2 * width], down, gate_up[:, 2 * width :])
    return layout, data, table, x, ids, w, shared


@pytest.mark.parametrize("tokens", [1, 5])
def test_the_down_tile_read_before_the_wait_gives_the_same_bits(monkeypatch, tokens):
    """moe.DOWN_PREFETCH_MAX_TOKENS (the split down kernel's weight tile read before it waits for the gate/up launch) changes
    when the tile is read, not the sums: the same bits as without it, with the shared expert folded in and without."""
    from ninfer_offload.kernels import moe

    layout, data, table, x, ids, w, shared = _with_a_shared_expert(tokens, seed=9)
    outputs = {}
    for prefetch in (False, True):
        monkeypatch.setattr(moe, "DOWN_PREFETCH_MAX_TOKENS", tokens if prefetch else 0)
        outputs[prefetch] = [moe.routed_experts(x, ids.to(DEVICE), w, data, table, layout, shared=s) for s in (None, shared)]
    assert all(torch.equal(a, b) for a, b in zip(outputs[False], outputs[True]))


def test_one_read_per_expert_gives_the_same_bits(monkeypatch):
    """moe.SHARED_READ_MIN_TOKENS (over host records, the program of an expert's first pair computes every pair routed to
    it, the others' programs stop; the records here are in the arena, which the kernels read the same way) changes which
    program computes a pair, not its sums: the same bits and the same uses as a program per pair, with experts shared
    across 8 tokens, a token using one expert in two slots, the shared expert folded in and not; the down launch leaves
    its arrival counts zeroed. Shared uses count the pairs that read no record of their own: all but one of each
    expert's with one read; none without, nor in a resident launch (no host records) with the setting on."""
    from ninfer_offload.kernels import moe

    layout, data, table, x, ids, w, shared = _with_a_shared_expert(8, seed=12, experts=4)  # 4 of the 6 experts: many repeats
    ids[0] = torch.tensor([3, 1, 3])
    outputs, counts, shared_counts = {}, {}, {}
    for min_tokens, host_records in ((moe.GEMV_MAX_TOKENS + 1, True), (2, True), (2, False)):
        monkeypatch.setattr(moe, "SHARED_READ_MIN_TOKENS", min_tokens)
        uses, shared_uses = (torch.zeros(EXPERTS, dtype=torch.int32, device=DEVICE) for _ in range(2))
        case = (min_tokens, host_records)
        outputs[case] = [
            moe.routed_experts(x, ids.to(DEVICE), w, data, table, layout, host_records, s, uses=uses, shared_uses=shared_uses)
            for s in (None, shared)
        ]
        counts[case], shared_counts[case] = uses.cpu(), shared_uses.cpu()
        assert int(arrival_counts("moe.down_split", x.device).abs().sum()) == 0
    per_call = torch.bincount(ids.flatten(), minlength=EXPERTS).to(torch.int32)
    for case in outputs:
        assert all(torch.equal(a, b) for a, b in zip(outputs[case], outputs[(2, True)]))
        assert torch.equal(counts[case], 2 * per_call)  # two calls
    assert torch.equal(shared_counts[(2, True)], 2 * (per_call - (per_call > 0).to(torch.int32)))
    assert not shared_counts[(moe.GEMV_MAX_TOKENS + 1, True)].any() and not shared_counts[(2, False)].any()


def test_the_kernels_count_each_assignment():
    """With `uses`, each (token, expert) assignment is counted as `count_uses` counts it (a token's repeated
    expert twice): in the matrix-vector path's gate/up launch, by `count_uses` on the tiled path."""
    from ninfer_offload.kernels.moe import record_table, routed_experts
    from ninfer_offload.model.experts import count_uses

    layout, data, _ = _records("q4_g64_fp16", "q5_g64_fp16", seed=7)
    table = record_table(torch.arange(EXPERTS, device=DEVICE), layout.nbytes)
    gen = torch.Generator().manual_seed(8)
    for t in (1, 8, 30):
        ids = torch.stack([torch.randperm(EXPERTS, generator=gen)[:3] for _ in range(t)])
        ids[0, 2] = ids[0, 0]
        x, w = torch.randn(t, HIDDEN, generator=gen), torch.softmax(torch.randn(t, 3, generator=gen), dim=-1)
        uses = torch.full((EXPERTS,), 5, dtype=torch.int32, device=DEVICE)
        want = uses.clone()
        count_uses(want, ids.to(DEVICE))
        counted = routed_experts(x.to(DEVICE), ids.to(DEVICE), w.to(DEVICE), data, table, layout, uses=uses)
        assert torch.equal(uses, want)
        assert torch.equal(counted, routed_experts(x.to(DEVICE), ids.to(DEVICE), w.to(DEVICE), data, table, layout))


@pytest.mark.parametrize("tokens", [1, 3, 30])
def test_a_token_repeating_an_expert(tokens):
    """A token may use one expert in two slots (the host-miss path gives host-computed slots a
    zero weight on an expert the device runs anyway): each slot counts with its own weight."""
    records = _records("q4_g64_fp16", "q6_g64_fp16", seed=7)
    gen = torch.Generator().manual_seed(2)
    x = torch.randn(tokens, HIDDEN, generator=gen)
    ids = torch.tensor([[3, 1, 3]] * tokens)
    w = torch.softmax(torch.randn(tokens, 3, generator=gen), dim=-1)
    w[0, 0] = 0.0  # the zero-weight slot comes first
    _assert_matches_reference(records, x, ids, w)


def _outside_the_arena(data: torch.Tensor, nbytes: int, outside: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The records `data` [EXPERTS * nbytes] rearranged so that the experts of `outside` ([E] bool) come last
    and an arena view that ends before them (records past an arena's end are host records to the kernels,
    here still in device memory, so a test can rewrite them in stream order): (the whole buffer [E, nbytes],
    the arena view, the table)."""
    from ninfer_offload.kernels.moe import record_table

    order = torch.cat([torch.nonzero(~outside).flatten(), torch.nonzero(outside).flatten()])
    rows = data.view(EXPERTS, nbytes)[order.to(data.device)].contiguous()
    position = torch.empty(EXPERTS, dtype=torch.int64)
    position[order] = torch.arange(EXPERTS)
    arena = rows.view(-1)[: int((~outside).sum()) * nbytes]
    return rows, arena, record_table(position.to(DEVICE), nbytes)


def test_prefill_over_host_records_matches_reference():
    """A prefill chunk whose experts are partly in host memory (past the arena): those take the PCIe tiles
    (wider k tiles) in a pass of their own, the others the VRAM tiles, and the output is the products'."""
    from ninfer_offload.kernels.moe import routed_experts

    layout, data, weights = _records("q4_g64_fp16", "q5_g64_fp16", seed=9)
    gen = torch.Generator().manual_seed(3)
    x = torch.randn(90, HIDDEN, generator=gen)
    ids = torch.stack([torch.randperm(EXPERTS, generator=gen)[:3] for _ in range(90)])
    w = torch.softmax(torch.randn(90, 3, generator=gen), dim=-1)
    outside = torch.tensor([False, True, False, False, True, False])
    _, arena, table = _outside_the_arena(data, layout.nbytes, outside)
    out = routed_experts(x.to(DEVICE), ids.to(DEVICE), w.to(DEVICE), arena, table, layout, host_records=True)
    ref = _reference(x, ids, w, weights)
    assert float((out.double().cpu() - ref).norm() / ref.norm()) < 1e-5


@pytest.mark.parametrize("host_records", [False, True])
def test_the_passes_equal_one(host_records):
    """A prefill chunk in passes, a random half of the experts deferred: their records hold 0xFF bytes (NaN
    scales) until `wait()` writes them and turns every other record to 0xFF, so an expert computed only in
    the wrong pass shows. Without host records (the same tiles in both passes) the output is the one-pass
    op's exactly; with two of the others in host memory (past the arena: a pass of their own before the
    wait, on the PCIe tiles) it matches the products to rounding."""
    from ninfer_offload.kernels.moe import record_table, routed_experts, routed_experts_split

    layout, data, weights = _records("q4_g64_fp16", "q5_g64_fp16", seed=11)
    gen = torch.Generator().manual_seed(4)
    x = torch.randn(90, HIDDEN, generator=gen)  # 270 pairs: the prefill tiles
    ids = torch.stack([torch.randperm(EXPERTS, generator=gen)[:3] for _ in range(90)])
    w = torch.softmax(torch.randn(90, 3, generator=gen), dim=-1)
    later = torch.zeros(EXPERTS, dtype=torch.bool)
    later[torch.randperm(EXPERTS, generator=gen)[: EXPERTS // 2]] = True
    outside = torch.zeros(EXPERTS, dtype=torch.bool)
    if host_records:
        outside[torch.nonzero(~later).flatten()[:2]] = True
    rows, arena, table = _outside_the_arena(data, layout.nbytes, outside)
    deferred = later[torch.argsort(table.cpu())].to(DEVICE)[:, None]  # per buffer row: whether its expert is deferred
    real = rows.clone()
    rows.copy_(torch.where(deferred, 0xFF, real))
    waits = []

    def wait():
        rows.copy_(torch.where(deferred, real, 0xFF))
        waits.append(True)

    args = (x.to(DEVICE), ids.to(DEVICE), w.to(DEVICE))
    got = routed_experts_split(*args, arena, table, layout, later.to(DEVICE), wait, host_records=host_records)
    assert waits == [True]
    if host_records:
        ref = _reference(x, ids, w, weights)
        assert float((got.double().cpu() - ref).norm() / ref.norm()) < 1e-5
    else:
        assert torch.equal(got, routed_experts(*args, data, record_table(torch.arange(EXPERTS, device=DEVICE), layout.nbytes), layout))


def test_plan_groups_pairs_by_expert():
    from ninfer_offload.kernels.moe import plan_work

    ids = torch.tensor([[2, 0], [2, 5], [2, 0]])
    plan = plan_work(ids.to(DEVICE), num_experts=6, block_m=2)
    seen = {}
    for e, pairs in zip(plan.block_expert.tolist(), plan.block_pairs.tolist()):
        valid = [p for p in pairs if p >= 0]
        assert (e < 0) == (not valid)
        for p in valid:
            seen[p] = e
    assert seen == {p: int(e) for p, e in enumerate(ids.reshape(-1))}


def test_plan_is_a_stable_counting_sort():
    """Expert e's pairs in pair order fill consecutive blocks after those of experts < e (the last one
    padded with -1), then unused blocks; more pairs than the planning kernels read at once."""
    from ninfer_offload.kernels.moe import PLAN_BLOCK, plan_work

    gen = torch.Generator().manual_seed(4)
    ids = torch.randint(0, 5, (PLAN_BLOCK // 3 + 50, 3), generator=gen)
    ids[::7] = 2  # one expert takes far more pairs than the others; expert 5 of 6 takes none
    plan = plan_work(ids.to(DEVICE), num_experts=6, block_m=16)
    expert_of, pairs_of = [], []
    for e in range(6):
        pairs = [p for p, x in enumerate(ids.reshape(-1).tolist()) if x == e]
        for b0 in range(0, len(pairs), 16):
            expert_of.append(e)
            pairs_of.append(pairs[b0 : b0 + 16] + [-1] * (16 - len(pairs[b0 : b0 + 16])))
    unused = plan.block_expert.numel() - len(expert_of)
    assert plan.block_expert.tolist() == expert_of + [-1] * unused
    assert plan.block_pairs.tolist() == pairs_of + [[-1] * 16] * unused
