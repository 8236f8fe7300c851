"""Decode steps over pooled state: a batch of sequences equals each sequence stepped alone, and a
multi-token step rolled back leaves the state of a sequence that never saw the dropped tokens."""

from __future__ import annotations

import pytest
import torch

from ninfer_offload import Engine, NinferError

PROMPT = torch.randint(0, 512, (48,), generator=torch.Generator().manual_seed(11)).tolist()
CONTEXT = 128


@pytest.fixture(scope="module")
def engine(tiny_artifact_official):
    eng = Engine.load(tiny_artifact_official, max_context=CONTEXT, max_sequences=16, draft_tokens=3, mtp=True)
    yield eng
    eng.close()


def _gdn_state(engine: Engine, slot: int) -> list[torch.Tensor]:
    state = engine.state
    return [t[slot].clone() for group in (state.conv, state.recurrent) for t in group.values()]


def _kv_rows(engine: Engine, slot: int, length: int) -> list[torch.Tensor]:
    return [rows[:length].clone() for key in engine.state.kv for rows in engine.state.kv_of(key, slot)]


@pytest.mark.parametrize("batch", [1, 2, 5, 8])
def test_batched_decode_equals_single_sequence_steps(engine, batch):
    """Equal to float32 rounding: CPU kernels (BLAS products, vectorised elementwise ops with scalar
    tails) round a row differently depending on how many rows share the call."""
    lengths = [3 + 5 * i for i in range(batch)]
    batched = [engine.session() for _ in lengths]
    single = [engine.session() for _ in lengths]
    try:
        for b, s, n in zip(batched, single, lengths):
            b.prefill(PROMPT[:n])
            s.prefill(PROMPT[:n])
        tokens = [7 + i for i in range(batch)]
        for _ in range(3):
            out = engine.step_batch(batched, tokens)
            expected = torch.stack([s.step(t) for s, t in zip(single, tokens)])
            assert torch.allclose(out, expected, rtol=0, atol=1e-5 * expected.abs().max().item())
            assert torch.equal(out.argmax(-1), expected.argmax(-1))
            tokens = out.argmax(-1).tolist()
        for b, s in zip(batched, single):
            assert b.length == s.length
            for x, y in zip(
                _gdn_state(engine, b.slot) + _kv_rows(engine, b.slot, b.length),
                _gdn_state(engine, s.slot) + _kv_rows(engine, s.slot, s.length),
            ):
                assert torch.allclose(x, y, rtol=1e-4, atol=1e-5)
    finally:
        for session in batched + single:
            session.close()


@pytest.mark.parametrize("keep", [1, 2, 3, 4])
def test_rollback_leaves_the_state_of_a_sequence_that_never_saw_the_tokens(engine, keep):
    """Two sequences verify different drafts after the same anchor token and keep `keep` shared tokens:
    their state and the next step are identical, and equal (to rounding) a sequence that only ever
    stepped through the kept tokens."""
    anchor_and_drafts = [101, 202, 303, 404]
    other_drafts = anchor_and_drafts[:keep] + [55, 66, 77, 88][keep:]
    a, b, plain = engine.session(), engine.session(), engine.session()
    try:
        for session in (a, b, plain):
            session.prefill(PROMPT[:20])
        verify_a = engine.step([a], [anchor_and_drafts])[0]
        verify_b = engine.step([b], [other_drafts])[0]
        assert a.pending == b.pending == 4 and a.length == 20
        assert torch.equal(verify_a[:keep], verify_b[:keep])  # causal: rows before a difference agree
        a.rollback(4 - keep)
        b.commit(keep)
        for token in anchor_and_drafts[:keep]:
            plain.step(token)
        assert a.length == b.length == plain.length == 20 + keep and a.pending == 0
        assert all(torch.equal(x, y) for x, y in zip(_gdn_state(engine, a.slot), _gdn_state(engine, b.slot)))
        assert all(torch.equal(x, y) for x, y in zip(_kv_rows(engine, a.slot, a.length), _kv_rows(engine, b.slot, b.length)))
        for x, y in zip(_gdn_state(engine, a.slot), _gdn_state(engine, plain.slot)):
            assert torch.allclose(x, y, rtol=1e-4, atol=1e-5)
        next_a, next_b, next_plain = a.step(9), b.step(9), plain.step(9)
        assert torch.equal(next_a, next_b)
        assert torch.allclose(next_a, next_plain, atol=1e-4 * next_plain.abs().max().item())
    finally:
        for session in (a, b, plain):
            session.close()


