"""CPU expert kernels (numba) against the reference op, the host experts of the miss path, its share tuner."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from nvfp4_support import random_nvfp4

from ninfer_offload.artifact.codecs import encode_row_split
from ninfer_offload.artifact.records import ExpertRecordLayout
from ninfer_offload.errors import NinferError
from ninfer_offload.kernels.cpu import experts as ck
from ninfer_offload.runtime import cpu_experts as ce

FORMATS = ["q4_g64_fp16", "q5_g64_fp16", "q6_g64_fp16", "q8_g32_fp16"]
HIDDEN, INTER, EXPERTS = 200, 70, 6  # neither K is a multiple of 64 or 128


def make_records(gate_up_fmt: str, down_fmt: str, hidden=HIDDEN, inter=INTER, experts=EXPERTS, seed=0):
    """A buffer of `experts` records encoded from random weights, with a gap before each record."""
    rng = np.random.default_rng(seed)
    layout = ExpertRecordLayout.create(gate_up_fmt, down_fmt, hidden, inter)
    stride = layout.nbytes + 256  # records need not be back to back
    records = np.full(experts * stride, 0xA5, dtype=np.uint8)
    offsets = np.arange(experts, dtype=np.int64)[::-1] * stride  # and need not be in expert order
    for e in range(experts):
        record = records[offsets[e] : offsets[e] + layout.nbytes]
        record[:] = 0
        w_gu = rng.standard_normal((2 * inter, hidden)).astype(np.float32) / np.sqrt(hidden)
        w_dn = rng.standard_normal((hidden, inter)).astype(np.float32) / np.sqrt(inter)
        record[: layout.gate_up.encoded_size] = encode_row_split(w_gu, gate_up_fmt)
        record[layout.down_offset : layout.down_offset + layout.down.encoded_size] = encode_row_split(w_dn, down_fmt)
    return layout, records, offsets


def routing(tokens: int, k: int, seed: int, experts=EXPERTS):
    rng = np.random.default_rng(seed)
    ids = np.stack([rng.choice(experts, k, replace=False) for _ in range(tokens)])
    weights = rng.random((tokens, k)).astype(np.float32)
    x = rng.standard_normal((tokens, HIDDEN)).astype(np.float32)
    return x, ids, weights


def assert_close(got, want):
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-5 * max(1.0, float(np.abs(want).max())))


@pytest.mark.parametrize("gate_up_fmt", FORMATS)
@pytest.mark.parametrize("down_fmt", FORMATS)
def test_kernel_matches_reference_all_formats(gate_up_fmt, down_fmt):
    layout, records, offsets = make_records(gate_up_fmt, down_fmt)
    x, ids, weights = routing(tokens=3, k=2, seed=1)
    plan = ck.RecordKernelPlan.create(layout)
    got = ck.routed_experts_cpu(plan, records, offsets, x, ids, weights)
    assert_close(got, ck.reference_routed(layout, records, offsets, x, ids, weights))


@pytest.mark.parametrize("tokens", range(1, 9))
def test_kernel_matches_reference_for_1_to_8_tokens(tokens):
    layout, records, offsets = make_records("q4_g64_fp16", "q5_g64_fp16")
    x, ids, weights = routing(tokens, k=3, seed=tokens)
    got = ck.routed_experts_cpu(ck.RecordKernelPlan.create(layout), records, offsets, x, ids, weights)
    assert_close(got, ck.reference_routed(layout, records, offsets, x, ids, weights))


@pytest.mark.parametrize("down_fmt", ["q4_g64_fp16", "q5_g64_fp16"])
def test_odd_hidden_size_pairs_the_last_down_row_with_itself(down_fmt):
    """Q4 rows go two per pass; an odd number of down rows leaves the last one alone."""
    hidden = 201
    layout, records, offsets = make_records("q4_g64_fp16", down_fmt, hidden=hidden)
    _, ids, weights = routing(tokens=2, k=2, seed=4)
    x = np.random.default_rng(4).standard_normal((2, hidden)).astype(np.float32)
    got = ck.routed_experts_cpu(ck.RecordKernelPlan.create(layout), records, offsets, x, ids, weights)
    assert_close(got, ck.reference_routed(layout, records, offsets, x, ids, weights))


@pytest.mark.parametrize("gate_up_fmt, down_fmt", [("q4_g64_fp16", "q5_g64_fp16"), ("q5_g64_fp16", "q4_g64_fp16")])
def test_sixteen_bit_split_is_closer_than_bfloat16_inputs(gate_up_fmt, down_fmt):
    """With two activation parts (16-bit engines) the result stays well inside the error that
    rounding the same inputs to bfloat16 already causes."""
    layout, records, offsets = make_records(gate_up_fmt, down_fmt)
    x, ids, weights = routing(tokens=4, k=3, seed=13)
    x[:, ::7] *= 1e-3  # small lanes next to large ones in every group
    plan = ck.RecordKernelPlan.create(layout)
    want = ck.reference_routed(layout, records, offsets, x, ids, weights)
    got = ck.routed_experts_cpu(plan, records, offsets, x, ids, weights, activation_parts=ck.SIXTEEN_BIT_PARTS)
    x_bf16 = torch.from_numpy(x).to(torch.bfloat16).float().numpy()
    bf16_error = np.abs(ck.reference_routed(layout, records, offsets, x_bf16, ids, weights) - want).max()
    assert 0 < np.abs(got - want).max() < bf16_error / 8


def test_activation_parts_must_be_two_or_three():
    layout, records, offsets = make_records("q4_g64_fp16", "q5_g64_fp16")
    x, ids, weights = routing(tokens=1, k=2, seed=5)
    with pytest.raises(NinferError, match="activation_parts"):
        ck.routed_experts_cpu(ck.RecordKernelPlan.create(layout), records, offsets, x, ids, weights, activation_parts=1)


def test_padding_groups_of_the_intermediate_never_poison_the_result():
    """An intermediate size of 40 pads the down input to 128 lanes: the second 64-lane group has
    no rows at all. Memory freed full of NaN just before each call must not leak into the sums."""
    layout, records, offsets = make_records("q4_g64_fp16", "q5_g64_fp16", inter=40)
    plan = ck.RecordKernelPlan.create(layout)
    x, ids, weights = routing(tokens=3, k=2, seed=2)
    want = ck.reference_routed(layout, records, offsets, x, ids, weights)
    for _ in range(10):
        junk = [np.full(n, np.nan, np.float32) for n in (64, 128, 256, 512, 1024)]
        del junk
        assert_close(ck.routed_experts_cpu(plan, records, offsets, x, ids, weights), want)


def test_repeated_experts_and_shared_tokens():
    """Every token uses the same expert, and one token lists an expert twice: all contributions add."""
    layout, records, offsets = make_records("q6_g64_fp16", "q8_g32_fp16")
    x, _, weights = routing(tokens=5, k=3, seed=7)
    ids = np.array([[2, 4, 2], [2, 0, 1], [4, 2, 5], [2, 3, 4], [1, 2, 0]])
    got = ck.routed_experts_cpu(ck.RecordKernelPlan.create(layout), records, offsets, x, ids, weights)
    assert_close(got, ck.reference_routed(layout, records, offsets, x, ids, weights))


def test_reference_expert_is_the_dequantized_matrix_math():
    """The oracle itself: one token through one expert equals hand-written dequantized math."""
    layout, records, offsets = make_records("q5_g64_fp16", "q4_g64_fp16")
    x, _, _ = routing(tokens=1, k=1, seed=3)
    from ninfer_offload.artifact.codecs import decode_row_split_values

    rec = records[offsets[1] : offsets[1] + layout.nbytes]
    w_gu = decode_row_split_values(rec[: layout.gate_up.encoded_size], "q5_g64_fp16", 2 * INTER, HIDDEN)
    w_dn = decode_row_split_values(rec[layout.down_offset : layout.down_offset + layout.down.encoded_size], "q4_g64_fp16", HIDDEN, INTER)
    h = w_gu.astype(np.float64) @ x[0].astype(np.float64)
    act = h[:INTER] / (1 + np.exp(-h[:INTER])) * h[INTER:]
    np.testing.assert_allclose(ck.reference_expert(layout, rec, x)[0], w_dn @ act, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("down_fmt", ["nvfp4", "q6_g64_fp16"])
def test_nvfp4_records_match_reference(down_fmt):
    """Records cut from nvfp4 banks (one divisor per two experts, so the tiles' divisors differ), at
    reversed offsets with gaps; two row tiles per gate/up object."""
    hidden, inter, experts = 128, 128, 4
    rng = np.random.default_rng(21)
    gate_up = random_nvfp4(rng, experts * 2 * inter, hidden, divisors=2)
    if down_fmt == "nvfp4":
        down = random_nvfp4(rng, experts * hidden, inter, divisors=2)
    else:
        down = encode_row_split(rng.standard_normal((experts * hidden, inter)).astype(np.float32) / np.sqrt(inter), down_fmt)
    layout = ExpertRecordLayout.create("nvfp4", down_fmt, hidden, inter)
    packed = np.empty((experts, layout.nbytes), dtype=np.uint8)
    layout.pack_all(gate_up, down, experts, packed)
    stride = layout.nbytes + 256
    records = np.full(experts * stride, 0xA5, dtype=np.uint8)
    offsets = np.arange(experts, dtype=np.int64)[::-1] * stride
    for e in range(experts):
        records[offsets[e] : offsets[e] + layout.nbytes] = packed[e]
    rng = np.random.default_rng(3)
    ids = np.stack([rng.choice(experts, 2, replace=False) for _ in range(5)])
    x, weights = rng.standard_normal((5, hidden)).astype(np.float32), rng.random((5, 2)).astype(np.float32)
    got = ck.routed_experts_cpu(ck.RecordKernelPlan.create(layout), records, offsets, x, ids, weights)
    assert_close(got, ck.reference_routed(layout, records, offsets, x, ids, weights))


def test_selected_assignments_only():
    layout, records, offsets = make_records("q4_g64_fp16", "q5_g64_fp16")
    x, ids, weights = routing(tokens=4, k=3, seed=11)
    selected = np.random.default_rng(0).random(ids.shape) < 0.5
    got = ck.routed_experts_cpu(ck.RecordKernelPlan.create(layout), records, offsets, x, ids, weights, selected)
    masked = np.where(selected, weights, 0).astype(np.float32)
    assert_close(got, ck.reference_routed(layout, records, offsets, x, ids, masked))
    none = ck.routed_experts_cpu(ck.RecordKernelPlan.create(layout), records, offsets, x, ids, weights, np.zeros_like(selected))
    assert not none.any()


def test_bad_inputs_give_one_line_errors():
    layout, records, offsets = make_records("q4_g64_fp16", "q5_g64_fp16")
    plan = ck.RecordKernelPlan.create(layout)
    x, ids, weights = routing(tokens=2, k=2, seed=5)
    with pytest.raises(NinferError, match="width"):
        ck.routed_experts_cpu(plan, records, offsets, x[:, :100], ids, weights)
    missing = offsets.copy()
    missing[ids[0, 0]] = -1
    with pytest.raises(NinferError, match="no host record"):
        ck.routed_experts_cpu(plan, records, missing, x, ids, weights)


def test_host_experts_compute_selected_assignments_into_out():
    layout, records, offsets = make_records("q4_g64_fp16", "q6_g64_fp16")
    padded = torch.zeros(EXPERTS, layout.nbytes + 256, dtype=torch.uint8)  # rows wider than a record
    for e in range(EXPERTS):
        padded[e, : layout.nbytes] = torch.from_numpy(records[offsets[e] : offsets[e] + layout.nbytes])
    table = padded[:, : layout.nbytes]
    x, ids, weights = routing(tokens=2, k=2, seed=9)
    selected = np.array([[True, False], [True, True]])
    experts = ce.HostExperts(ck.EXACT_PARTS)
    out = np.full((2, HIDDEN), 7.0, dtype=np.float32)  # stale rows: the answer overwrites them
    experts.compute(layout, table, x, ids, weights, selected, out)
    masked = np.where(selected, weights, 0).astype(np.float32)
    assert_close(out, ck.reference_routed(layout, records, offsets, x, ids, masked))
    assert experts.calls == 1 and experts.stats()["gbs"] > 0 and experts.bytes == len(np.unique(ids[selected])) * layout.nbytes


def test_host_experts_split_activations_by_parts():
    """The exact split for float32 activations, the 16-bit split for bf16 engines."""
    layout, records, offsets = make_records("q4_g64_fp16", "q5_g64_fp16")
    table = torch.stack([torch.from_numpy(records[o : o + layout.nbytes]) for o in offsets])
    x, ids, weights = routing(tokens=3, k=2, seed=8)
    for parts in (ck.EXACT_PARTS, ck.SIXTEEN_BIT_PARTS):
        out = np.empty((3, HIDDEN), dtype=np.float32)
        ce.HostExperts(parts).compute(layout, table, x, ids, weights, np.ones(ids.shape, dtype=bool), out)
        want = ck.routed_experts_cpu(
            ck.RecordKernelPlan.create(layout), table.numpy(), np.arange(EXPERTS) * layout.nbytes, x, ids, weights, activation_parts=parts
        )
        np.testing.assert_array_equal(out, want)


def test_host_experts_reject_malformed_records():
    layout, records, _ = make_records("q4_g64_fp16", "q5_g64_fp16")
    x, ids, weights = routing(tokens=1, k=2, seed=2)
    out = np.empty((1, HIDDEN), dtype=np.float32)
    with pytest.raises(NinferError, match="host records"):
        ce.HostExperts(ck.EXACT_PARTS).compute(layout, torch.from_numpy(records), x, ids, weights, np.ones(ids.shape, dtype=bool), out)


def test_kernels_release_the_gil_and_run_in_parallel():
    """The worker thread can only overlap the GPU thread if the compiled code drops the GIL."""
    assert ck._routed_kernel.targetoptions["nogil"] and ck._routed_kernel.targetoptions["parallel"]


def test_split_tuner_tries_each_share_and_keeps_the_fastest():
    tuner = ce.SplitTuner((0.0, 0.25, 1.0), window=2, rounds=2, warmup=1, hold=5)
    cost = {0.0: 3.0, 0.25: 1.0, 1.0: 2.0}
    seen, timed = [], []
    for _ in range(tuner.trial_steps):
        share = tuner.share()
        seen.append(share)
        timed.append(tuner.timed())
        tuner.observe(share, 1, cost[share] if timed[-1] else None)  # the engine times only the steps that count
    assert seen == [1.0] + [0.0, 0.0, 0.25, 0.25, 1.0, 1.0] * 2  # warm-up, then each share in turn (the first of each not counted)
    assert timed == [False] + [False, True] * 6
    assert tuner.chosen == {1: 0.25} and tuner.stats()["share"] == {"1": 0.25}
    assert tuner.stats()["ms_per_token"] == {"1": [3000.0, 1000.0, 2000.0]}  # the trials' evidence
    held = []
    for _ in range(5):
        held.append(tuner.share())
        assert not tuner.timed()
        tuner.observe(held[-1], 1, None if len(held) % 2 else 9.0)  # held steps do not count as trials, timed or not
    assert held == [0.25] * 5
    cost[1.0] = 0.5  # the next trials see the host get faster
    for _ in range(tuner.trial_steps):
        share = tuner.share()
        tuner.observe(share, 1, cost[share])
    assert tuner.chosen == {1: 1.0}


def test_split_tuner_keeps_a_share_per_step_size():
    """Steps of one row and of eight interleave during the trials: each size keeps its own fastest share, and a size
    the trials did not see takes the nearest measured size's."""
    tuner = ce.SplitTuner((0.0, 0.5, 1.0), window=4, rounds=1, warmup=0, hold=10)
    cost = {1: {0.0: 3.0, 0.5: 2.0, 1.0: 1.0}, 8: {0.0: 1.0, 0.5: 2.0, 1.0: 3.0}}  # the host wins alone, the link in a batch
    for step in range(tuner.trial_steps):
        rows = 1 if step % 2 else 8
        share = tuner.share(rows)
        tuner.observe(share, rows, cost[rows][share] if tuner.timed() else None)
    assert tuner.chosen == {1: 1.0, 8: 0.0}
    assert [tuner.share(rows) for rows in (1, 2, 6, 8, 16)] == [1.0, 1.0, 0.0, 0.0, 0.0]


def test_auto_candidates_include_both_pure_paths():
    from ninfer_offload.planner.cost import CPU_EXPERT_SHARE_OF_DRAM

    assert ce._candidates(0.3) == (0.0, 0.3125, 1.0)
    assert ce._candidates(0.99) == (0.0, 1.0)
    assert 0 < ce.MissRates.of_machine().host_share < 1 and CPU_EXPERT_SHARE_OF_DRAM > 0


_STARTUP_PROBE = """
import numpy as np
import torch
import numba.np.ufunc.parallel as parallel
from ninfer_offload.artifact.records import ExpertRecordLayout
from ninfer_offload.kernels.cpu import experts as ck
from ninfer_offload.runtime import cpu_experts as ce
assert not parallel._is_initialized
experts = ce.HostExperts(ck.EXACT_PARTS)
assert parallel._is_initialized, "thread pool not started by the host experts"
compiled = len(ck._routed_kernel.signatures)
for fmt, down in [(f, "q5_g64_fp16") for f in ("q4_g64_fp16", "q5_g64_fp16", "q6_g64_fp16", "q8_g32_fp16")] + [("nvfp4", "nvfp4")]:
    layout = ExpertRecordLayout.create(fmt, down, 128, 64)
    records = torch.zeros(2, layout.nbytes, dtype=torch.uint8)
    for t in range(1, 9):
        ids = np.array([[0, 1]] * t)
        x, w, out = np.ones((t, 128), np.float32), np.ones((t, 2), np.float32), np.empty((t, 128), np.float32)
        experts.compute(layout, records, x, ids, w, ids >= 0, out)
ce.HostExperts(ck.SIXTEEN_BIT_PARTS)
assert len(ck._routed_kernel.signatures) == compiled == 1, ck._routed_kernel.signatures
print("ok", compiled)
"""


def test_compilation_and_thread_pool_start_up_are_paid_once():
    """In a fresh process: the executor starts the pool; later calls (any format, T) compile nothing."""
    result = subprocess.run([sys.executable, "-c", _STARTUP_PROBE], capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-2000:]
    assert result.stdout.split() == ["ok", "1"]


_PORTABLE_PROBE = """
import numpy as np
from test_cpu_experts import make_records, routing, assert_close
from ninfer_offload.kernels.cpu import experts as ck, simd
assert not simd.target_has_vnni()
for gate_up_fmt, down_fmt in (("q4_g64_fp16", "q5_g64_fp16"), ("q5_g64_fp16", "q4_g64_fp16")):
    layout, records, offsets = make_records(gate_up_fmt, down_fmt)
    x, ids, weights = routing(tokens=3, k=2, seed=5)
    got = ck.routed_experts_cpu(ck.RecordKernelPlan.create(layout), records, offsets, x, ids, weights)
    assert_close(got, ck.reference_routed(layout, records, offsets, x, ids, weights))
print("ok")
"""


def test_integer_path_without_vnni(tmp_path):
    """On a CPU without AVX-512 VNNI (compiled here for an AVX2 Haswell) the integer dots use
    generic vector code and give the same result."""
    env = {
        **os.environ,
        "NUMBA_CPU_NAME": "haswell",
        "NUMBA_CPU_FEATURES": (
            "+64bit,+avx,+avx2,+bmi,+bmi2,+cmov,+cx16,+f16c,+fma,+lzcnt,+movbe,+popcnt,+sse,+sse2,+sse3,+sse4.1,+sse4.2,+ssse3"
        ),
        "NUMBA_CACHE_DIR": str(tmp_path),
        "PYTHONPATH": os.pathsep.join([str(Path(__file__).parent), os.environ.get("PYTHONPATH", "")]),
    }
    result = subprocess.run([sys.executable, "-c", _PORTABLE_PROBE], capture_output=True, text=True, timeout=600, env=env)
    assert result.returncode == 0, result.stderr[-2000:]
    assert result.stdout.split() == ["ok"]


def test_host_poll_finds_open_requests_and_answers_them():
    """The worker's poll (`kernels.cpu.handoff`): a layer whose READY counter passed its DONE counter is
    the next request, even when raised by another thread while polling; answering closes it."""
    import threading

    from ninfer_offload.kernels.cpu.handoff import answer_request, next_request
    from ninfer_offload.runtime.miss_handoff import DONE, HEADER_WORDS, READY

    flags = np.zeros(4 * HEADER_WORDS, dtype=np.int64)
    assert next_request(flags, 4, HEADER_WORDS, READY, DONE, 10) == -1
    flags[2 * HEADER_WORDS + READY] = 1
    assert next_request(flags, 4, HEADER_WORDS, READY, DONE, 10) == 2
    answer_request(flags, 2 * HEADER_WORDS + DONE, 1)
    assert next_request(flags, 4, HEADER_WORDS, READY, DONE, 10) == -1
    raise_later = threading.Timer(0.05, lambda: flags.__setitem__(3 * HEADER_WORDS + READY, 7))
    raise_later.start()
    found = -1
    while found < 0:  # polls release the GIL, so the timer thread gets to raise it
        found = next_request(flags, 4, HEADER_WORDS, READY, DONE, 100_000)
    raise_later.join()
    assert found == 3
