"""Engine API: host-resident experts == resident, CPU miss path, batched decode over sequences of
different lengths, MTP shapes and one-shot vs step-by-step consistency, one-line errors."""

from __future__ import annotations

import pytest
import torch

from ninfer_offload import Engine, NinferError
from ninfer_offload.artifact.dims import ModelDims

PROMPT = torch.randint(0, 512, (40,), generator=torch.Generator().manual_seed(7)).tolist()


@pytest.fixture(scope="module")
def engine(tiny_artifact):
    eng = Engine.load(tiny_artifact, mtp=True, max_sequences=8, draft_tokens=3)  # multi-token MTP steps of up to 4
    yield eng
    eng.close()


@pytest.mark.parametrize("recipe", ["bf16", "official"])
def test_host_experts_give_exactly_the_resident_logits(recipe, request):
    path = request.getfixturevalue("tiny_artifact" if recipe == "bf16" else "tiny_artifact_official")
    resident = Engine.load(path, max_sequences=2, spec="none")
    host = Engine.load(path, experts="host", num_slots=3, max_sequences=2, spec="none")  # fewer slots than a prompt's distinct experts
    assert resident.store.host == [] and len(host.store.host) == host.config.num_layers
    expected = resident.logits(PROMPT)
    assert torch.equal(host.logits(PROMPT), expected)
    sessions = [host.session(), resident.session()]
    for session in sessions:
        session.prefill(PROMPT[:30])
    for token in PROMPT[30:]:
        assert torch.equal(*[session.step(token) for session in sessions])
    stats = host.store.stats
    misses = stats.uses - stats.hits
    assert misses > 0 and stats.hits > 0 and stats.promotions > 0
    sizes = [layout.nbytes for layout in host.store.layouts]
    assert misses * min(sizes) <= stats.pcie_bytes <= misses * max(sizes)
    assert resident.store.stats.uses == 0  # nothing to learn when every expert is in VRAM


def test_cpu_miss_path_matches_resident(tiny_artifact_official):
    resident = Engine.load(tiny_artifact_official)
    cpu = Engine.load(tiny_artifact_official, experts="host", num_slots=2, miss_path="cpu")
    expected = resident.logits(PROMPT)
    got = cpu.logits(PROMPT)
    assert torch.allclose(got, expected, atol=1e-5 * max(1.0, expected.abs().max().item()))
    assert cpu.store.stats.cpu_assignments > 0


def test_step_batch_equals_single_steps(engine):
    lengths = [5, 17, 40]
    batched = [engine.session() for _ in lengths]
    single = [engine.session() for _ in lengths]
    for b, s, n in zip(batched, single, lengths):
        b.prefill(PROMPT[:n])
        s.prefill(PROMPT[:n])
    tokens = [11, 22, 33]
    for _ in range(3):
        out = engine.step_batch(batched, tokens)
        expected = torch.stack([s.step(t) for s, t in zip(single, tokens)])
        assert out.shape == (3, engine.config.vocab_size)
        assert torch.allclose(out, expected, atol=1e-5 * max(1.0, expected.abs().max().item()))
        assert torch.equal(out.argmax(-1), expected.argmax(-1))
        tokens = out.argmax(-1).tolist()
    assert [b.length for b in batched] == [n + 3 for n in lengths]


def test_long_prefill_runs_in_chunks(engine, tiny_artifact):
    expected = engine.logits(PROMPT)
    chunked_engine = Engine.load(tiny_artifact, prefill_chunk=16)
    chunked = chunked_engine.logits(PROMPT)
    assert torch.allclose(chunked, expected, atol=1e-5 * max(1.0, expected.abs().max().item()))
    assert torch.allclose(chunked_engine.session().prefill(PROMPT), expected[-1], atol=1e-5 * max(1.0, expected.abs().max().item()))
    chunked_engine.close()


def test_mtp_one_shot_equals_step_by_step(engine):
    target = engine.session()
    _, hidden = target.append(PROMPT)
    assert hidden.shape == (len(PROMPT), engine.config.hidden_size)
    one_shot = engine.session()
    logits, mtp_hidden = one_shot.mtp(hidden[:-1], PROMPT[1:])
    assert logits.shape == (len(PROMPT) - 1, engine.config.vocab_size)
    assert mtp_hidden.shape == (len(PROMPT) - 1, engine.config.hidden_size)
    stepwise = engine.session()
    for i in range(len(PROMPT) - 1):
        step_logits, step_hidden = stepwise.mtp(hidden[i : i + 1], [PROMPT[i + 1]])
        assert torch.allclose(step_logits[0], logits[i], atol=1e-4)
        assert torch.allclose(step_hidden[0], mtp_hidden[i], atol=1e-5)
    # a further draft feeds the drafted token and the MTP hidden state back
    draft = int(logits[-1].argmax())
    more, _ = one_shot.mtp(mtp_hidden[-1:], [draft])
    assert more.shape == (1, engine.config.vocab_size) and one_shot.mtp_length == len(PROMPT)
    assert target.length == len(PROMPT)
    # a prompt's MTP prefill asks for its last position's draft logits only (a chunk's all would take GiBs)
    last_only = engine.session()
    last, last_hidden = last_only.mtp(hidden[:-1], PROMPT[1:], all_logits=False)
    assert last.shape == (1, engine.config.vocab_size) and torch.allclose(last[0], logits[-1], atol=1e-5)
    assert torch.equal(last_hidden, mtp_hidden)


