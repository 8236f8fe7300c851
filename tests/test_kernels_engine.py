"""End to end: the engine on the Triton backend equals the reference engine; CUDA-graph decode equals eager."""

from __future__ import annotations

import pytest
import torch

from kernels_support import HAS_CUDA, needs_cuda, needs_triton_device
from ninfer_offload.runtime.batched_prefill import BATCHED_PREFILL_MIN_SEQUENCES, BATCHED_PREFILL_TOKENS
from ninfer_offload.runtime.engine import Engine

PROMPT = [5, 17, 300, 42, 7, 99, 123]
STEPS = [11, 250, 3]


def _run(engine: Engine) -> torch.Tensor:
    """Prefill logits of PROMPT then one row per decode step: [len(PROMPT) + len(STEPS), vocab]."""
    session = engine.session()
    rows = [session.append(PROMPT)[0]]
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
    """A captured prefill and captured steps against an engine without graphs (every layer launched eagerly).
    The prompt fills the smallest prefill graph (8 tokens), so both engines run the same kernels: a shorter
    prompt, padded to 8 in the graph, is in bf16 as close as any two token counts are (docs/architecture.md, "Rounding")."""
    engine = Engine.load(tiny_artifact_official, device="cuda", dtype=dtype, max_sequences=2, spec="none")
    eager_engine = Engine.load(tiny_artifact_official, device="cuda", dtype=dtype, max_sequences=2, spec="none", cuda_graphs=False)
    assert engine.graphs is not None and eager_engine.graphs is None
    prompt = PROMPT + [1]
    eager, captured = eager_engine.session(), engine.session()
    assert _relative(captured.prefill(prompt).cpu(), eager.prefill(prompt).cpu()) < tolerance
    assert ("prefill", 1, len(prompt)) in engine.graphs.graphs
    for token in STEPS * 3:
        expected = eager.step(token)
        got = captured.step(token)
        assert _relative(got.cpu(), expected.cpu()) < tolerance
    assert captured.length == eager.length == len(prompt) + 3 * len(STEPS)


@pytest.mark.gpu
@needs_cuda
def test_bf16_greedy_is_stable(tiny_artifact_official):
    engine = Engine.load(tiny_artifact_official, device="cuda", dtype="bfloat16", spec="none")

    def greedy() -> list[int]:
        session, out = engine.session(), []
        token = int(session.prefill(PROMPT).argmax())
        for _ in range(12):
            out.append(token)
            token = int(session.step(token).argmax())
        return out

    assert greedy() == greedy()


def test_cpu_engine_steps_eagerly(tiny_artifact_official):
    engine = Engine.load(tiny_artifact_official, device="cpu", max_sequences=2)
    assert engine.graphs is None
    a, b = engine.session(), engine.session()
    a.prefill(PROMPT)
    b.prefill(PROMPT)
    assert torch.equal(a.step(11), b.append([11])[0][0]) and a.length == b.length


@pytest.mark.gpu
@needs_cuda
def test_graphs_are_captured_once_per_engine_and_bucket(tiny_artifact_official):
    engine = Engine.load(tiny_artifact_official, device="cuda", dtype="float32", max_sequences=3, spec="none")
    sessions = [engine.session() for _ in range(3)]
    for session in sessions:
        session.prefill(PROMPT)
    for token in STEPS:
        for session in sessions[:2]:
            session.step(token)
        engine.step_batch(sessions, [token] * 3)
    captured = dict(engine.graphs.graphs)
    # buckets 1, 2, 3: three sequences use bucket 3; the 7-token prompts replay the captured 8-token prefill
    assert set(captured) == {("target", 1, 1), ("target", 3, 1), ("prefill", 1, 8)}
    sessions[0].close()
    again = engine.session()
    again.prefill(PROMPT)
    again.step(5)
    assert engine.graphs.graphs == captured  # a new session reuses the engine's graphs


@pytest.mark.gpu
@needs_cuda
def test_warm_up_captures_every_step_before_the_first_request(tiny_artifact_official):
    """After `warm_up`, requests of any batch size (plain or speculative) capture nothing new."""
    engine = Engine.load(tiny_artifact_official, device="cuda", dtype="float32", max_sequences=3, spec="mtp", draft_tokens=2)
    engine.warm_up(40)
    captured = dict(engine.graphs.graphs)
    assert {("target", b, t) for b in (1, 2, 3) for t in (1, 3)} <= set(captured)
    assert {("mtp", b, 1) for b in (1, 2, 3)} | {("mtp", 1, t) for t in (2, 3)} <= set(captured)
    sessions = [engine.session() for _ in range(3)]
    for session in sessions:
        session.prefill(PROMPT)
    engine.step_batch(sessions, [5, 6, 7])
    engine.step_batch(sessions[:2], [8, 9])
    engine.step(sessions, [[1, 2, 3]] * 3)
    assert engine.graphs.graphs == captured


@pytest.mark.gpu
@needs_cuda
def test_warm_up_compiles_every_batched_prefill_a_server_runs(tiny_artifact_official):
    """After `warm_up`, batched prefills of each warmed piece on 4 to all sequences (a server admitting a burst of
    requests) launch no kernel that Triton has not loaded: no request compiles."""
    from triton import knobs

    engine = Engine.load(tiny_artifact_official, device="cuda", max_sequences=6)
    engine.warm_up(40)
    first_launches: list[str] = []

    def record(*args, **kwargs) -> bool:
        first_launches.append(kwargs["fn"].name)
        return False  # compile it

    knobs.runtime.jit_cache_hook = record
    try:
        for sequences in range(BATCHED_PREFILL_MIN_SEQUENCES, 7):
            for tokens in BATCHED_PREFILL_TOKENS:
                batch = [engine.session() for _ in range(sequences)]
                engine.prefill_batch(batch, [[(7 * i + s) % 500 + 1 for i in range(tokens)] for s in range(sequences)])
                for session in batch:
                    session.close()
    finally:
        knobs.runtime.jit_cache_hook = None
    assert first_launches == []


