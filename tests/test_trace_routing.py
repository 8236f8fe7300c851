"""Benchmark routing by trace, per sequence (`runtime.trace_routing`): each row of a batched step takes the
experts its own sequence's stretch of the trace names, and a batch gives what each sequence gives alone."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from ninfer_offload import Engine, NinferError
from ninfer_offload.commands.bench_routing import BENCH_ROUTING, apply_bench_routing
from ninfer_offload.runtime.trace_routing import SequenceTraceRouting

PROMPTS = [torch.randint(0, 512, (n,), generator=torch.Generator().manual_seed(n)).tolist() for n in (5, 9, 13)]
STEPS = 4


@pytest.fixture(scope="module")
def engine(tiny_artifact_official):
    eng = Engine.load(tiny_artifact_official, experts="host", num_slots=5, max_sequences=len(PROMPTS), spec="none")
    eng.store.route_by_trace(SequenceTraceRouting.for_engine(eng, seed=3))
    yield eng
    eng.close()


def _expected_uses(engine: Engine, slots: list[int], starts: list[int], count: int) -> np.ndarray:
    """Uses per (text layer, expert) of rows `start .. start + count - 1` of each slot, as the trace routes them."""
    routing = engine.store.trace_routing
    trace = routing.trace.cpu().numpy()  # [layers, tokens, k]
    offsets = routing.offsets.cpu().numpy()
    uses = np.zeros((routing.layers, engine.config.num_experts), dtype=np.int64)
    for slot, start in zip(slots, starts):
        for position in range(start, start + count):
            for layer in range(routing.layers):
                np.add.at(uses[layer], trace[layer, (offsets[slot] + position) % routing.tokens], 1)
    return uses


def _uses(engine: Engine) -> np.ndarray:
    return engine.store.uses.cpu().numpy().astype(np.int64)


def test_each_row_of_a_batched_step_routes_as_its_sequences_trace(engine):
    sessions = [engine.session() for _ in PROMPTS]
    try:
        slots = [s.slot for s in sessions]
        assert len(set(engine.store.trace_routing.offsets[slots].tolist())) == len(slots)  # each sequence its own stretch
        for session, prompt in zip(sessions, PROMPTS):
            before = _uses(engine)
            session.prefill(prompt)
            assert np.array_equal(_uses(engine) - before, _expected_uses(engine, [session.slot], [0], len(prompt)))
        tokens = [3, 7, 11]
        for _ in range(STEPS):
            before, starts = _uses(engine), [s.length for s in sessions]
            tokens = engine.step_batch(sessions, tokens).argmax(-1).tolist()
            assert np.array_equal(_uses(engine) - before, _expected_uses(engine, slots, starts, 1))
    finally:
        for session in sessions:
            session.close()


def test_a_batch_gives_each_sequence_its_solo_output_under_its_trace(engine):
    """Equal to float32 rounding (CPU kernels round a row differently with other rows in the call), the same
    greedy tokens: a sequence routes the same whether or not others share its steps."""
    sessions = [engine.session() for _ in PROMPTS]
    batched: dict[int, list[torch.Tensor]] = {}
    try:
        first = [session.prefill(prompt) for session, prompt in zip(sessions, PROMPTS)]
        tokens = [int(logits.argmax()) for logits in first]
        steps = []
        for _ in range(STEPS):
            steps.append(engine.step_batch(sessions, tokens))
            tokens = steps[-1].argmax(-1).tolist()
        for i, session in enumerate(sessions):
            batched[session.slot] = [first[i]] + [step[i] for step in steps]
    finally:
        for session in sessions:
            session.close()
    for slot, prompt in zip(batched, PROMPTS):
        opened = [engine.session() for _ in PROMPTS]  # the solo run needs the batch's slot (its stretch of the trace)
        try:
            solo = next(s for s in opened if s.slot == slot)
            outputs = [solo.prefill(prompt)]
            for _ in range(STEPS):
                outputs.append(solo.step(int(outputs[-1].argmax())))
        finally:
            for session in opened:
                session.close()
        for got, want in zip(batched[slot], outputs):
            assert torch.allclose(got, want, rtol=0, atol=1e-5 * want.abs().max().item())
            assert torch.equal(got.argmax(-1), want.argmax(-1))


def test_the_serve_and_generate_commands_turn_it_on_from_the_environment(tiny_artifact_official, monkeypatch):
    engine = Engine.load(tiny_artifact_official, experts="host", num_slots=5, spec="none")
    try:
        monkeypatch.delenv(BENCH_ROUTING, raising=False)
        assert apply_bench_routing(engine) is None and engine.store.trace_routing is None
        monkeypatch.setenv(BENCH_ROUTING, "router")
        with pytest.raises(NinferError, match=f"{BENCH_ROUTING} must be 'trace' or unset"):
            apply_bench_routing(engine)
        monkeypatch.setenv(BENCH_ROUTING, "trace")
        assert "benchmark routing: each sequence by its own stretch" in apply_bench_routing(engine)
        assert engine.store.trace_routing.offsets.numel() == engine.state.sequences + 1
    finally:
        engine.close()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_captured_steps_route_as_the_eager_ones(tiny_artifact_official):
    """Replayed CUDA graphs (captured by the warm-up, after its eager run of the same context) gather each row's
    experts at every replay: their logits match the eager steps' under the same per-sequence trace."""
    runs = []
    for graphs in (True, False):
        engine = Engine.load(
            tiny_artifact_official, device="cuda", dtype="float32", experts="host", num_slots=5, max_sequences=len(PROMPTS),
            spec="none", cuda_graphs=graphs,
        )
        engine.store.route_by_trace(SequenceTraceRouting.for_engine(engine, seed=3))
        engine.warm_up()
        assert (engine.graphs is not None) == graphs
        sessions = [engine.session() for _ in PROMPTS]
        tokens = [int(session.prefill(prompt).argmax()) for session, prompt in zip(sessions, PROMPTS)]
        steps = []
        for _ in range(STEPS):
            steps.append(engine.step_batch(sessions, tokens).float().cpu())
            tokens = steps[-1].argmax(-1).tolist()
        runs.append(steps)
        for session in sessions:
            session.close()
        engine.close()
    for captured, eager in zip(*runs):
        assert torch.allclose(captured, eager, rtol=0, atol=1e-3 * eager.abs().max().item())


def test_a_prefill_span_routes_each_chunk_by_its_own_positions(tiny_artifact_official):
    """An offloaded load prefilling a prompt of three chunks in one span (each layer over the chunks in turn) routes
    every chunk's rows by their own positions, as the resident load prefilling chunk by chunk does: equal logits at
    every position, and the text layers' uses are the trace's."""
    prompt = (PROMPTS[2] * 30)[:360]
    host = Engine.load(tiny_artifact_official, experts="host", num_slots=5, cache_policy="static", spec="none", prefill_chunk=160)
    resident = Engine.load(tiny_artifact_official, spec="none", prefill_chunk=160)
    assert host.prefill_span > 360 > resident.prefill_span
    for engine in (host, resident):
        engine.store.route_by_trace(SequenceTraceRouting.for_engine(engine, seed=3))
    assert torch.equal(host.logits(prompt), resident.logits(prompt))
    layers = host.store.trace_routing.layers
    slot = host.state.sequences - 1  # the one slot a fresh session of a one-sequence engine takes
    assert np.array_equal(_uses(host)[:layers], _expected_uses(host, [slot], [0], len(prompt)))
    host.close()
    resident.close()
