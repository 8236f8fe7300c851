"""The engine thread on the real tiny engine: chunked prefill interleaved with batched decode,
outputs equal to solo greedy generation, cancellation freeing state, failures isolated, queue limit."""

from __future__ import annotations

import asyncio

import pytest
import torch

from ninfer_offload.runtime.engine import Engine
from ninfer_offload.runtime.generate import generate
from ninfer_offload.runtime.sampling import SamplingParams
from ninfer_offload.runtime.decoder import GenerationRequest
from ninfer_offload.serve.scheduler import QueueFullError, Scheduler, ShuttingDownError

GREEDY = SamplingParams(greedy=True)


class RecordingSession:
    def __init__(self, owner: RecordingEngine, inner, tag: int) -> None:
        self.owner, self.inner, self.tag = owner, inner, tag

    def __getattr__(self, name: str):
        return getattr(self.inner, name)  # everything else is the real session's

    def prefill(self, token_ids):
        self.owner.calls.append(("prefill", self.tag, len(token_ids)))
        return self.inner.prefill(token_ids)

    def close(self) -> None:
        self.owner.open_sessions -= 1
        self.inner.close()


class RecordingEngine:
    """The real engine; records every forward and counts the sessions not yet closed."""

    def __init__(self, engine) -> None:
        self.engine = engine
        self.calls: list[tuple] = []
        self.open_sessions = 0
        self.created = 0

    def __getattr__(self, name: str):
        return getattr(self.engine, name)  # everything else is the real engine's

    def session(self) -> RecordingSession:
        self.open_sessions += 1
        self.created += 1
        return RecordingSession(self, self.engine.session(), self.created)

    def prefill_batch(self, sessions, token_ids, tokens_per_sequence=None):
        self.calls.append(("together", tuple(s.tag for s in sessions), tuple(map(len, token_ids)), tokens_per_sequence))
        return self.engine.prefill_batch([s.inner for s in sessions], token_ids, tokens_per_sequence)

    def step_batch(self, sessions, token_ids):
        self.calls.append(("decode", tuple(s.tag for s in sessions)))
        return self.engine.step_batch([s.inner for s in sessions], token_ids)

    def step_on_device(self, sessions, tokens):
        self.calls.append(("decode", tuple(s.tag for s in sessions)))
        self.calls.append(("on device", tuple(s.tag for s in sessions)))
        return self.engine.step_on_device([s.inner for s in sessions], tokens)


@pytest.fixture(scope="module")
def engine(tiny_artifact):
    """Plain decoding: `RecordingEngine` records its one-token steps."""
    return Engine.load(tiny_artifact, device="cpu", max_sequences=8, spec="none")


async def collect(handle) -> list[int]:
    return [token async for token in handle.tokens()]


def solo(engine, prompt: list[int], max_tokens: int) -> list[int]:
    return list(generate(engine, prompt, max_tokens, GREEDY))


def burst(engine, prompts: list[list[int]], max_tokens: int) -> list[list[int]]:
    """Greedy outputs of `prompts` all submitted before the scheduler starts (all waiting at its first admission)."""

    async def run() -> list[list[int]]:
        scheduler = Scheduler(engine, max_concurrency=len(prompts), max_queue=len(prompts))
        loop = asyncio.get_running_loop()
        handles = [scheduler.submit(GenerationRequest(p, max_tokens, GREEDY), loop) for p in prompts]
        scheduler.start()
        outputs = await asyncio.gather(*(collect(h) for h in handles))
        scheduler.stop()
        return outputs

    return asyncio.run(run())


