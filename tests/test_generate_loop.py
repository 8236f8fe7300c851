"""The generation loop on the real engine over the tiny bf16 artifact."""

from __future__ import annotations

import pytest
from conftest import GREEDY_PROMPT
import torch

from ninfer_offload.errors import NinferError
from ninfer_offload.runtime.engine import Engine
from ninfer_offload.runtime.generate import generate
from ninfer_offload.runtime.sampling import SamplingParams

PROMPT = GREEDY_PROMPT  # shared with the session greedy reference (conftest)
GREEDY = SamplingParams(greedy=True)


@pytest.fixture(scope="module")
def engine(tiny_engine):
    return tiny_engine


@pytest.fixture(scope="module")
def reference_greedy(reprefill_greedy):
    return reprefill_greedy


def test_greedy_equals_argmax_of_full_prefills(engine, reference_greedy):
    generation = generate(engine, PROMPT, max_tokens=16, sampling=GREEDY)
    assert list(generation) == reference_greedy
    result = generation.result
    assert result.token_ids == reference_greedy
    assert (result.finish_reason, result.stop_id, result.prompt_tokens) == ("length", None, len(PROMPT))
    assert result.decode_steps == 15
    assert result.prefill_seconds > 0 and result.decode_seconds > 0
    assert result.prefill_tokens_per_s > 0 and result.decode_tokens_per_s > 0


def test_greedy_equals_transformers_generate(engine, tiny_hf_model):
    expected = tiny_hf_model.generate(
        torch.tensor([PROMPT]), max_new_tokens=16, do_sample=False, eos_token_id=None, pad_token_id=0
    )[0, len(PROMPT) :].tolist()
    assert generate(engine, PROMPT, max_tokens=16, sampling=GREEDY).run().token_ids == expected


def test_stop_id_ends_generation_and_is_not_emitted(engine, reference_greedy):
    position = next(i for i, token in enumerate(reference_greedy) if i >= 2 and token not in reference_greedy[:i])
    stop = reference_greedy[position]
    result = generate(engine, PROMPT, max_tokens=16, sampling=GREEDY, stop_ids={stop, 10_000}).run()
    assert result.token_ids == reference_greedy[:position]
    assert (result.finish_reason, result.stop_id) == ("stop", stop)
    first = generate(engine, PROMPT, max_tokens=16, sampling=GREEDY, stop_ids={reference_greedy[0]}).run()
    assert (first.token_ids, first.finish_reason, first.decode_steps) == ([], "stop", 0)


def test_seeded_sampling_is_reproducible(engine):
    params = SamplingParams(temperature=1.5, top_k=50, seed=1234)
    first = generate(engine, PROMPT, max_tokens=12, sampling=params).run().token_ids
    assert generate(engine, PROMPT, max_tokens=12, sampling=params).run().token_ids == first
    other = SamplingParams(temperature=1.5, top_k=50, seed=4321)
    assert generate(engine, PROMPT, max_tokens=12, sampling=other).run().token_ids != first


def test_abandoned_stream_can_be_closed_and_engine_reused(engine, reference_greedy):
    generation = generate(engine, PROMPT, max_tokens=16, sampling=GREEDY)
    assert [next(generation), next(generation)] == reference_greedy[:2]
    generation.close()
    assert generation.result is None
    assert generate(engine, PROMPT, max_tokens=4, sampling=GREEDY).run().token_ids == reference_greedy[:4]


def test_bad_requests_are_clear_errors(engine):
    with pytest.raises(NinferError, match="prompt is empty"):
        generate(engine, [], max_tokens=4)
    with pytest.raises(NinferError, match="max_tokens"):
        generate(engine, PROMPT, max_tokens=0)


def test_full_context_finishes_with_length(tiny_artifact, reference_greedy):
    small = Engine.load(tiny_artifact, max_context=len(PROMPT) + 3)
    result = generate(small, PROMPT, max_tokens=16, sampling=GREEDY).run()
    assert result.token_ids == reference_greedy[:4]
    assert result.finish_reason == "length"


def test_engine_generate_delegates_to_the_loop(engine, reference_greedy):
    assert engine.generate(PROMPT, max_tokens=5, sampling=GREEDY).run().token_ids == reference_greedy[:5]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_generation_on_cuda(tiny_artifact):
    cuda = Engine.load(tiny_artifact, device="cuda")
    session = cuda.session()
    expected = [int(torch.argmax(session.prefill(PROMPT)))]
    for _ in range(11):
        expected.append(int(torch.argmax(session.step(expected[-1]))))
    session.close()
    result = generate(cuda, PROMPT, max_tokens=12, sampling=GREEDY).run()
    assert result.token_ids == expected and result.decode_steps == 11
    params = SamplingParams(temperature=1.2, top_p=0.95, min_p=0.01, repetition_penalty=1.1, seed=99)
    first = generate(cuda, PROMPT, max_tokens=12, sampling=params).run().token_ids
    assert generate(cuda, PROMPT, max_tokens=12, sampling=params).run().token_ids == first
