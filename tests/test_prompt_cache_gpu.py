"""The prompt cache on CUDA: cached requests give the cold run's greedy and seeded tokens on the tiny model (plain and
MTP, the host tier pinned and its copies back asynchronous, a match evicted before its restore); on the synthetic
full-size artifact (`bench/make_synthetic.py`, at $NINFER_SYNTHETIC or /tmp/q36.ninfer), resident and at 15 GiB, a
resumed state's next-token logits are those of a cold prefill within bf16 rounding.
Skipped without CUDA (and the full-size part without the artifact)."""

from __future__ import annotations

import os
import random
from pathlib import Path

import pytest
import torch
from test_prompt_cache import cached_tokens, cold

from ninfer_offload.runtime.engine import Engine

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]
SYNTHETIC = Path(os.environ.get("NINFER_SYNTHETIC", "/tmp/q36.ninfer"))


def random_ids(seed: int, n: int, vocab: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(3, vocab - 1) for _ in range(n)]


def last_logits(engine: Engine, prompt: list[int], match=None) -> torch.Tensor:
    """The last token's logits of `prompt` in a fresh session: resuming `match` and prefilling the rest, or cold."""
    session = engine.session()
    try:
        if match is not None:
            session.resume(match)
        return session.prefill(prompt[match.tokens if match is not None else 0 :])
    finally:
        session.close()


def chat_matches_cold_runs(engine: Engine, first: int, new: int, turns: int, sampling: str = "greedy") -> list[int]:
    """Resumed tokens of each turn of a chat whose every turn gives the cold run's tokens."""
    vocab = engine.config.vocab_size
    history, resumed = random_ids(1, first, vocab), []
    for turn in range(turns):
        out, cached = cached_tokens(engine, history, sampling)
        assert out == cold(engine, history, sampling), f"turn {turn}"
        resumed.append(cached)
        history = history + out + random_ids(10 + turn, new, vocab)
    return resumed


@pytest.mark.parametrize("spec", ["none", "mtp"])
def test_tiny_model_on_cuda_resumes_exactly(tiny_artifact, spec):
    engine = Engine.load(tiny_artifact, device="cuda", max_sequences=2, spec=spec, prompt_cache=True, prompt_cache_every=16)
    try:
        engine.warm_up()
        for sampling in ("greedy", "seeded"):
            assert all(chat_matches_cold_runs(engine, 40, 6, 3, sampling)[1:])
    finally:
        engine.close()


def test_tiny_model_on_cuda_host_tier_and_evicted_match(tiny_artifact):
    """Under a device bound of about one piece the pieces live in pinned host memory and come back asynchronously;
    a match whose pieces are all dropped before its restore still restores them exactly."""
    engine = Engine.load(tiny_artifact, device="cuda", max_sequences=2, prompt_cache=True, prompt_cache_every=16)
    try:
        cache = engine.prompt_cache
        chat_matches_cold_runs(engine, 40, 6, 1)
        piece = sum(cache.memory()) // cache.stats()["entries"]
        cache.resize(piece, 8 * piece)
        chat_matches_cold_runs(engine, 40, 6, 3)
        assert cache.stats()["demoted"] and cache.stats()["promoted"]
        prompt = random_ids(3, 50, engine.config.vocab_size)
        cached_tokens(engine, prompt[:-4])
        match = cache.match(prompt)
        cache.resize(0, 0)
        assert int(last_logits(engine, prompt, match).argmax()) == int(engine.logits(prompt)[-1].argmax())
    finally:
        engine.close()


# bf16 prefills in other pieces round differently (a resumed prefix was prefilled in the pieces of the request that
# saved it), so on the full-size artifact, whose random weights leave many near-ties among 248K logits, the resumed
# state is checked by its next-token logits against a cold prefill of the whole history: within this relative L2
# distance (a stale or misplaced state misses by the order of the logits themselves).
RESUMED_LOGITS_RTOL = 0.05


@pytest.mark.skipif(not SYNTHETIC.is_file(), reason=f"no synthetic full-size artifact at {SYNTHETIC}")
@pytest.mark.parametrize("placement", [{"experts": "resident"}, {"vram_budget": "15GiB", "profile": "auto"}], ids=["resident", "15GiB"])
def test_synthetic_full_size_artifact_resumes_within_rounding(placement):
    engine = Engine.load(SYNTHETIC, device="cuda", max_sequences=1, prompt_cache=True, prompt_cache_every=1024, **placement)
    try:
        engine.warm_up()
        vocab = engine.config.vocab_size
        history = random_ids(1, 3000, vocab)
        for turn in range(3):
            out, resumed = cached_tokens(engine, history)
            assert (resumed == 0) if turn == 0 else (resumed >= 3000)
            history = history + out + random_ids(10 + turn, 150, vocab)
            match = engine.prompt_cache.match(history)
            assert match.tokens >= len(history) - 150 - len(out)
            got, want = last_logits(engine, history, match), last_logits(engine, history)
            distance = float((got - want).norm() / want.norm())
            assert distance <= RESUMED_LOGITS_RTOL, f"turn {turn}: resumed logits {distance:.3g} from the cold run's"
    finally:
        engine.close()