def test_prefill_chunks_interleave_with_decode_and_outputs_match_solo(engine):
    recording = RecordingEngine(engine)
    short = [11, 12, 13]
    long = [(7 * i) % 500 + 5 for i in range(40)]

    async def run() -> tuple[list[int], list[int], int]:
        scheduler = Scheduler(recording, max_concurrency=2, max_queue=4, prefill_chunk=8)
        scheduler.start()
        loop = asyncio.get_running_loop()
        first = scheduler.submit(GenerationRequest(short, 24, GREEDY), loop)
        tokens = first.tokens()
        head = [await anext(tokens)]  # the first sequence is decoding now
        marker = len(recording.calls)
        second = scheduler.submit(GenerationRequest(long, 4, GREEDY), loop)
        rest, other = await asyncio.gather(collect_rest(tokens), collect(second))
        scheduler.stop()
        return head + rest, other, marker

    async def collect_rest(tokens) -> list[int]:
        return [token async for token in tokens]

    first_out, second_out, marker = asyncio.run(run())
    assert first_out == solo(engine, short, 24)
    assert second_out == solo(engine, long, 4)
    calls = recording.calls[marker:]
    chunks = [i for i, call in enumerate(calls) if call[0] == "prefill" and call[1] == 2]
    assert [calls[i][2] for i in chunks] == [8, 8, 8, 8, 8]
    for before, after in zip(chunks, chunks[1:]):  # the first sequence kept decoding between chunks
        assert any(call[0] == "decode" and 1 in call[1] for call in calls[before:after])
    assert ("decode", (1, 2)) in calls  # then both decoded in one batched forward
    assert recording.open_sessions == 0


def test_newcomers_short_prompts_are_prefilled_together_and_outputs_match_solo(engine):
    """Five requests arrive at once: up to 64 tokens of each prompt (the largest warmed-up piece: the longest has 80),
    each padded to 64, go through one forward; the 16 tokens left of the longest are prefilled alone; every output
    is the solo one."""
    recording = RecordingEngine(engine)
    prompts = [[(13 * i + 7 * j) % 500 + 1 for j in range(n)] for i, n in enumerate((20, 24, 20, 80, 33))]
    assert burst(recording, prompts, 6) == [solo(engine, p, 6) for p in prompts]
    prefills = [call for call in recording.calls if call[0] in ("together", "prefill")]
    assert prefills == [("together", (1, 2, 3, 4, 5), (20, 24, 20, 64, 33), 64), ("prefill", 4, 16)]
    assert recording.open_sessions == 0


def test_newcomers_prompts_under_a_piece_are_prefilled_alone(engine):
    """Five requests arrive at once, four with prompts shorter than the smallest batched piece (they replay a captured
    prefill alone, which costs less than one eager batched forward): nothing is prefilled together."""
    recording = RecordingEngine(engine)
    prompts = [[(11 * i + 5 * j) % 500 + 1 for j in range(n)] for i, n in enumerate((5, 15, 3, 40, 9))]
    assert burst(recording, prompts, 4) == [solo(engine, p, 4) for p in prompts]
    prefills = [call for call in recording.calls if call[0] in ("together", "prefill")]
    assert sorted(prefills) == [("prefill", i + 1, n) for i, n in enumerate((5, 15, 3, 40, 9))]


