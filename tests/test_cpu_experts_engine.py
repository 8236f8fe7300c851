"""The CPU miss path end to end: host-resident experts computed by the numba kernels give the
logits of the all-resident engine (tiny converted models)."""

from __future__ import annotations

import pytest
import torch

from ninfer_offload.errors import NinferError
from ninfer_offload.runtime.engine import Engine

PROMPT = [5, 17, 42, 99, 3, 250, 7, 61, 300, 12, 8, 444]


def assert_logits_close(got: torch.Tensor, want: torch.Tensor) -> None:
    assert torch.allclose(got, want, rtol=1e-4, atol=1e-4 * max(1.0, want.abs().max().item()))


@pytest.fixture(scope="module")
def resident(tiny_artifact_official):
    return Engine.load(tiny_artifact_official)


def test_cpu_path_runs_every_routed_expert_on_the_host(tiny_artifact_official, resident):
    engine = Engine.load(tiny_artifact_official, experts="host", miss_path="cpu")
    assert_logits_close(engine.logits(PROMPT), resident.logits(PROMPT))
    config, stats = engine.config, engine.store.stats
    # host mode's default cache holds a few experts; everything else runs on the host, nothing crosses PCIe
    assert 0 < stats.cpu_assignments == stats.uses - stats.hits
    assert stats.pcie_bytes == 0
    assert stats.miss_path["mode"] == "cpu" and stats.miss_path["cpu"]["calls"] == config.num_layers


def test_cpu_path_decode_steps_match_resident(tiny_artifact_official, resident):
    engine = Engine.load(tiny_artifact_official, experts="host", miss_path="cpu")
    mine, theirs = engine.session(), resident.session()
    assert_logits_close(mine.prefill(PROMPT[:7]), theirs.prefill(PROMPT[:7]))
    for token in PROMPT[7:]:
        assert_logits_close(mine.step(token), theirs.step(token))


def test_auto_path_tries_shares_and_matches_resident(tiny_artifact_official, resident):
    """"auto" runs its trial shares (none, the rates', all) on decode steps, keeps the fastest, and the
    logits stay the resident ones whatever share runs."""
    engine = Engine.load(tiny_artifact_official, experts="host", num_slots=4, miss_path="auto")
    tuner = engine.store.cpu_path.tuner
    tuner.window, tuner.rounds, tuner.warmup = 2, 1, 0
    session, reference = engine.session(), resident.session()
    assert_logits_close(session.prefill(PROMPT), reference.prefill(PROMPT))
    for token in (3, 9, 27, 81, 5, 2, 4):
        assert_logits_close(session.step(token), reference.step(token))
    stats = engine.store.stats
    auto = stats.miss_path["auto"]
    assert auto["candidates"][0] == 0.0 and auto["candidates"][-1] == 1.0
    assert auto["share"]["1"] in auto["candidates"]  # one-row steps' share, chosen after two steps per candidate
    assert stats.pcie_bytes > 0 and stats.cpu_assignments > 0  # the trials sent misses both ways


@pytest.mark.parametrize("slots", [4, 6])
@pytest.mark.parametrize("share", [0.0, 0.3, 1.0])
def test_any_host_share_matches_resident(tiny_artifact_official, resident, slots, share):
    """Whatever share of the misses the host takes, the logits stay the resident ones."""
    engine = Engine.load(tiny_artifact_official, experts="host", num_slots=slots, miss_path="cpu")
    engine.store.cpu_path.set_share(share)
    session, reference = engine.session(), resident.session()
    assert_logits_close(session.prefill(PROMPT * 2), reference.prefill(PROMPT * 2))
    for token in (3, 9, 27, 81):
        assert_logits_close(session.step(token), reference.step(token))
    stats = engine.store.stats
    assert (stats.cpu_assignments > 0) == (share > 0)


def test_anchors_follow_the_cache_only_while_the_host_takes_a_share(tiny_artifact_official, resident):
    """With no host share the cache's moves leave the per-layer anchors (an expert in VRAM the hand-off
    points the host's pairs at) as they were, no host work per step; the first step that gives the host a
    share again re-points every layer's anchor at an expert in VRAM, and the logits stay the resident ones."""
    engine = Engine.load(tiny_artifact_official, experts="host", num_slots=4, miss_path="cpu")
    store = engine.store
    store.cpu_path.set_share(0.0)
    session, reference = engine.session(), resident.session()
    assert_logits_close(session.prefill(PROMPT), reference.prefill(PROMPT))
    layers = range(engine.config.num_layers)

    def anchors_in_vram() -> bool:  # (a layer without experts in VRAM keeps expert 0)
        in_vram = store.cache.in_vram
        return all(in_vram[layer, int(store.anchor[layer, 0])] for layer in layers if in_vram[layer].any())

    tokens = iter([3, 9, 27, 81, 5, 2, 4, 8, 16, 32, 64, 128, 11, 13, 17, 19])
    for token in tokens:
        assert_logits_close(session.step(token), reference.step(token))
        if not anchors_in_vram():
            break
    assert not anchors_in_vram() and store.stats.promotions > 0  # the cache moved an anchor away
    store.cpu_path.set_share(1.0)
    for token in tokens:
        assert_logits_close(session.step(token), reference.step(token))
        assert anchors_in_vram()
    assert store.stats.cpu_assignments > 0