@needs_triton_device
def test_captured_step_ops_equal_eager_step(tiny_artifact_official):
    """The ops a graph records, reading only device-held context (no host copies), give the eager
    step's logits and KV rows bit for bit."""
    from ninfer_offload.runtime.step_inputs import pack_inputs, unpack_inputs

    device = "cuda" if HAS_CUDA else "cpu"
    # without graphs, so that `forward` runs the layers eagerly (with graphs a short prompt replays a captured prefill)
    engine = Engine.load(tiny_artifact_official, device=device, dtype="float32", backend="triton", max_sequences=2, cuda_graphs=False)
    eager, captured = engine.session(), engine.session()
    eager.prefill(PROMPT[:1])  # (interpreted, a prefill costs ~10 s per token here)
    captured.prefill(PROMPT[:1])
    for token in STEPS[:2]:  # (two steps: ~10 s per interpreted forward)
        expected = eager.append([token])[0][0]
        packed = pack_inputs([token], [captured.slot], [captured.length], 1, engine.max_context).to(device)
        tokens, ctx = unpack_inputs(packed, 1, 1, prefill=False, keep_states=False, host=None)
        with torch.no_grad():
            got = engine.runner.forward(tokens, ctx)[0][0]
        captured.pending = 1
        captured.commit(1)
        assert torch.equal(got, expected)
    length = captured.length
    for key in engine.state.kv:
        mine, theirs = engine.state.kv_of(key, captured.slot), engine.state.kv_of(key, eager.slot)
        assert all(torch.equal(a[:length], b[:length]) for a, b in zip(mine, theirs))


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("cuda_graphs", [False, True])
def test_batched_steps_equal_single_sequence_steps_on_the_gpu(tiny_artifact_official, cuda_graphs):
    """Batches of 1..8 sequences of mixed lengths, eager and captured, against each sequence stepped alone.
    In float32: in bf16 a row depends on its step's token count by design (docs/architecture.md, "Rounding")."""
    engine = Engine.load(tiny_artifact_official, device="cuda", dtype="float32", max_sequences=16, cuda_graphs=cuda_graphs, spec="none")
    assert (engine.graphs is not None) == cuda_graphs
    for batch in range(1, 9):
        batched, single = [engine.session() for _ in range(batch)], [engine.session() for _ in range(batch)]
        for i, (b, s) in enumerate(zip(batched, single)):
            b.prefill(PROMPT[: 1 + i % len(PROMPT)] + STEPS[: i % 3])
            s.prefill(PROMPT[: 1 + i % len(PROMPT)] + STEPS[: i % 3])
        tokens = [(17 * i + 5) % 500 for i in range(batch)]
        for _ in range(3):
            out = engine.step_batch(batched, tokens)
            expected = torch.stack([s.step(t) for s, t in zip(single, tokens)])
            assert _relative(out.cpu(), expected.cpu()) < 1e-5
            tokens = expected.argmax(-1).tolist()
        for session in batched + single:
            session.close()


@pytest.mark.gpu
@needs_cuda
def test_batched_prefill_on_the_triton_backend_equals_prefills_alone(tiny_artifact_official):
    """Several sequences' prompt tokens in one forward of the decode kernels (the server's admission of several
    requests), each padded to 16 tokens, against each prompt prefilled alone, and the next step after it (the
    padding leaves no GDN state behind). On CUDA only: under the interpreter it took 147 s of CI, and the reference
    engine's test checks the same equality on the CPU."""
    engine = Engine.load(tiny_artifact_official, device="cuda", dtype="float32", backend="triton", max_sequences=6, spec="none")
    rows = [PROMPT, STEPS + PROMPT[:4], PROMPT[:3]]
    batched, single = [engine.session() for _ in rows], [engine.session() for _ in rows]
    batched[1].prefill(PROMPT[:2])  # one sequence starts empty, the other holds tokens
    single[1].prefill(PROMPT[:2])
    got = engine.prefill_batch(batched, rows, 16)
    expected = torch.stack([s.prefill(row) for s, row in zip(single, rows)])
    assert _relative(got.cpu(), expected.cpu()) < 1e-4
    step = engine.step_batch(batched, [4, 5, 6])
    assert _relative(step.cpu(), torch.stack([s.step(t) for s, t in zip(single, [4, 5, 6])]).cpu()) < 1e-4


@pytest.mark.gpu
@needs_cuda
def test_rollback_on_the_gpu_equals_never_seeing_the_tokens(tiny_artifact_official):
    engine = Engine.load(tiny_artifact_official, device="cuda", dtype="float32", max_sequences=3, draft_tokens=3)
    a, b, plain = engine.session(), engine.session(), engine.session()
    for session in (a, b, plain):
        session.prefill(PROMPT)
    engine.step([a, b], [[11, 250, 3, 9], [11, 250, 7, 8]])  # one captured verify step, two sequences
    a.rollback(2)
    b.commit(2)
    plain.step(11)
    plain.step(250)
    state = engine.state
    for group in (state.conv, state.recurrent):
        for tensor in group.values():
            assert torch.allclose(tensor[a.slot], tensor[b.slot], atol=1e-6)
            assert torch.allclose(tensor[a.slot], tensor[plain.slot], rtol=1e-4, atol=1e-5)
    expected = plain.step(42)
    assert _relative(a.step(42).cpu(), expected.cpu()) < 1e-4 and _relative(b.step(42).cpu(), expected.cpu()) < 1e-4
