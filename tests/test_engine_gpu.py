"""The reference engine on CUDA: bf16 close to the CPU float32 run, pinned host experts equal
to resident ones, batched decode. Skipped without CUDA."""

from __future__ import annotations

import pytest
import torch

from ninfer_offload import Engine

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

PROMPT = torch.randint(0, 512, (40,), generator=torch.Generator().manual_seed(7)).tolist()
LONG_PROMPT = torch.randint(0, 512, (150,), generator=torch.Generator().manual_seed(8)).tolist()  # past GRAPHED_PROMPT_MAX


def _relative(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.double().cpu() - b.double().cpu()).norm() / b.double().cpu().norm())


def test_cuda_float32_reference_engine_matches_cpu(tiny_artifact_official):
    cpu = Engine.load(tiny_artifact_official, spec="none").logits(PROMPT)
    cuda = Engine.load(tiny_artifact_official, device="cuda", dtype="float32", backend="reference", spec="none")
    assert _relative(cuda.logits(PROMPT), cpu) < 1e-5


def test_cuda_bfloat16_reference_engine_is_close_to_cpu_float32(tiny_artifact):
    """bf16 is the default on CUDA. Over the first positions of this prompt no router choice is near
    enough a tie to flip in bf16 (later ones and the quantized recipes' weights do have such ties,
    which legitimately move logits by O(1)); on CPU in bf16 these positions are within 3% of fp32."""
    ids = PROMPT[:9]  # position 9 of the TINY_SEED model has a near-tie (CPU bf16 is 12 % off fp32 there too)
    cpu = Engine.load(tiny_artifact, spec="none").logits(ids)
    cuda = Engine.load(tiny_artifact, device="cuda", backend="reference", spec="none")
    assert cuda.dtype == torch.bfloat16
    got = cuda.logits(ids).cpu()
    for row in range(len(ids)):
        assert _relative(got[row], cpu[row]) < 6e-2
    assert torch.equal(got.argmax(-1), cpu.argmax(-1))


@pytest.mark.parametrize("backend", ["reference", "triton"])
def test_cuda_pinned_host_experts_equal_resident(tiny_artifact_official, backend):
    """Experts in pinned host memory give the resident logits: prefill and decode steps. In float32 and to its
    rounding: the Triton prefill over host records takes 256-column k tiles (`moe.HOST_PREFILL_TILES`, rows read
    over PCIe in long runs) where resident records take 64, so its sums are added in another order."""
    resident = Engine.load(tiny_artifact_official, device="cuda", dtype="float32", backend=backend, spec="none")
    host = Engine.load(tiny_artifact_official, device="cuda", dtype="float32", experts="host", num_slots=3, backend=backend, spec="none")
    assert host.store.host[0].is_pinned()
    assert _relative(host.logits(PROMPT), resident.logits(PROMPT)) < 1e-5
    sessions = [resident.session(), host.session()]
    for session in sessions:
        session.prefill(LONG_PROMPT[:140])  # longer than a prompt replayed in pieces
    for token in LONG_PROMPT[140:146]:
        assert _relative(*[session.step(token) for session in sessions]) < 1e-5
    assert host.store.stats.uses > host.store.stats.hits  # some experts were read from host memory


def test_captured_short_prefill_equals_the_eager_one(tiny_artifact_official):
    """Prompt chunks of up to 32 tokens replay a captured prefill padded to its bucket, and prompts of up to
    GRAPHED_PROMPT_MAX tokens replay it in 32-token pieces: the logits and the state they leave (the decode
    steps after them, a second chunk after the first) match the eager prefill's, which runs each chunk whole."""
    from ninfer_offload.runtime.step_runner import GRAPHED_PROMPT_MAX

    engines = [
        Engine.load(tiny_artifact_official, device="cuda", dtype="float32", spec="none", cuda_graphs=graphs) for graphs in (True, False)
    ]
    assert engines[0].graphs is not None and engines[1].graphs is None
    for chunks in ([5], [8], [24], [3, 29], [32, 1], [40], [3, 70], [GRAPHED_PROMPT_MAX]):
        outputs = []
        for engine in engines:
            session, logits, start = engine.session(), [], 0
            for size in chunks:
                logits.append(session.prefill(LONG_PROMPT[start : start + size]))
                start += size
            logits += [session.step(token) for token in LONG_PROMPT[start : start + 4]]
            outputs.append(torch.stack(logits))
            session.close()
        assert _relative(*outputs) < 1e-4
    assert {key[2] for key in engines[0].graphs.graphs if key[0] == "prefill"} == {8, 32}