def test_q8_records_through_the_cpu_path(tiny_artifact_q8):
    want = Engine.load(tiny_artifact_q8).logits(PROMPT)
    assert_logits_close(Engine.load(tiny_artifact_q8, experts="host", miss_path="cpu").logits(PROMPT), want)


def test_unknown_miss_path_is_a_one_line_error(tiny_artifact_official):
    with pytest.raises(NinferError, match="--miss-path must be one of pcie, cpu, auto, got 'gpu'") as err:
        Engine.load(tiny_artifact_official, experts="host", miss_path="gpu")
    assert "\n" not in str(err.value)


def test_lossless_records_use_the_host_reference_op(tiny_artifact):
    """bf16 expert records (the lossless test recipe) have no numba kernel: the torch op runs on the host."""
    want = Engine.load(tiny_artifact).logits(PROMPT)
    engine = Engine.load(tiny_artifact, experts="host", miss_path="cpu")
    assert_logits_close(engine.logits(PROMPT), want)
    assert engine.store.stats.miss_path["cpu"]["calls"] == engine.config.num_layers


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("miss_path", ["cpu", "auto"])
def test_mixed_cpu_and_gpu_split_matches_all_gpu(tiny_artifact_official, miss_path):
    """On CUDA (float32): missing experts computed on the host while the GPU runs the others."""
    ids = PROMPT * 3
    want = Engine.load(tiny_artifact_official, device="cuda", dtype="float32").logits(ids)
    engine = Engine.load(tiny_artifact_official, device="cuda", dtype="float32", experts="host", num_slots=4, miss_path=miss_path)
    session, reference = engine.session(), Engine.load(tiny_artifact_official, device="cuda", dtype="float32").session()
    got = session.prefill(ids)
    assert torch.allclose(got, want[-1], rtol=1e-3, atol=1e-3 * max(1.0, want.abs().max().item()))
    reference.prefill(ids)
    for token in (3, 9, 27, 81):
        step, expected = session.step(token), reference.step(token)
        assert torch.allclose(step, expected, rtol=1e-3, atol=1e-3 * max(1.0, expected.abs().max().item()))
    assert engine.store.stats.cpu_assignments > 0


def _generate(artifact, *flags: str):
    import subprocess
    import sys

    command = [
        sys.executable, "-m", "ninfer_offload", "generate", str(artifact), "--prompt-ids", "5,17,42,99", "--greedy", "--max-tokens", "4",
        "--json", *flags,
    ]
    return subprocess.run(command, capture_output=True, text=True, timeout=300)


def test_generate_cli_miss_path_flag(tiny_artifact_official):
    import json

    resident = _generate(tiny_artifact_official)
    on_host = _generate(tiny_artifact_official, "--experts", "host", "--miss-path", "cpu")
    assert resident.returncode == 0 and on_host.returncode == 0, on_host.stderr[-1000:]
    assert json.loads(on_host.stdout)["ids"] == json.loads(resident.stdout)["ids"]
    bad = _generate(tiny_artifact_official, "--experts", "host", "--miss-path", "gpu")
    assert bad.returncode == 2 and bad.stderr.startswith("error: ") and bad.stderr.count("\n") == 1


def test_the_worker_thread_answers_requests_as_on_cuda(tiny_artifact_official):
    """The host worker of the CUDA path, here on the CPU: requests published to the mailbox are answered
    by the worker thread, also after it went idle (no wake-up call), with the rows the calling thread
    computes itself; `close` stops it."""
    import time

    from ninfer_offload.runtime import miss_handoff

    engine = Engine.load(tiny_artifact_official, experts="host", num_slots=4, miss_path="cpu")
    store, path = engine.store, engine.store.cpu_path
    generator = torch.Generator().manual_seed(4)
    x = torch.randn(3, engine.config.hidden_size, generator=generator)
    ids = torch.stack([torch.randperm(engine.config.num_experts, generator=generator)[: engine.config.top_k] for _ in range(3)])
    weights = torch.softmax(torch.randn(3, engine.config.top_k, generator=generator), -1)
    wants = [store.routed(engine.backend, layer, x, ids, weights) for layer in (0, 1)]  # answered by this thread
    path.start_worker()
    for layer, pause, want in ((0, 0.0, wants[0]), (1, 0.05, wants[1])):  # the second request comes after the worker went idle
        time.sleep(pause)
        bank = store.bank(layer)
        args = (x, ids, weights, bank.offsets, path.take[layer], path.host_max_uses, store.anchor[layer], store.cpu_uses[layer], bank.arena)
        device_ids, device_weights = miss_handoff.publish(path.mailbox, layer, *args)
        assert int(path.mailbox.state[layer, 1]) == 1  # a request is open: the worker must answer it
        out = engine.backend.routed_experts(x, device_ids, device_weights, bank)
        assert torch.equal(miss_handoff.collect(path.mailbox, layer, out, bank.arena), want)
    worker = path._worker
    engine.close()
    assert not worker.is_alive()
