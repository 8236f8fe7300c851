"""Speculative decoding with the MTP layer (CPU, tiny model, float32): greedy output identical to
plain greedy for K = 1..5, with drafts rejected at every position, at the end of the context, and
with the proposal head drafting; the state after a rejected round equals a run that never saw the
rejected tokens; the acceptance rule samples the target's distribution, also from a proposal
head's q (zero outside its token ids); `auto` speculates where the artifact has MTP."""

from __future__ import annotations

import pytest
import torch
from conftest import GREEDY_PROMPT, PROPOSAL_ROWS

from ninfer_offload import Engine, NinferError
from ninfer_offload.model.backend import ReferenceBackend
from ninfer_offload.model.proposal import ProposalHead
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


def test_greedy_with_penalties_and_mtp_equals_plain_greedy_with_them(spec_engines, tiny_artifact):
    """Penalties make each position's argmax depend on the tokens before it: drafts are checked one by one."""
    penalized = SamplingParams(greedy=True, repetition_penalty=1.5, presence_penalty=0.5)
    plain = Engine.load(tiny_artifact, spec="none")
    want = generate(plain, GREEDY_PROMPT, max_tokens=TOKENS, sampling=penalized).run().token_ids
    plain.close()
    assert generate(spec_engines[3], GREEDY_PROMPT, max_tokens=TOKENS, sampling=penalized).run().token_ids == want


@pytest.mark.parametrize("k", [1, 2, 3, 4, 5])
def test_greedy_with_mtp_equals_greedy_without(spec_engines, reprefill_greedy, k):
    result = generate(spec_engines[k], GREEDY_PROMPT, max_tokens=TOKENS, sampling=GREEDY).run()
    assert result.token_ids == reprefill_greedy
    spec = result.speculation
    assert spec["rounds"] == result.decode_steps and spec["drafted"] <= k * spec["rounds"]
    assert result.decode_tokens == spec["rounds"] + spec["accepted"]


def test_greedy_drafts_picked_on_the_device_equal_argmaxes_read_one_by_one(tiny_artifact):
    """Greedy drafts chained on the device (each MTP step fed the argmax before it there) are the drafts of
    MTP steps fed each argmax through the host, for two sequences drafting together, and leave the MTP caches
    alike."""
    engine = Engine.load(tiny_artifact, spec="mtp", draft_tokens=3, max_sequences=4)
    prompts = [GREEDY_PROMPT, GREEDY_PROMPT[:5]]
    chained = [speculative.MtpSpeculator(engine.session(), Sampler(GREEDY), p, 3) for p in prompts]
    stepped = [speculative.MtpSpeculator(engine.session(), Sampler(GREEDY), p, 3) for p in prompts]
    histories = [[s.prefill()] for s in chained]
    assert histories == [[s.prefill()] for s in stepped]
    drafted = speculative.draft_together(chained, 3, histories)
    for speculator, (drafts, probs) in zip(stepped, drafted):
        want = [int(speculator._draft_logits.argmax())]
        hidden = speculator._draft_hidden
        for _ in range(2):
            logits, hidden = engine.mtp_step([speculator.session], hidden, want[-1:])
            want.append(int(logits[0].argmax()))
        assert drafts == want and probs == [None] * 3
    assert [s.session.mtp_length for s in chained] == [s.session.mtp_length for s in stepped]
    engine.close()


def test_a_device_mtp_step_takes_one_int64_token_per_session(spec_engines):
    engine = spec_engines[1]
    session = engine.session()
    session.prefill(GREEDY_PROMPT)
    hidden = torch.zeros(1, engine.config.hidden_size)
    with pytest.raises(NinferError, match="one int64 token per session"):
        engine.mtp_step_on_device([session], hidden, torch.tensor([3], dtype=torch.int32))
    session.close()


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
        session.append(GREEDY_PROMPT)
    engine.step([spec], [[5, 6, 7, 8]])
    spec.commit(2)
    clean.step(5)
    clean.step(6)
    assert spec.length == clean.length
    assert torch.allclose(spec.step(9), clean.step(9), atol=1e-5)


P_TARGET = torch.tensor([0.05, 0.4, 0.1, 0.25, 0.15, 0.05])