def test_batched_mtp_step_equals_each_sessions_own(engine):
    """Two sequences of different lengths draft one MTP position together: the logits and hidden states
    each would get alone."""
    _, hidden = engine.session().append(PROMPT)
    short, long = engine.session(), engine.session()
    short.mtp(hidden[:9], PROMPT[1:10])
    long.mtp(hidden[:29], PROMPT[1:30])
    alone = [engine.session(), engine.session()]
    alone[0].mtp(hidden[:9], PROMPT[1:10])
    alone[1].mtp(hidden[:29], PROMPT[1:30])
    rows = torch.stack([hidden[9], hidden[29]])
    logits, out = engine.mtp_step([short, long], rows, [PROMPT[10], PROMPT[30]])
    for i, session in enumerate(alone):
        own_logits, own_out = session.mtp(rows[i : i + 1], [PROMPT[10 + 20 * i]])
        assert torch.allclose(logits[i], own_logits[0], atol=1e-4)
        assert torch.allclose(out[i], own_out[0], atol=1e-5)
    assert (short.mtp_length, long.mtp_length) == (10, 30)


def test_an_mtp_step_of_several_positions_equals_the_prompt_style_forward(engine):
    """Following a verified round (T positions as one MTP decode step) gives what the chunked MTP
    forward of the same positions gives, and leaves the MTP cache as long."""
    _, hidden = engine.session().append(PROMPT)
    chunked, stepped = engine.session(), engine.session()
    chunked.mtp(hidden[:9], PROMPT[1:10])
    stepped.mtp(hidden[:9], PROMPT[1:10])
    want, want_out = chunked.mtp(hidden[9:13], PROMPT[10:14])
    got, got_out = engine.mtp_step([stepped], hidden[9:13], PROMPT[10:14], 4)
    assert torch.allclose(got, want, atol=1e-4) and torch.allclose(got_out, want_out, atol=1e-5)
    assert stepped.mtp_length == chunked.mtp_length == 13
    with pytest.raises(NinferError, match="MTP step needs"):
        engine.mtp_step([stepped], hidden[:2], PROMPT[:3], 3)


def test_prompt_longer_than_context_is_one_line_error(tiny_artifact):
    small = Engine.load(tiny_artifact, max_context=16)
    with pytest.raises(NinferError, match="context limit of 16") as err:
        small.logits(PROMPT)
    assert "\n" not in str(err.value)
    session = small.session()
    session.prefill(PROMPT[:16])
    with pytest.raises(NinferError, match="context limit"):
        session.step(1)


def test_bad_requests_are_one_line_errors(engine, tiny_artifact):
    with pytest.raises(NinferError, match="outside the vocabulary"):
        engine.logits([0, engine.config.vocab_size])
    with pytest.raises(NinferError, match="no tokens"):
        engine.logits([])
    session = engine.session()
    session.close()
    with pytest.raises(NinferError, match="closed"):
        session.step(1)
    with pytest.raises(NinferError, match="experts must be"):
        Engine.load(tiny_artifact, experts="disk")
    with pytest.raises(NinferError, match="miss path needs"):
        Engine.load(tiny_artifact, miss_path="cpu")
    with pytest.raises(NinferError, match="max context"):
        Engine.load(tiny_artifact, max_context=10**9)
    with pytest.raises(NinferError, match="--prefill-chunk must be >= 1"):
        Engine.load(tiny_artifact, prefill_chunk=0)
    with pytest.raises(NinferError, match="no such artifact"):
        Engine.load(tiny_artifact.parent / "missing.ninfer")


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message of a machine without CUDA")
def test_cuda_without_gpu_is_one_line_error(tiny_artifact):
    with pytest.raises(NinferError, match="no CUDA GPU") as err:
        Engine.load(tiny_artifact, device="cuda")
    assert "\n" not in str(err.value)


def test_config_rejects_unsupported_models(engine):
    config = dict(engine.artifact.components["text"].config)
    assert ModelDims.from_text_config(config) == engine.config
    with pytest.raises(NinferError, match="unsupported architecture"):
        ModelDims.from_text_config({**config, "architectures": ["LlamaForCausalLM"]})
    missing = {k: v for k, v in config.items() if k != "num_experts"}
    with pytest.raises(NinferError, match="'num_experts'"):
        ModelDims.from_text_config(missing)

