"""The prompt cache (`runtime.prefix_cache`) on the tiny model, float32 on the CPU: a request that resumes a saved
prefix gives exactly the tokens of a cold run (one that neither reads nor saves the cache), greedy and seeded, with
and without MTP speculation, for single, multi-turn, branching and concurrent requests; a prompt that leaves a saved
node inside its tokens resumes from the node before; pieces moved to the host tier and back, and evictions under
small bounds, keep outputs exact, and a match stays valid when its pieces are evicted before they are restored."""

from __future__ import annotations

import random

import pytest
import torch

from ninfer_offload.errors import NinferError
from ninfer_offload.runtime.decoder import Decoder, End, GenerationRequest, Token
from ninfer_offload.runtime.engine import Engine
from ninfer_offload.runtime.sampling import SamplingParams

EVERY = 16  # tokens between saved positions (the full-size default is 2048)
PLAIN = pytest.mark.parametrize("engine", ["none"], indirect=True)  # what MTP does not change runs once
SAMPLINGS = {"greedy": SamplingParams(greedy=True), "seeded": SamplingParams(temperature=0.9, top_p=0.9, seed=7)}


@pytest.fixture(scope="module", params=["none", "mtp"])
def engine(request, tiny_artifact):
    loaded = Engine.load(
        tiny_artifact, device="cpu", max_sequences=4, spec=request.param, prefill_chunk=16, prompt_cache=True,
        prompt_cache_every=EVERY,
    )
    yield loaded
    loaded.close()


def ids(seed: int, n: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(3, 500) for _ in range(n)]


def run(engine: Engine, requests: list[GenerationRequest]) -> list[list[int]]:
    """The tokens of each request, all decoded together in one loop."""
    decoder = Decoder(engine)
    sequences = [decoder.add(r) for r in requests]
    tokens: dict[int, list[int]] = {id(s): [] for s in sequences}
    ended = set()
    while len(ended) < len(sequences):
        for event in decoder.step():
            if isinstance(event, Token):
                tokens[id(event.sequence)].append(event.token)
            elif isinstance(event, End):
                assert event.reason in ("stop", "length"), event.error
                ended.add(id(event.sequence))
    return [tokens[id(s)] for s in sequences]


def request(prompt: list[int], sampling: str = "greedy", cache: bool = True, max_tokens: int = 6) -> GenerationRequest:
    return GenerationRequest(prompt, max_tokens, SAMPLINGS[sampling], cache_prompt=cache)


def cold(engine: Engine, prompt: list[int], sampling: str = "greedy", max_tokens: int = 6) -> list[int]:
    return run(engine, [request(prompt, sampling, cache=False, max_tokens=max_tokens)])[0]


def cached_tokens(engine: Engine, prompt: list[int], sampling: str = "greedy") -> tuple[list[int], int]:
    decoder = Decoder(engine)
    sequence = decoder.add(request(prompt, sampling))
    out = []
    while not sequence.ended:
        out += [e.token for e in decoder.step() if isinstance(e, Token)]
    return out, sequence.cached_tokens


@pytest.mark.parametrize("sampling", SAMPLINGS)
def test_multi_turn_chat_resumes_and_matches_cold_runs(engine, sampling):
    """Each turn's prompt is the last prompt, the reply and a new message: it resumes the saved end of the last
    sequence and gives the cold run's tokens."""
    history = ids(1, 13)
    for turn in range(3):
        out, resumed = cached_tokens(engine, history, sampling)
        assert out == cold(engine, history, sampling)
        # the new message re-read, and the reply's last token unless a verify step fed it (an accepted draft)
        assert resumed in ((len(history) - 5, len(history) - 4) if turn else (0,))
        history = history + out + ids(100 + turn, 4)


def test_branching_conversations_share_their_prefix_and_diverge(engine):
    """Two conversations on one 20-token system prompt: the second parts from the first inside its last saved piece
    (16 to its end) and resumes at 16, saving where they part; a third resumes there."""
    system = ids(2, 20)
    first, second, third = system + ids(3, 5), system + ids(4, 4), system + ids(5, 6)
    out1, resumed1 = cached_tokens(engine, first)
    out2, resumed2 = cached_tokens(engine, second)
    out3, resumed3 = cached_tokens(engine, third)
    assert (out1, out2, out3) == (cold(engine, first), cold(engine, second), cold(engine, third))
    assert (resumed1, resumed2, resumed3) == (0, 16, 20)


def test_concurrent_requests_on_a_shared_prefix_match_cold_runs(engine):
    system = ids(6, 20)
    prompts = [system + ids(10 + i, 2 + 3 * i) for i in range(3)]
    cached_tokens(engine, system + ids(9, 2))
    together = run(engine, [request(p) for p in prompts])
    assert together == [cold(engine, p) for p in prompts]