def test_captured_batched_prefill_equals_the_eager_one(tiny_artifact_official):
    """A server's admission of several prompts (`prefill_batch`, pieces of BATCHED_PREFILL_TOKENS) replays a captured
    forward of its batch bucket, the batch padded with scratch entries and each row with padding tokens: its logits
    and the state it leaves (the batched decode steps after it) match the eager batched prefill's, for 4 sequences
    (a bucket of their own) and 5 (padded to 8)."""
    from ninfer_offload.runtime.batched_prefill import BATCHED_PREFILL_TOKENS

    engines = [
        Engine.load(tiny_artifact_official, device="cuda", dtype="float32", spec="none", max_sequences=8, cuda_graphs=graphs)
        for graphs in (True, False)
    ]
    for sequences, tokens in ((4, BATCHED_PREFILL_TOKENS[0]), (5, BATCHED_PREFILL_TOKENS[-1])):
        outputs = []
        for engine in engines:
            sessions = [engine.session() for _ in range(sequences)]
            rows = [LONG_PROMPT[i : tokens] for i in range(sequences)]  # tokens, tokens - 1, ... real tokens
            logits = [engine.prefill_batch(sessions, rows, tokens)]
            logits += [engine.step_batch(sessions, [LONG_PROMPT[100 + step + i] for i in range(sequences)]) for step in range(3)]
            outputs.append(torch.stack(logits))
            for session in sessions:
                session.close()
        assert _relative(*outputs) < 1e-4
    captured = {key[1:3] for key in engines[0].graphs.graphs if key[0] == "prefill"}
    assert captured == {(4, BATCHED_PREFILL_TOKENS[0]), (8, BATCHED_PREFILL_TOKENS[-1])}


@pytest.mark.parametrize("backend,batch", [("reference", 2), ("triton", 2), ("triton", 8)])
def test_cuda_step_batch_equals_single_steps(tiny_artifact_official, backend, batch, monkeypatch):
    """A batched step equals each sequence's own step, for mixed lengths; on the Triton backend the batch's
    products run on tensor cores (as the full model's large ones do; these tiny ones are made to), one
    sequence's on CUDA cores: equal to fp32 rounding."""
    from ninfer_offload.kernels import quant_linear

    monkeypatch.setattr(quant_linear, "MMA_MIN_ROWS", 1)
    engine = Engine.load(tiny_artifact_official, device="cuda", dtype="float32", backend=backend, max_sequences=2 * batch, spec="none")
    batched, single = [engine.session() for _ in range(batch)], [engine.session() for _ in range(batch)]
    for sessions in (batched, single):
        for i, session in enumerate(sessions):
            session.prefill(PROMPT[: 9 + 5 * i])
    tokens = [3 + i for i in range(batch)]
    out = engine.step_batch(batched, tokens)
    expected = torch.stack([session.step(token) for session, token in zip(single, tokens)])
    assert _relative(out, expected) < 1e-5


def test_cuda_batched_steps_on_device_tokens_equal_host_steps(tiny_artifact_official):
    """Two sequences of different lengths decoded greedily by graph replays fed the device's argmax (the
    server's steps ahead of the host) give the tokens and logits of steps fed the host's tokens."""
    from ninfer_offload.runtime.decoder import queue_greedy_step

    engine = Engine.load(tiny_artifact_official, device="cuda", max_sequences=4, spec="none")
    assert engine.graphs is not None
    host, ahead = [engine.session() for _ in range(2)], [engine.session() for _ in range(2)]
    firsts = []
    for sessions in (host, ahead):
        firsts = [int(sessions[0].prefill(PROMPT[:9]).argmax()), int(sessions[1].prefill(PROMPT).argmax())]
    tokens, expected = firsts, []
    for _ in range(6):
        logits = engine.step_batch(host, tokens)
        tokens = logits.argmax(-1).tolist()
        expected.append(tokens)
    queued = queue_greedy_step(engine, ahead, torch.tensor(firsts, device="cuda"))
    got = []
    for _ in range(5):
        following = queue_greedy_step(engine, ahead, queued.device)
        got.append(queued.read())
        queued = following
    got.append(queued.read())
    assert got == expected


@pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.get_device_capability()[0] < 9, reason="PDL needs sm_90+")
def test_dependent_launches_equal_plain_launches(tiny_artifact_official, monkeypatch):
    """Kernels launched with programmatic dependent launch (`kernels.launch`, on by default on sm_90+) give the
    logits of plain launches, bit for bit: one-token steps, a 4-token verification and a batched step, replayed
    from CUDA graphs, resident and with experts read from pinned host memory."""
    from ninfer_offload.kernels import launch

    def run(experts: str) -> list[torch.Tensor]:
        slots = {"num_slots": 3} if experts == "host" else {}
        engine = Engine.load(
            tiny_artifact_official, device="cuda", max_sequences=3, spec="none", mtp=True, draft_tokens=3, experts=experts, **slots
        )
        assert engine.graphs is not None
        sessions = [engine.session() for _ in range(3)]
        for i, session in enumerate(sessions):
            session.prefill(PROMPT[: 12 + 7 * i])
        out = [sessions[0].step(token) for token in PROMPT[30:34]]
        out.append(engine.step([sessions[1]], [PROMPT[20:24]]))
        sessions[1].commit(2)
        out.append(engine.step_batch(sessions, [5, 6, 7]))
        return out

    for experts in ("resident", "host"):
        monkeypatch.setattr(launch, "ENABLED", True)
        dependent = run(experts)
        monkeypatch.setattr(launch, "ENABLED", False)
        plain = run(experts)
        for got, want in zip(dependent, plain):
            assert torch.equal(got, want), experts
