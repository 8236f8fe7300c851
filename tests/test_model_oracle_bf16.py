"""The lossless (`bf16` recipe) artifact against transformers: prefill, 32+ decode steps, chunked
prefill, prefill across GDN chunk boundaries, the recurrent and chunked delta rule on either side of
their threshold, greedy generation. CPU, float32."""

from __future__ import annotations

import pytest
import tiny_hf
import torch

from ninfer_offload import Engine
from ninfer_offload.model.gdn import RECURRENT_PREFILL_TOKENS
from ninfer_offload.runtime.sampling import SamplingParams

PROMPT = torch.randint(0, 512, (20,), generator=torch.Generator().manual_seed(1)).tolist()


def assert_close(ours: torch.Tensor, ref: torch.Tensor, rel: float = 1e-4) -> None:
    """Within rel * max(1, max|logit|) everywhere, and the same argmax per row."""
    tolerance = rel * max(1.0, ref.abs().max().item())
    assert (ours - ref).abs().max().item() <= tolerance
    assert torch.equal(ours.argmax(-1), ref.argmax(-1))


@pytest.fixture(scope="module")
def engine(tiny_artifact):
    eng = Engine.load(tiny_artifact)
    yield eng
    eng.close()


def test_prompt_has_no_router_near_ties(tiny_hf_model):
    """The chosen seeds keep every layer's k-th and (k+1)-th router probabilities apart."""
    ids = torch.tensor([PROMPT])
    with torch.no_grad():
        out = tiny_hf_model(input_ids=ids, output_router_logits=True)
    k = tiny_hf_model.config.num_experts_per_tok
    for logits in out.router_logits:
        top = torch.softmax(logits.float(), dim=-1).topk(k + 1, dim=-1).values
        assert (top[:, k - 1] - top[:, k]).min().item() > 1e-4


def test_prefill_matches_transformers(engine, tiny_hf_model):
    ref, _ = tiny_hf.oracle_forward(tiny_hf_model, PROMPT)
    assert_close(engine.logits(PROMPT), ref, rel=1e-5)


def test_decode_steps_match_transformers(engine, tiny_hf_model):
    ref, cache = tiny_hf.oracle_forward(tiny_hf_model, PROMPT)
    session = engine.session()
    assert_close(session.prefill(PROMPT)[None], ref[-1:])
    token = int(ref[-1].argmax())
    for _ in range(34):
        ref_step, cache = tiny_hf.oracle_forward(tiny_hf_model, [token], cache)
        assert_close(session.step(token)[None], ref_step)
        token = int(ref_step[0].argmax())
    assert session.length == len(PROMPT) + 34


def test_chunked_prefill_equals_one_shot(engine):
    one_shot = engine.session().prefill(PROMPT)
    session = engine.session()
    for chunk in (PROMPT[:7], PROMPT[7:8], PROMPT[8:]):
        last = session.prefill(chunk)
    assert (last - one_shot).abs().max().item() <= 1e-5 * max(1.0, one_shot.abs().max().item())
    assert session.length == len(PROMPT)


def test_prefill_across_gdn_chunks_matches_transformers(engine, tiny_hf_model):
    """150 tokens span three 64-token chunks of the delta rule and the attention mask."""
    ids = torch.randint(0, 512, (150,), generator=torch.Generator().manual_seed(3)).tolist()
    ref, _ = tiny_hf.oracle_forward(tiny_hf_model, ids)
    assert_close(engine.logits(ids), ref, rel=1e-5)


@pytest.mark.parametrize("length", [RECURRENT_PREFILL_TOKENS, RECURRENT_PREFILL_TOKENS + 1])
def test_recurrent_and_chunked_prefill_match_transformers(engine, tiny_hf_model, monkeypatch, length):
    """A prompt of up to RECURRENT_PREFILL_TOKENS tokens runs the delta rule token by token, a longer one
    chunked: both match transformers, and so do the decode steps from the GDN states each leaves."""
    chunked_calls = []
    chunked = engine.backend.gdn_prefill
    monkeypatch.setattr(engine.backend, "gdn_prefill", lambda *args: chunked_calls.append(1) or chunked(*args))
    ids = torch.randint(0, 512, (length,), generator=torch.Generator().manual_seed(4)).tolist()
    ref, cache = tiny_hf.oracle_forward(tiny_hf_model, ids)
    session = engine.session()
    assert_close(session.prefill(ids)[None], ref[-1:], rel=1e-5)
    assert bool(chunked_calls) == (length > RECURRENT_PREFILL_TOKENS)
    token = int(ref[-1].argmax())
    for _ in range(3):
        ref_step, cache = tiny_hf.oracle_forward(tiny_hf_model, [token], cache)
        assert_close(session.step(token)[None], ref_step)
        token = int(ref_step[0].argmax())
    session.close()


def test_greedy_generation_equals_transformers_generate(engine, tiny_hf_model):
    with torch.no_grad():
        expected = tiny_hf_model.generate(
            torch.tensor([PROMPT]), max_new_tokens=20, do_sample=False, min_new_tokens=20, eos_token_id=None, pad_token_id=0
        )[0, len(PROMPT) :].tolist()
    generation = engine.generate(PROMPT, max_tokens=20, sampling=SamplingParams(greedy=True))
    assert list(generation) == expected
    assert generation.result.finish_reason == "length"