@PLAIN
def test_a_prefix_diverging_inside_a_saved_piece_resumes_from_the_piece_before(engine):
    prompt = ids(7, 36)
    cached_tokens(engine, prompt)
    diverged = prompt[:24] + [(prompt[24] + 1) % 500] + prompt[25:]
    match = engine.prompt_cache.match(diverged, with_mtp=bool(engine.spec_tokens))
    assert match.tokens == 16 and match.branch == 24
    out, resumed = cached_tokens(engine, diverged)
    assert resumed == 16 and out == cold(engine, diverged)


@PLAIN
def test_opting_out_neither_reads_nor_saves(engine):
    prompt = ids(8, 10)
    before = engine.prompt_cache.stats()
    run(engine, [request(prompt, cache=False)])
    after = engine.prompt_cache.stats()
    assert (after["lookups"], after["saves"]) == (before["lookups"], before["saves"])


def test_host_tier_and_eviction_keep_outputs_exact(tiny_artifact):
    """Under a device bound of one piece, pieces move to the host tier and come back on a hit; under a host bound of
    a few, the least recently used are dropped; every output stays the cold run's and the bounds hold."""
    engine = Engine.load(tiny_artifact, device="cpu", max_sequences=2, prefill_chunk=16, prompt_cache=True, prompt_cache_every=EVERY)
    try:
        cache = engine.prompt_cache
        system = ids(11, 20)
        cached_tokens(engine, system + [7])
        piece = sum(cache.memory()) // cache.stats()["entries"]  # the GDN state dominates: pieces are alike in size
        cache.resize(piece + 1, 6 * piece)
        for turn in range(4):
            prompt = system + ids(20 + turn, 3 + turn)
            out, resumed = cached_tokens(engine, prompt)
            assert out == cold(engine, prompt)
            device, host = cache.memory()
            assert device <= cache.device_bytes and host <= cache.host_bytes
            assert resumed >= 16
        stats = cache.stats()
        assert stats["demoted"] and stats["promoted"] and stats["evicted"]
    finally:
        engine.close()


def test_a_match_whose_pieces_are_evicted_before_the_restore_is_still_exact(engine):
    cache = engine.prompt_cache
    prompt = ids(12, 20)
    cached_tokens(engine, prompt[:-3])
    match = cache.match(prompt)
    assert match.tokens == 17
    limits = cache.device_bytes, cache.host_bytes
    cache.resize(0, 0)  # every piece dropped, the match's included
    assert cache.stats()["entries"] == 0
    cache.resize(*limits)
    session = engine.session()
    try:
        session.resume(match)
        logits = session.prefill(prompt[17:])
    finally:
        session.close()
    torch.testing.assert_close(logits, engine.logits(prompt)[-1], rtol=0, atol=1e-4)


@PLAIN
def test_resume_and_remember_check_their_session(engine):
    session = engine.session()
    try:
        session.prefill(ids(13, 5))
        with pytest.raises(NinferError, match="before anything else"):
            session.resume(engine.prompt_cache.match(ids(13, 9)))
        with pytest.raises(NinferError, match="holds 5 tokens"):
            session.remember(ids(13, 4))
    finally:
        session.close()


@pytest.mark.parametrize("engine", ["mtp"], indirect=True)
def test_positions_saved_without_mtp_rows_gain_them_from_a_speculating_sequence(engine):
    """A request with logprobs decodes plainly and saves no MTP rows, so a speculating request cannot resume there; it
    saves the first position it could not enter again, with them, and the next speculating request resumes there."""
    prompt = ids(14, 20)
    run(engine, [GenerationRequest(prompt, 3, SAMPLINGS["greedy"], logprobs=0)])
    resumed = [cached_tokens(engine, prompt + ids(15 + i, 3 + i))[1] for i in range(2)]
    longer = prompt + ids(17, 6)
    out, last = cached_tokens(engine, longer)
    assert resumed + [last] == [0, 16, 20] and out == cold(engine, longer)


def test_the_host_tier_of_an_unplanned_load_fits_the_host(tiny_artifact, small_card):
    """Asked for by size, the host tier is that size; left to its default, an unplanned load's is at most half the host
    memory available once loaded, a planned load's the plan's."""
    from ninfer_offload.planner.options import PROMPT_CACHE_HOST
    from ninfer_offload.runtime.memory_check import available_host_bytes

    asked = Engine.load(tiny_artifact, prompt_cache=True, prompt_cache_host=3 << 20)
    assert asked.prompt_cache.stats()["host_limit"] == 3 << 20
    asked.close()
    default = Engine.load(tiny_artifact, prompt_cache=True)
    assert default.prompt_cache.stats()["host_limit"] <= min(PROMPT_CACHE_HOST, available_host_bytes() // 2 + (64 << 20))
    default.close()
    planned = Engine.load(tiny_artifact, prompt_cache=True, profile=str(small_card))
    assert planned.prompt_cache.stats()["host_limit"] == planned.expert_plan.plan.prompt_cache_host_bytes > 0
    planned.close()
