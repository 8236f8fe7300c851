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


def test_greedy_equals_argmax_of_full_prefills(tiny_engine, reprefill_greedy):
    generation = generate(tiny_engine, PROMPT, max_tokens=16, sampling=GREEDY)
    assert list(generation) == reprefill_greedy
    result = generation.result
    assert result.token_ids == reprefill_greedy
    assert (result.finish_reason, result.stop_id, result.prompt_tokens) == ("length", None, len(PROMPT))
    assert result.decode_steps == 15
    assert result.prefill_seconds > 0 and result.decode_seconds > 0
    assert result.prefill_tokens_per_s > 0 and result.decode_tokens_per_s > 0


def test_greedy_equals_transformers_generate(tiny_engine, tiny_hf_model):
    expected = tiny_hf_model.generate(
        torch.tensor([PROMPT]), max_new_tokens=16, do_sample=False, eos_token_id=None, pad_token_id=0
    )[0, len(PROMPT) :].tolist()
    assert generate(tiny_engine, PROMPT, max_tokens=16, sampling=GREEDY).run().token_ids == expected


def test_stop_id_ends_generation_and_is_not_emitted(tiny_engine, reprefill_greedy):
    position = next(i for i, token in enumerate(reprefill_greedy) if i >= 2 and token not in reprefill_greedy[:i])
    stop = reprefill_greedy[position]
    result = generate(tiny_engine, PROMPT, max_tokens=16, sampling=GREEDY, stop_ids={stop, 10_000}).run()
    assert result.token_ids == reprefill_greedy[:position]
    assert (result.finish_reason, result.stop_id) == ("stop", stop)
    first = generate(tiny_engine, PROMPT, max_tokens=16, sampling=GREEDY, stop_ids={reprefill_greedy[0]}).run()
    assert (first.token_ids, first.finish_reason, first.decode_steps) == ([], "stop", 0)


def test_seeded_sampling_is_reproducible(tiny_engine):
    params = SamplingParams(temperature=1.5, top_k=50, seed=1234)
    first = generate(tiny_engine, PROMPT, max_tokens=12, sampling=params).run().token_ids
    assert generate(tiny_engine, PROMPT, max_tokens=12, sampling=params).run().token_ids == first
    other = SamplingParams(temperature=1.5, top_k=50, seed=4321)
    assert generate(tiny_engine, PROMPT, max_tokens=12, sampling=other).run().token_ids != first


def test_abandoned_stream_can_be_closed_and_engine_reused(tiny_engine, reprefill_greedy):
    generation = generate(tiny_engine, PROMPT, max_tokens=16, sampling=GREEDY)
    assert [next(generation), next(generation)] == reprefill_greedy[:2]
    generation.close()
    assert generation.result is None
    assert generate(tiny_engine, PROMPT, max_tokens=4, sampling=GREEDY).run().token_ids == reprefill_greedy[:4]


def test_bad_requests_are_clear_errors(tiny_engine):
    with pytest.raises(NinferError, match="prompt is empty"):
        generate(tiny_engine, [], max_tokens=4)
    with pytest.raises(NinferError, match="max_tokens"):
        generate(tiny_engine, PROMPT, max_tokens=0)


def test_full_context_finishes_with_length(tiny_artifact, reprefill_greedy):
    small = Engine.load(tiny_artifact, max_context=len(PROMPT) + 3)
    result = generate(small, PROMPT, max_tokens=16, sampling=GREEDY).run()
    assert result.token_ids == reprefill_greedy[:4]
    assert result.finish_reason == "length"


def test_engine_generate_delegates_to_the_loop(tiny_engine, reprefill_greedy):
    assert tiny_engine.generate(PROMPT, max_tokens=5, sampling=GREEDY).run().token_ids == reprefill_greedy[:5]


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


def test_a_device_step_refuses_tokens_it_cannot_take(tiny_engine):
    session = tiny_engine.session()
    session.prefill(PROMPT)
    bad_ones = [torch.tensor([1, 2]), torch.tensor([1], dtype=torch.int32), torch.tensor(1)]
    if torch.cuda.is_available():
        bad_ones.append(torch.tensor([1], device="cuda"))  # the engine runs on the CPU
    for bad in bad_ones:
        with pytest.raises(NinferError, match="one int64 token per session"):
            tiny_engine.step_on_device([session], bad)
    session.close()


def test_greedy_with_penalties_keeps_to_the_host_loop(tiny_engine, reprefill_greedy):
    """A repetition penalty makes the next token depend on the history: the host picks it, and the tokens
    differ from plain greedy where the penalty bites."""
    assert len(set(reprefill_greedy[:16])) < 16  # plain greedy repeats a token here
    penalized = SamplingParams(greedy=True, repetition_penalty=100.0)
    result = generate(tiny_engine, PROMPT, max_tokens=16, sampling=penalized).run()
    assert result.decode_steps == 15 and len(set(result.token_ids)) == len(result.token_ids)  # no token twice
    assert result.token_ids[0] == reprefill_greedy[0]
