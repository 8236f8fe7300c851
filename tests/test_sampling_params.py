"""Sampling: hand-computed distributions, transformers' logits processors as oracle, seeds, statistics."""

from __future__ import annotations

import math

import pytest
import torch
from transformers.generation.logits_process import (
    MinPLogitsWarper,
    RepetitionPenaltyLogitsProcessor,
    TemperatureLogitsWarper,
    TopKLogitsWarper,
    TopPLogitsWarper,
)

from ninfer_offload.errors import NinferError
from ninfer_offload.runtime.sampling import Sampler, SamplingParams, apply_penalties, sampling_from_config

# probabilities 0.5, 0.3, 0.15, 0.05
LOGITS = torch.log(torch.tensor([0.5, 0.3, 0.15, 0.05]))


def probs(logits=LOGITS, history=(), prompt=(), **params) -> torch.Tensor:
    return Sampler(SamplingParams(**params)).probabilities(logits, list(history), list(prompt))


def renormalised(keep: list[int]) -> torch.Tensor:
    base = torch.tensor([0.5, 0.3, 0.15, 0.05])
    mask = torch.zeros(4, dtype=torch.bool)
    mask[keep] = True
    return torch.where(mask, base, 0.0) / base[mask].sum()


def test_temperature_scales_logits():
    logits = torch.tensor([2.0, 1.0, 0.0, -1.0])
    expected = torch.softmax(torch.tensor([1.0, 0.5, 0.0, -0.5]), dim=0)
    torch.testing.assert_close(probs(logits, temperature=2.0), expected)


@pytest.mark.parametrize(("top_k", "keep"), [(1, [0]), (2, [0, 1]), (3, [0, 1, 2]), (0, [0, 1, 2, 3]), (9, [0, 1, 2, 3])])
def test_top_k(top_k, keep):
    torch.testing.assert_close(probs(top_k=top_k), renormalised(keep))


@pytest.mark.parametrize(("top_p", "keep"), [(0.49, [0]), (0.51, [0, 1]), (0.79, [0, 1]), (0.81, [0, 1, 2]), (0.96, [0, 1, 2, 3])])
def test_top_p_keeps_the_minimal_prefix(top_p, keep):
    torch.testing.assert_close(probs(top_p=top_p), renormalised(keep))


@pytest.mark.parametrize(("min_p", "keep"), [(0.05, [0, 1, 2, 3]), (0.2, [0, 1, 2]), (0.5, [0, 1]), (0.9, [0])])
def test_min_p_thresholds_relative_to_the_top(min_p, keep):
    torch.testing.assert_close(probs(min_p=min_p), renormalised(keep))


def test_filters_compose_in_order():
    # top-k 3 -> {0,1,2} renormalised to 0.526, 0.316, 0.158; top-p 0.8 keeps {0,1}
    torch.testing.assert_close(probs(top_k=3, top_p=0.8), renormalised([0, 1]))


def test_repetition_penalty_divides_positive_and_multiplies_negative():
    logits = torch.tensor([2.0, -1.0, 3.0, 0.5])
    out = apply_penalties(logits, SamplingParams(repetition_penalty=2.0), history=[0], prompt=[1, 1])
    torch.testing.assert_close(out, torch.tensor([1.0, -2.0, 3.0, 0.5]))


def test_presence_and_frequency_penalties_count_output_tokens():
    logits = torch.zeros(4)
    params = SamplingParams(presence_penalty=0.5, frequency_penalty=0.25)
    out = apply_penalties(logits, params, history=[0, 0, 2], prompt=[3])
    torch.testing.assert_close(out, torch.tensor([-1.0, 0.0, -0.75, 0.0]))


def test_matches_transformers_processors_on_random_logits():
    generator = torch.Generator().manual_seed(0)
    for trial in range(20):
        logits = torch.randn(64, generator=generator) * 3
        prompt = torch.randint(0, 64, (8,), generator=generator).tolist()
        history = torch.randint(0, 64, (5,), generator=generator).tolist()
        params = SamplingParams(temperature=0.7, top_k=20, top_p=0.9, min_p=0.05, repetition_penalty=1.3)
        ids = torch.tensor([prompt + history])
        scores = logits[None].clone()
        for processor in (
            RepetitionPenaltyLogitsProcessor(1.3),
            TemperatureLogitsWarper(0.7),
            TopKLogitsWarper(20),
            TopPLogitsWarper(0.9),
            MinPLogitsWarper(0.05),
        ):
            scores = processor(ids, scores)
        expected = torch.softmax(scores[0], dim=-1)
        torch.testing.assert_close(probs(logits, history, prompt, **vars(params)), expected, msg=f"trial {trial}")