def first_tokens(q: torch.Tensor, trials: int = 20000) -> torch.Tensor:
    """Frequencies of the first token a one-draft round emits: draft from q, verify against P_TARGET."""
    sampler = Sampler(SamplingParams(temperature=1.0, seed=7))
    logits = torch.log(P_TARGET).expand(2, -1)
    gen = torch.Generator().manual_seed(3)
    counts = torch.zeros(len(P_TARGET))
    for _ in range(trials):
        draft = int(torch.multinomial(q, 1, generator=gen))
        accepted, following = speculative.accept_drafts(sampler, logits, [draft], [q], [], [])
        counts[accepted[0] if accepted else following] += 1
    return counts / trials


def test_acceptance_rule_samples_the_target_distribution():
    """Over a 6-token vocabulary: drafts from q, verification against p; the first token a round
    emits is distributed as p (within sampling noise), whatever q is."""
    q = torch.tensor([0.3, 0.05, 0.3, 0.05, 0.2, 0.1])
    assert torch.allclose(first_tokens(q), P_TARGET, atol=0.015)


def test_acceptance_rule_with_a_proposal_head_q():
    """q from a proposal head over 4 of the 6 tokens is zero at the other two, which only the
    residual resampling can emit: the output is still distributed as p."""
    gen = torch.Generator().manual_seed(11)
    head = ProposalHead(torch.randn(4, 8, generator=gen), torch.tensor([4, 1, 3, 0]), len(P_TARGET))
    logits = head.logits(ReferenceBackend(), torch.randn(1, 8, generator=gen))[0]
    q = Sampler(SamplingParams(temperature=1.0)).probabilities(logits, [], [])
    assert q[2] == q[5] == 0 and torch.isclose(q.sum(), torch.tensor(1.0))
    assert torch.allclose(first_tokens(q), P_TARGET, atol=0.015)


@pytest.fixture(scope="module")
def proposal_engines(tiny_artifact_proposal):
    """The proposal artifact decoding plainly, and speculating with 3 drafts from its proposal head."""
    plain = Engine.load(tiny_artifact_proposal, spec="none")
    drafting = Engine.load(tiny_artifact_proposal, spec="mtp", draft_tokens=3, proposal_head=True)
    yield plain, drafting
    plain.close()
    drafting.close()


def test_greedy_with_the_proposal_head_equals_greedy_without(proposal_engines):
    plain, drafting = proposal_engines
    want = generate(plain, GREEDY_PROMPT, max_tokens=TOKENS, sampling=GREEDY).run()
    got = generate(drafting, GREEDY_PROMPT, max_tokens=TOKENS, sampling=GREEDY).run()
    assert got.token_ids == want.token_ids and want.speculation is None
    spec = got.speculation
    assert spec["rounds"] == got.decode_steps and spec["drafted"] == 3 * spec["rounds"] and len(spec["acceptance_at"]) == 3
    assert got.decode_tokens == spec["rounds"] + spec["accepted"]


def test_sampling_with_the_proposal_head_reports_its_drafts(proposal_engines):
    _, drafting = proposal_engines
    result = generate(drafting, GREEDY_PROMPT, max_tokens=TOKENS, sampling=SamplingParams(temperature=1.0, seed=4)).run()
    spec = result.speculation
    assert len(result.token_ids) == TOKENS and spec["drafted"] == 3 * spec["rounds"] > 0
    assert 0 <= spec["accepted"] <= spec["drafted"] and result.decode_tokens == spec["rounds"] + spec["accepted"]


def test_proposal_head_drafts_over_its_token_ids(proposal_engines):
    """Draft logits are finite exactly at the head's token ids and there follow the output head's
    logits of the same ids (the head holds those rows, Q4 where the output head is Q6)."""
    _, drafting = proposal_engines
    hidden = torch.randn(3, drafting.config.hidden_size, generator=torch.Generator().manual_seed(2))
    drafts, full = drafting.draft_logits(hidden), drafting.logits_of(hidden)
    ids = drafting.proposal.token_ids
    assert ids.numel() == PROPOSAL_ROWS
    assert set(torch.isfinite(drafts).nonzero()[:, 1].tolist()) == set(ids.tolist())
    for row in range(3):
        assert torch.corrcoef(torch.stack([drafts[row, ids], full[row, ids]]))[0, 1] > 0.98