def test_greedy_steps_run_ahead_of_the_host_and_mixed_batches_wait_for_it(engine):
    """Greedy sequences decode one step ahead of the host on the tokens the device picked; one ending on a stop
    id or its budget loses only the step queued after it. A sampled sequence joining them makes the steps wait
    for the host's tokens. Every output is the solo one, every session is closed."""
    recording = RecordingEngine(engine)
    sampled = SamplingParams(temperature=0.9, top_p=0.9, seed=5)
    prompts = [[11, 12, 13], [21, 22], [42, 7, 300, 5]]
    stop = solo(engine, prompts[1], 12)[5]  # the second sequence ends on its sixth token

    async def run():
        scheduler = Scheduler(recording, max_concurrency=3, max_queue=4)
        scheduler.start()
        loop = asyncio.get_running_loop()
        first = scheduler.submit(GenerationRequest(prompts[0], 16, GREEDY), loop)
        tokens = first.tokens()
        head = [await anext(tokens), await anext(tokens)]
        second = scheduler.submit(GenerationRequest(prompts[1], 12, GREEDY, stop_ids=frozenset({stop})), loop)
        rest, out_second = await asyncio.gather(collect_rest(tokens), collect(second))
        greedy_only = list(recording.calls)
        third = scheduler.submit(GenerationRequest(prompts[2], 8, sampled), loop)
        fourth = scheduler.submit(GenerationRequest(prompts[0], 8, GREEDY), loop)
        outputs = await asyncio.gather(collect(third), collect(fourth))
        scheduler.stop()
        return head + rest, second, out_second, outputs, greedy_only, recording.calls[len(greedy_only):]

    async def collect_rest(tokens) -> list[int]:
        return [token async for token in tokens]

    out_first, second, out_second, (out_third, out_fourth), greedy_only, mixed = asyncio.run(run())
    assert out_first == solo(engine, prompts[0], 16)
    expected_second = solo(engine, prompts[1], 12)
    assert out_second == expected_second[: expected_second.index(stop)] and second.finished.reason == "stop"
    assert out_third == list(generate(engine, prompts[2], 8, sampled)) and out_fourth == solo(engine, prompts[0], 8)
    assert ("on device", (1, 2)) in greedy_only  # both greedy sequences in one step on device-picked tokens
    steps = [sum(tag in call[1] for call in greedy_only if call[0] == "decode") for tag in (1, 2)]
    assert steps == [15, 6]  # the first's 15 steps; the second's 5, and one thrown away after its stop id
    assert any(call[0] == "decode" and 3 in call[1] for call in mixed)
    assert not any(call[0] == "on device" and 3 in call[1] for call in mixed)  # the sampled one waits for the host
    assert recording.open_sessions == 0


def test_cancel_frees_the_session_and_failures_stay_isolated(engine):
    recording = RecordingEngine(engine)

    async def run():
        scheduler = Scheduler(recording, max_concurrency=4, max_queue=4)
        scheduler.start()
        loop = asyncio.get_running_loop()
        long = scheduler.submit(GenerationRequest([5, 6, 7], 10_000, GREEDY), loop)
        tokens = long.tokens()
        await anext(tokens)
        await anext(tokens)
        bad = scheduler.submit(GenerationRequest([5, 100_000], 3, GREEDY), loop)  # id outside the vocabulary
        assert await collect(bad) == []
        long.cancel()
        leftover = [token async for token in tokens]
        good = scheduler.submit(GenerationRequest([5, 6, 7], 3, GREEDY), loop)
        good_out = await collect(good)
        stats = scheduler.stats()
        scheduler.stop()
        return long, leftover, bad, good, good_out, stats

    long, leftover, bad, good, good_out, stats = asyncio.run(run())
    assert long.finished.reason == "cancelled" and len(leftover) < 10_000
    assert bad.finished.reason == "error" and "outside the vocabulary" in bad.finished.error
    assert good.finished.reason == "length" and good_out == solo(engine, [5, 6, 7], 3)
    assert stats["active"] == 0 and recording.open_sessions == 0


def test_queue_limit_and_stop_cancels_waiting(engine):
    async def run():
        scheduler = Scheduler(engine, max_concurrency=1, max_queue=2)  # not started: nothing is admitted
        loop = asyncio.get_running_loop()
        waiting = [scheduler.submit(GenerationRequest([5], 2, GREEDY), loop) for _ in range(3)]  # one slot + two queued
        with pytest.raises(QueueFullError):
            scheduler.submit(GenerationRequest([5], 2, GREEDY), loop)
        assert scheduler.stats()["waiting"] == 3
        no_queue = Scheduler(engine, max_concurrency=1, max_queue=0)  # only what a free slot takes
        no_queue.submit(GenerationRequest([5], 2, GREEDY), loop)
        with pytest.raises(QueueFullError):
            no_queue.submit(GenerationRequest([5], 2, GREEDY), loop)
        scheduler.start()
        scheduler.stop()
        outputs = [await collect(h) for h in waiting]
        with pytest.raises(ShuttingDownError, match="shutting down"):
            scheduler.submit(GenerationRequest([5], 2, GREEDY), loop)
        return waiting, outputs

    waiting, outputs = asyncio.run(run())
    assert all(h.finished.reason in ("shutdown", "length") for h in waiting)
    assert all(len(out) <= 2 for out in outputs)


