"""Speculative decoding with the MTP layer (CPU, tiny model, float32): greedy output identical to
plain greedy for K = 1..5, with drafts rejected at every position, at the end of the context; the
state after a rejected round equals a run that never saw the rejected tokens; the acceptance rule
samples the target's distribution."""

from __future__ import annotations

import pytest
import torch
from conftest import GREEDY_PROMPT

from ninfer_offload import Engine, NinferError
from ninfer_offload.runtime import speculative
from ninfer_offload.runtime.generate import generate
from ninfer_offload.runtime.sampling import Sampler, SamplingParams

GREEDY = SamplingParams(greedy=True)
TOKENS = 16


@pytest.fixture(scope="module")
def spec_engines(tiny_artifact):
    engines = {k: Engine.load(tiny_artifact, spec="mtp", draft_tokens=k) for k in range(1, 6)}
    yield engines
    for engine in engines.values():
        engine.close()


@pytest.mark.parametrize("k", [1, 2, 3, 4, 5])
def test_greedy_with_mtp_equals_greedy_without(spec_engines, reprefill_greedy, k):
    result = generate(spec_engines[k], GREEDY_PROMPT, max_tokens=TOKENS, sampling=GREEDY).run()
    assert result.token_ids == reprefill_greedy
    spec = result.speculation
    assert spec["rounds"] == result.decode_steps and spec["drafted"] <= k * spec["rounds"]
    assert result.decode_tokens == spec["rounds"] + spec["accepted"]


@pytest.mark.parametrize("wrong_at", [0, 1, 2, None])
def test_forced_drafts_rejected_at_every_position(spec_engines, reprefill_greedy, monkeypatch, wrong_at):
    """Drafts are the true greedy continuation with one wrong token at `wrong_at` (None: all right):
    the round keeps exactly the drafts before it, and the output stays the plain greedy one."""
    engine = spec_engines[3]
    expected = reprefill_greedy
    rounds: list[int] = []

    def oracle_drafts(self, k, history):
        self._mtp_start = self.session.mtp_length  # no MTP drafting: nothing to drop after the round
        start = len(history)  # the drafts follow the anchor, history[-1]
        drafts = list(expected[start : start + k]) + [0] * max(0, start + k - len(expected))
        if wrong_at is not None and wrong_at < k:
            drafts[wrong_at] = (drafts[wrong_at] + 1) % engine.config.vocab_size
        vocab = engine.config.vocab_size
        return drafts, [torch.nn.functional.one_hot(torch.tensor(d), vocab).float() for d in drafts]

    original = speculative.MtpSpeculator.round

    def counting_round(self, anchor, history):
        before = self.stats.accepted
        out = original(self, anchor, history)
        rounds.append(self.stats.accepted - before)
        return out

    monkeypatch.setattr(speculative.MtpSpeculator, "draft", oracle_drafts)
    monkeypatch.setattr(speculative.MtpSpeculator, "round", counting_round)
    result = generate(engine, GREEDY_PROMPT, max_tokens=TOKENS, sampling=GREEDY).run()
    assert result.token_ids == expected
    full_rounds = rounds[:-1]  # the last round may run past max_tokens
    assert all(n == (3 if wrong_at is None else wrong_at) for n in full_rounds)


def test_end_of_context(tiny_artifact, reprefill_greedy):
    capacity = len(GREEDY_PROMPT) + 7
    plain = Engine.load(tiny_artifact, max_context=capacity)
    spec = Engine.load(tiny_artifact, max_context=capacity, spec="mtp", draft_tokens=5)
    want = generate(plain, GREEDY_PROMPT, max_tokens=TOKENS, sampling=GREEDY).run()
    got = generate(spec, GREEDY_PROMPT, max_tokens=TOKENS, sampling=GREEDY).run()
    assert got.token_ids == want.token_ids == reprefill_greedy[: len(want.token_ids)]
    assert got.finish_reason == want.finish_reason == "length"


def test_state_after_a_rejected_round_is_a_clean_run(tiny_artifact):
    """Verify anchor + 3 drafts, keep only 2 tokens: the next step's logits are those of a session
    that only ever saw the kept tokens (KV rows and GDN states of the rejected ones are gone)."""
    engine = Engine.load(tiny_artifact, spec="mtp", draft_tokens=3, max_sequences=2)
    spec, clean = engine.session(), engine.session()
    for session in (spec, clean):
        session.forward(GREEDY_PROMPT)
    engine.step([spec], [[5, 6, 7, 8]])
    spec.commit(2)
    clean.step(5)
    clean.step(6)
    assert spec.length == clean.length
    assert torch.allclose(spec.step(9), clean.step(9), atol=1e-5)


def test_acceptance_rule_samples_the_target_distribution():
    """Over a 6-token vocabulary: drafts from q, verification against p; the first token a round
    emits is distributed as p (within sampling noise), whatever q is."""
    p = torch.tensor([0.05, 0.4, 0.1, 0.25, 0.15, 0.05])
    q = torch.tensor([0.3, 0.05, 0.3, 0.05, 0.2, 0.1])
    sampler = Sampler(SamplingParams(temperature=1.0, seed=7))
    logits = torch.log(p).expand(2, -1)
    gen = torch.Generator().manual_seed(3)
    counts = torch.zeros(6)
    trials = 20000
    for _ in range(trials):
        draft = int(torch.multinomial(q, 1, generator=gen))
        accepted, following = speculative.accept_drafts(sampler, logits, [draft], [q], [], [])
        counts[accepted[0] if accepted else following] += 1
    assert torch.allclose(counts / trials, p, atol=0.015)


def test_bad_spec_options_are_one_line(tiny_artifact):
    with pytest.raises(NinferError, match="spec must be one of none, mtp"):
        Engine.load(tiny_artifact, spec="dflash")
    with pytest.raises(NinferError, match="--draft-tokens"):
        Engine.load(tiny_artifact, spec="mtp", draft_tokens=6)