def test_bad_spec_options_are_one_line(tiny_artifact, tiny_artifact_proposal):
    with pytest.raises(NinferError, match="spec must be one of auto, none, mtp"):
        Engine.load(tiny_artifact, spec="eagle")
    with pytest.raises(NinferError, match="--spec dflash: drafting with a DFlash model is not supported"):
        Engine.load(tiny_artifact, spec="dflash")
    with pytest.raises(NinferError, match="--draft-tokens"):
        Engine.load(tiny_artifact, spec="mtp", draft_tokens=6)
    with pytest.raises(NinferError, match=r"tiny_bf16.ninfer has no proposal head \(proposal/head, proposal/token_ids\); drop --proposal"):
        Engine.load(tiny_artifact, spec="mtp", proposal_head=True)
    with pytest.raises(NinferError, match="drop --proposal-head or use --spec mtp"):
        Engine.load(tiny_artifact_proposal, spec="none", proposal_head=True)


@pytest.fixture(scope="module")
def no_mtp_artifact(tmp_path_factory):
    from ninfer_offload.convert import convert
    from ninfer_offload.convert.tiny import write_checkpoint

    root = tmp_path_factory.mktemp("no_mtp")
    return convert(write_checkpoint(root / "src", mtp=False), root / "no_mtp.ninfer", recipe="bf16", progress=False)


def test_auto_speculates_where_the_cost_model_projects_it_pays(tiny_artifact, no_mtp_artifact, speculating_card):
    """`auto` speculates where the artifact has MTP weights and the card's projection reaches x1.15, says why it
    did or did not, and its greedy output is the plain one."""
    default = Engine.load(tiny_artifact)  # the Python API decodes plainly unless asked
    assert (default.speculation.mode, default.spec_tokens, default.speculation.reason) == ("none", 0, "")
    plain_ids = generate(default, GREEDY_PROMPT, max_tokens=8, sampling=GREEDY).run().token_ids
    default.close()
    engine = Engine.load(tiny_artifact, spec="auto", profile=str(speculating_card))
    assert (engine.speculation.mode, engine.spec_tokens, engine.proposal) == ("mtp", 3, None) and engine.mtp is not None
    assert engine.speculation.describe() == (
        "3 MTP drafts per step (--spec auto: on, x2.41 projected for speculating_card at 0.72 acceptance (on from x1.15))"
    )
    result = generate(engine, GREEDY_PROMPT, max_tokens=8, sampling=GREEDY).run()
    assert result.token_ids == plain_ids and result.speculation is not None
    engine.close()
    for profile, reason in [
        # the tiny model's step is a few hundred short launches; the draft steps and a round's host work cost more
        ("rtx5090", "off, x0.58 projected for rtx5090 at 0.72 acceptance (on from x1.15)"),
        (None, "off, speculation is projected for a GPU (give --profile, or --spec mtp to force it)"),  # a CPU load
    ]:
        off = Engine.load(tiny_artifact, spec="auto", profile=profile, draft_tokens=2)
        assert (off.speculation.mode, off.spec_tokens, off.state.step_tokens, off.mtp) == ("none", 0, 1, None)
        assert off.speculation.describe() == f"no speculation (--spec auto: {reason})"
        off.close()
    plain = Engine.load(no_mtp_artifact, spec="auto", draft_tokens=4)  # no MTP weights: plain decoding, without rollback room
    assert (plain.speculation.mode, plain.spec_tokens, plain.state.step_tokens, plain.mtp) == ("none", 0, 1, None)
    assert plain.speculation.reason == "no_mtp.ninfer has no MTP weights"
    assert generate(plain, GREEDY_PROMPT, max_tokens=3, sampling=GREEDY).run().speculation is None
    plain.close()
    with pytest.raises(NinferError, match="no_mtp.ninfer has no MTP weights to draft with; use --spec none"):
        Engine.load(no_mtp_artifact, spec="mtp")


def test_the_load_plan_drafts_with_the_proposal_head(tiny_artifact_proposal, small_card):
    """A planned load that drafts with the proposal head keeps it on the device and prices drafting by its bytes."""
    plans = {}
    for proposal_head in (False, True):
        engine = Engine.load(tiny_artifact_proposal, profile=str(small_card), spec="mtp", proposal_head=proposal_head)
        plans[proposal_head] = engine.expert_plan.plan
        engine.close()
    with_head, without = plans[True], plans[False]
    assert with_head.options.proposal_head and not without.options.proposal_head
    assert (with_head.components["proposal"].placement, without.components["proposal"].placement) == ("vram", "unused")
    assert with_head.vram_used_bytes - without.vram_used_bytes == with_head.components["proposal"].bytes
    assert any("drafting with the proposal head" in a for a in with_head.predicted.assumptions)