def test_speculative_sequences_decode_together_and_match_solo(tiny_artifact, engine):
    """With an engine loaded for MTP speculation, concurrent sequences of different lengths (chunked
    prompts, one batched verify step per round, each sequence keeping its own accepted drafts) give
    the solo greedy outputs; a request with logprobs decodes plainly next to them."""
    spec_engine = Engine.load(tiny_artifact, spec="mtp", draft_tokens=3, max_sequences=3)
    prompts = [[11, 12, 13], [(7 * i) % 500 + 5 for i in range(30)], [42, 7, 300, 5]]

    async def run():
        scheduler = Scheduler(spec_engine, max_concurrency=3, max_queue=4, prefill_chunk=8)
        scheduler.start()
        loop = asyncio.get_running_loop()
        handles = [scheduler.submit(GenerationRequest(p, 20, GREEDY), loop) for p in prompts[:2]]
        handles.append(scheduler.submit(GenerationRequest(prompts[2], 20, GREEDY, logprobs=0), loop))
        outputs = await asyncio.gather(*(collect(h) for h in handles))
        scheduler.stop()
        return handles, outputs

    handles, outputs = asyncio.run(run())
    for prompt, output in zip(prompts, outputs):
        assert output == solo(engine, prompt, 20)
    assert handles[0].finished.speculation["rounds"] > 0 and handles[2].finished.speculation is None
    assert len(handles[2].logprobs) == 20
    spec_engine.close()


def test_batched_verification_keeps_each_sequences_own_accepted_drafts(tiny_artifact, engine, monkeypatch):
    """Drafts forced to the true continuation with the first wrong token at position 0, 1 and 2 for the
    three sequences: one batched verify step keeps 0, 1 and 2 drafts of them, and every output is still
    the solo greedy one."""
    from ninfer_offload.runtime import speculative
    from ninfer_offload.runtime import decoder as decoder_module

    prompts = [[11, 12, 13], [21, 22], [42, 7, 300, 5]]
    expected = {tuple(p): solo(engine, p, 20) for p in prompts}
    wrong_at = {tuple(p): i for i, p in enumerate(prompts)}
    accepted: dict[tuple, list[int]] = {tuple(p): [] for p in prompts}

    def oracle_draft(self, k, history):
        self._mtp_start = self.session.mtp_length
        truth = expected[tuple(self.prompt)]
        drafts = (truth[len(history) : len(history) + k] + [0] * k)[:k]
        at = wrong_at[tuple(self.prompt)]
        if at < k:
            drafts[at] = (drafts[at] + 1) % 512
        return drafts, [torch.nn.functional.one_hot(torch.tensor(d), 512).float() for d in drafts]

    def oracle_together(speculators, k, histories):
        return [oracle_draft(s, k, h) for s, h in zip(speculators, histories)]

    settle = speculative.MtpSpeculator.settle

    def recording_settle(self, logits, hidden, drafts, probs, history):
        out = settle(self, logits, hidden, drafts, probs, history)
        accepted[tuple(self.prompt)].append(len(out) - 1)
        return out

    monkeypatch.setattr(decoder_module, "draft_together", oracle_together)
    monkeypatch.setattr(speculative.MtpSpeculator, "settle", recording_settle)
    spec_engine = Engine.load(tiny_artifact, spec="mtp", draft_tokens=3, max_sequences=3)

    async def run():
        scheduler = Scheduler(spec_engine, max_concurrency=3, max_queue=4)
        scheduler.start()
        loop = asyncio.get_running_loop()
        handles = [scheduler.submit(GenerationRequest(p, 20, GREEDY), loop) for p in prompts]
        outputs = await asyncio.gather(*(collect(h) for h in handles))
        scheduler.stop()
        return outputs

    for prompt, output in zip(prompts, asyncio.run(run())):
        assert output == expected[tuple(prompt)]
        assert set(accepted[tuple(prompt)][:-1]) == {wrong_at[tuple(prompt)]}  # the last round may run past max_tokens
    spec_engine.close()
