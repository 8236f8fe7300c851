"""The reference engine on CUDA: bf16 close to the CPU float32 run, pinned host-staged experts equal
to resident ones, batched decode. Skipped without CUDA."""

from __future__ import annotations

import pytest
import torch

from ninfer_offload import Engine

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

PROMPT = torch.randint(0, 512, (40,), generator=torch.Generator().manual_seed(7)).tolist()


def _relative(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.double().cpu() - b.double().cpu()).norm() / b.double().cpu().norm())


@pytest.mark.parametrize("dtype,tolerance", [("float32", 1e-5), ("bfloat16", 5e-2)])
def test_cuda_reference_engine_matches_cpu(tiny_artifact_official, dtype, tolerance):
    cpu = Engine.load(tiny_artifact_official).logits(PROMPT)
    cuda = Engine.load(tiny_artifact_official, device="cuda", dtype=dtype, backend="reference")
    assert cuda.dtype == getattr(torch, dtype)
    assert _relative(cuda.logits(PROMPT), cpu) < tolerance


def test_cuda_pinned_host_experts_equal_resident(tiny_artifact_official):
    resident = Engine.load(tiny_artifact_official, device="cuda", backend="reference")
    host = Engine.load(tiny_artifact_official, device="cuda", experts="host", num_slots=3, backend="reference")
    assert host.store.host[0].is_pinned()
    assert torch.equal(host.logits(PROMPT), resident.logits(PROMPT))
    sessions = [resident.session(), host.session()]
    for session in sessions:
        session.prefill(PROMPT[:20])
    for token in PROMPT[20:30]:
        assert torch.equal(*[session.step(token) for session in sessions])
    assert host.store.stats.misses > 0


def test_cuda_step_batch_equals_single_steps(tiny_artifact_official):
    engine = Engine.load(tiny_artifact_official, device="cuda", dtype="float32", backend="reference")
    batched, single = [engine.session() for _ in range(2)], [engine.session() for _ in range(2)]
    for sessions in (batched, single):
        sessions[0].prefill(PROMPT[:9])
        sessions[1].prefill(PROMPT)
    out = engine.step_batch(batched, [3, 4])
    expected = torch.stack([single[0].step(3), single[1].step(4)])
    assert _relative(out, expected) < 1e-5
