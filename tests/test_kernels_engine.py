"""End to end: the engine on the Triton backend equals the reference engine; CUDA-graph decode equals eager."""

from __future__ import annotations

import pytest
import torch

from kernels_support import HAS_CUDA, needs_cuda, needs_triton_device
from ninfer_offload.errors import NinferError
from ninfer_offload.runtime.engine import Engine

PROMPT = [5, 17, 300, 42, 7, 99, 123]
STEPS = [11, 250, 3]


def _run(engine: Engine) -> torch.Tensor:
    """Prefill logits of PROMPT then one row per decode step: [len(PROMPT) + len(STEPS), vocab]."""
    session = engine.session()
    rows = [session.forward(PROMPT)[0]]
    rows += [session.step(t)[None] for t in STEPS]
    return torch.cat(rows).float().cpu()


def _relative(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.double() - b.double()).norm() / b.double().norm())


@needs_triton_device
def test_triton_backend_engine_matches_reference(tiny_artifact_official):
    device = "cuda" if HAS_CUDA else "cpu"
    reference = _run(Engine.load(tiny_artifact_official, device="cpu", dtype="float32", backend="reference"))
    fast = _run(Engine.load(tiny_artifact_official, device=device, dtype="float32", backend="triton"))
    assert torch.isfinite(fast).all() and _relative(fast, reference) < 1e-4


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("dtype,tolerance", [("float32", 1e-5), ("bfloat16", 2e-2)])
def test_graph_replay_equals_eager(tiny_artifact_official, dtype, tolerance):
    from ninfer_offload.runtime.cuda_graph import DecodeGraph

    engine = Engine.load(tiny_artifact_official, device="cuda", dtype=dtype)
    eager, captured = engine.session(), engine.session()
    eager.prefill(PROMPT)
    captured.prefill(PROMPT)
    graph = DecodeGraph(engine, captured)
    for token in STEPS * 3:
        expected = eager.forward([token])[0][0].float()  # the eager layers, not a graph
        got = graph.step(token)
        assert _relative(got.cpu(), expected.cpu()) < tolerance
    assert captured.length == eager.length == len(PROMPT) + 3 * len(STEPS)


@pytest.mark.gpu
@needs_cuda
def test_bf16_greedy_is_stable(tiny_artifact_official):
    engine = Engine.load(tiny_artifact_official, device="cuda", dtype="bfloat16")

    def greedy() -> list[int]:
        session, out = engine.session(), []
        token = int(session.prefill(PROMPT).argmax())
        for _ in range(12):
            out.append(token)
            token = int(session.step(token).argmax())
        return out

    assert greedy() == greedy()


def test_graph_needs_cuda_and_decode_step_falls_back(tiny_artifact_official):
    from ninfer_offload.runtime.cuda_graph import DecodeGraph, decode_step

    engine = Engine.load(tiny_artifact_official, device="cpu")
    with pytest.raises(NinferError, match="CUDA"):
        DecodeGraph(engine, engine.session())
    a, b = engine.session(), engine.session()
    a.prefill(PROMPT)
    b.prefill(PROMPT)
    assert torch.equal(decode_step(a, 11), b.forward([11])[0][0]) and a.length == b.length


@pytest.mark.gpu
@needs_cuda
def test_decode_step_keeps_one_graph_per_session(tiny_artifact_official):
    from ninfer_offload.runtime import cuda_graph

    engine = Engine.load(tiny_artifact_official, device="cuda", dtype="float32")
    a, b = engine.session(), engine.session()
    a.prefill(PROMPT)
    b.prefill(PROMPT)
    for token in STEPS:
        assert _relative(cuda_graph.decode_step(a, token).cpu(), b.forward([token])[0][0].float().cpu()) < 1e-5
    assert cuda_graph._GRAPHS[a].session is a


@needs_triton_device
def test_captured_step_ops_equal_eager_step(tiny_artifact_official):
    """The ops a graph records (device-held position and KV length) give the eager step's logits and KV rows bit for bit."""
    from ninfer_offload.runtime.cuda_graph import captured_forward
    from ninfer_offload.runtime.state import Segment

    device = "cuda" if HAS_CUDA else "cpu"
    engine = Engine.load(tiny_artifact_official, device=device, dtype="float32", backend="triton")
    eager, captured = engine.session(), engine.session()
    eager.prefill(PROMPT)
    captured.prefill(PROMPT)
    state = captured._live_state()
    for token in STEPS:
        expected = eager.forward([token])[0][0]
        position = torch.tensor([state.length], device=device)
        rows = torch.tensor([state.length + 1], dtype=torch.int32, device=device)
        with torch.no_grad():
            got = captured_forward(engine, [Segment(state, 0, 0, 1)], torch.tensor([token], device=device), position, rows)[0]
        state.length += 1
        assert torch.equal(got, expected)
    for key, (k_cache, v_cache) in state.kv.items():
        eager_k, eager_v = eager._live_state().kv[key]
        assert torch.equal(k_cache[: state.length], eager_k[: state.length]) and torch.equal(v_cache[: state.length], eager_v[: state.length])