def test_greedy_and_zero_temperature_take_the_penalised_argmax():
    logits = torch.tensor([3.0, 2.9, 0.0])
    assert Sampler(SamplingParams(greedy=True)).sample(logits, []) == 0
    assert Sampler(SamplingParams(temperature=0.0)).sample(logits, []) == 0
    assert Sampler(SamplingParams(temperature=0.0, presence_penalty=1.0)).sample(logits, [0]) == 1
    assert probs(logits, greedy=True).tolist() == [1.0, 0.0, 0.0]


def test_same_seed_same_draws_different_seed_different_draws():
    logits = torch.zeros(1000)

    def draws(seed):
        sampler = Sampler(SamplingParams(seed=seed))
        return [sampler.sample(logits, []) for _ in range(20)]

    assert draws(7) == draws(7)
    assert draws(7) != draws(8)


def test_draw_frequencies_follow_the_distribution():
    sampler = Sampler(SamplingParams(seed=123, top_k=3))
    n = 6000
    counts = torch.bincount(torch.tensor([sampler.sample(LOGITS, []) for _ in range(n)]), minlength=4)
    expected = renormalised([0, 1, 2]) * n
    assert counts[3] == 0
    for i in range(3):
        sigma = math.sqrt(expected[i] * (1 - expected[i] / n))
        assert abs(counts[i] - expected[i]) < 4 * sigma, (counts.tolist(), expected.tolist())


@pytest.mark.parametrize(
    ("params", "message"),
    [
        ({"temperature": -1.0}, "temperature"),
        ({"top_k": -1}, "top_k"),
        ({"top_p": 0.0}, "top_p"),
        ({"top_p": 1.5}, "top_p"),
        ({"min_p": 2.0}, "min_p"),
        ({"repetition_penalty": 0.0}, "repetition_penalty"),
        ({"presence_penalty": math.inf}, "presence_penalty"),
        ({"logit_bias": ((1, 100.5),)}, "logit_bias"),
        ({"logit_bias": ((-1, 1.0),)}, "logit_bias"),
        ({"logit_bias": ((1, math.nan),)}, "logit_bias"),
    ],
)
def test_invalid_params_are_clear_errors(params, message):
    with pytest.raises(NinferError, match=message):
        SamplingParams(**params)


def test_logit_bias_is_added_after_the_penalties_greedy_included():
    biased = apply_penalties(LOGITS, SamplingParams(presence_penalty=1.0, logit_bias=((3, 2.0), (0, -1.0))), history=[3])
    torch.testing.assert_close(biased, LOGITS + torch.tensor([-1.0, 0.0, 0.0, 1.0]))
    assert Sampler(SamplingParams(temperature=0, logit_bias=((3, 100.0),))).sample(LOGITS, []) == 3
    assert Sampler(SamplingParams(temperature=0, logit_bias=((0, -100.0),))).sample(LOGITS, []) == 1
    with pytest.raises(NinferError, match="outside the vocabulary"):
        apply_penalties(LOGITS, SamplingParams(logit_bias=((4, 1.0),)), history=[])


QWEN_CONFIG = {"do_sample": True, "temperature": 0.6, "top_k": 20, "top_p": 0.95, "eos_token_id": [1, 2]}


def test_config_values_fill_what_is_not_given():
    params = sampling_from_config(QWEN_CONFIG, temperature=None, top_p=0.5, seed=3)
    assert params == SamplingParams(temperature=0.6, top_k=20, top_p=0.5, seed=3)
    assert sampling_from_config({}) == SamplingParams()


def test_do_sample_false_means_greedy_unless_a_temperature_is_given():
    config = {**QWEN_CONFIG, "do_sample": False}
    assert sampling_from_config(config).is_greedy
    assert sampling_from_config(config, top_k=5).is_greedy
    assert not sampling_from_config(config, temperature=0.8).is_greedy
    assert not sampling_from_config(QWEN_CONFIG).is_greedy
    assert sampling_from_config(QWEN_CONFIG, greedy=True).is_greedy


def test_config_value_of_the_wrong_type():
    with pytest.raises(NinferError, match="generation_config.json holds a sampling value of the wrong type"):
        sampling_from_config({"top_k": "many"})


def test_top_k_minus_one_means_off_as_zero_does():
    """The one top_k rule of `ninfer generate --top-k` and the server's `top_k`: 0 is off, -1 (vLLM's spelling) too."""
    assert sampling_from_config({}, top_k=-1) == sampling_from_config({}, top_k=0) == SamplingParams(top_k=0)
    assert sampling_from_config({"top_k": -1}).top_k == 0
    with pytest.raises(NinferError, match=r"^top_k must be an integer >= 0 \(0 or -1 disables it\)$"):
        sampling_from_config({}, top_k=-2)