def test_batched_multi_token_steps_commit_per_sequence(engine):
    """One verify step over three sequences; each keeps a different number of tokens."""
    sessions = [engine.session() for _ in range(3)]
    twins = [engine.session() for _ in range(3)]
    try:
        for i, (s, t) in enumerate(zip(sessions, twins)):
            s.prefill(PROMPT[: 10 + 7 * i])
            t.prefill(PROMPT[: 10 + 7 * i])
        drafts = [[1, 2, 3], [4, 5, 6], [7, 8, 9]]
        out = engine.step(sessions, drafts)
        assert out.shape == (3, 3, engine.config.vocab_size)
        for keep, s, t, row in zip([1, 2, 3], sessions, twins, drafts):
            s.commit(keep)
            assert torch.equal(out[keep - 1], out[keep - 1])
            for token in row[:keep]:
                t.step(token)
        step = engine.step_batch(sessions, [11, 12, 13])
        expected = torch.stack([t.step(tok) for t, tok in zip(twins, [11, 12, 13])])
        assert torch.allclose(step, expected, atol=1e-4 * expected.abs().max().item())
    finally:
        for session in sessions + twins:
            session.close()


def test_batched_prefill_equals_each_prompt_prefilled_alone(engine):
    """Three sequences (one fresh, two already holding tokens) take 21, 9 and 14 tokens in one forward, each padded
    to 24: each one's logits, KV rows and GDN state are those of its own prefill (the padding leaves no trace),
    and decoding on from there agrees."""
    starts, counts = [0, 9, 25], [21, 9, 14]
    batched = [engine.session() for _ in starts]
    single = [engine.session() for _ in starts]
    try:
        for b, s, n in zip(batched, single, starts):
            if n:
                b.prefill(PROMPT[:n])
                s.prefill(PROMPT[:n])
        rows = [PROMPT[n : n + count] for n, count in zip(starts, counts)]
        logits = engine.prefill_batch(batched, rows, 24)
        assert logits.shape == (3, engine.config.vocab_size)
        for i, (b, s, row) in enumerate(zip(batched, single, rows)):
            expected = s.prefill(row)
            assert b.length == s.length
            assert torch.allclose(logits[i], expected, atol=1e-4 * expected.abs().max().item())
            for got, want in zip(_gdn_state(engine, b.slot) + _kv_rows(engine, b.slot, b.length),
                                 _gdn_state(engine, s.slot) + _kv_rows(engine, s.slot, s.length)):
                assert torch.allclose(got, want, atol=1e-4 * max(1.0, want.abs().max().item()))
        step = engine.step_batch(batched, [5, 6, 7])
        expected = torch.stack([s.step(tok) for s, tok in zip(single, [5, 6, 7])])
        assert torch.allclose(step, expected, atol=1e-4 * expected.abs().max().item())
        with pytest.raises(NinferError, match="adds 1 to 2 tokens"):
            engine.prefill_batch(batched[:2], [[1, 2], []])
        with pytest.raises(NinferError, match="adds 1 to 1 tokens"):
            engine.prefill_batch(batched[:2], [[1, 2], [3]], 1)
        with pytest.raises(NinferError, match="same session twice"):
            engine.prefill_batch([batched[0], batched[0]], [[1], [2]])
    finally:
        for session in batched + single:
            session.close()


def test_pending_steps_and_slots_are_one_line_errors(engine, tiny_artifact_official):
    session = engine.session()
    try:
        session.prefill(PROMPT[:5])
        with pytest.raises(NinferError, match="no step is pending"):
            session.commit(1)
        engine.step([session], [[1, 2, 3]])
        with pytest.raises(NinferError, match="pending 3-token step"):
            session.step(4)
        with pytest.raises(NinferError, match="commit takes 1..3"):
            session.commit(4)
        with pytest.raises(NinferError, match="rollback takes 0..2"):
            session.rollback(3)
        session.rollback(0)
        assert session.length == 8
        with pytest.raises(NinferError, match="1..4"):
            engine.step([session], [[1, 2, 3, 4, 5]])
        with pytest.raises(NinferError, match="same number of tokens"):
            engine.step([session, engine.session()], [[1], [2, 3]])
    finally:
        session.close()
    single = Engine.load(tiny_artifact_official, max_context=32, spec="none")
    first = single.session()
    with pytest.raises(NinferError, match="all 1 sequence slots are in use"):
        single.session()
    with pytest.raises(NinferError, match=r"1\.\.1"):
        single.step([first], [[1, 2]])
    first.close()
    single.session().prefill([1, 2, 3])  # the slot is free again


def test_a_dropped_session_frees_its_slot(tiny_artifact_official):
    engine = Engine.load(tiny_artifact_official, max_context=32)
    for _ in range(3):
        engine.session().prefill([1, 2, 3])  # never closed: garbage collection gives the slot back
    assert engine.logits([4, 5]).shape[0] == 2


def test_fp8_kv_cache_stays_close_to_the_full_precision_cache(tiny_artifact_official, engine):
    fp8 = Engine.load(tiny_artifact_official, max_context=CONTEXT, kv_dtype="fp8")
    assert all(k.dtype == v.dtype == torch.float8_e4m3fn for k, v in fp8.state.kv.values())
    got, expected = fp8.logits(PROMPT[:24]), engine.logits(PROMPT[:24])
    assert float((got - expected).norm() / expected.norm()) < 0.1  # e4m3 keeps 3 mantissa bits
    with pytest.raises(NinferError, match="unsupported KV dtype"):
        Engine.load(tiny_artifact_official, kv_dtype="int4")
