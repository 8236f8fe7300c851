"""A batched step's misses split between the link and the host (`runtime.batch_split`, the hand-off's
`host_max_uses`): the host takes the missing experts few rows of the step use, the device reads the others,
and each sequence still gets its solo output and the resident logits (tiny model, float32 on the CPU);
the limit `auto` picks from the cost model's rates."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from ninfer_offload import Engine
from ninfer_offload.runtime.batch_split import MissRates, host_max_uses, uses_pmf

PROMPTS = [torch.randint(0, 512, (n,), generator=torch.Generator().manual_seed(n)).tolist() for n in (6, 11, 17)]
STEPS = 4


@pytest.fixture(scope="module")
def engine(tiny_artifact_official):
    eng = Engine.load(tiny_artifact_official, experts="host", num_slots=4, miss_path="cpu", max_sequences=len(PROMPTS), spec="none")
    yield eng
    eng.close()


@pytest.fixture(scope="module")
def resident(tiny_artifact_official):
    eng = Engine.load(tiny_artifact_official, max_sequences=len(PROMPTS), spec="none")
    yield eng
    eng.close()


def assert_close(got: torch.Tensor, want: torch.Tensor) -> None:
    assert torch.allclose(got, want, rtol=0, atol=1e-5 * max(1.0, want.abs().max().item()))
    assert torch.equal(got.argmax(-1), want.argmax(-1))


def _counts(engine: Engine) -> dict:
    stats = engine.store.stats
    return {"uses": stats.uses, "hits": stats.hits, "cpu": stats.cpu_assignments, "pcie": stats.pcie_bytes}


def _batch(engine: Engine, limits: list[int], check=None) -> list[torch.Tensor]:
    """Greedy steps of PROMPTS together, `host_max_uses` = limits[i] at step i; `check(before, after)` per step."""
    sessions = [engine.session() for _ in PROMPTS]
    try:
        out = [torch.stack([s.prefill(p) for s, p in zip(sessions, PROMPTS)])]
        for limit in limits:
            engine.store.cpu_path.set_host_max_uses(limit)
            before = _counts(engine), engine.store.cache.in_vram.copy(), engine.store.uses.clone()
            out.append(engine.step_batch(sessions, out[-1].argmax(-1).tolist()))
            if check is not None:
                check(before, (_counts(engine), engine.store.uses.clone()))
        return out
    finally:
        for session in sessions:
            session.close()


def test_a_split_batch_gives_each_sequence_its_solo_output(engine):
    """Experts used by one row go to the host, the others over the link; each row is what its sequence gives alone."""
    split = []
    batched = _batch(engine, [1] * STEPS, lambda before, after: split.append((after[0]["cpu"] - before[0]["cpu"],
                                                                             after[0]["pcie"] - before[0]["pcie"])))
    assert all(cpu > 0 for cpu, _ in split) and any(pcie > 0 for _, pcie in split)  # both paths served the batch
    for i, prompt in enumerate(PROMPTS):
        session = engine.session()
        try:
            solo = [session.prefill(prompt)]
            for _ in range(STEPS):
                solo.append(session.step(int(solo[-1].argmax())))
        finally:
            session.close()
        for got, want in zip(batched, solo):
            assert_close(got[i], want)


def test_every_miss_of_a_batch_can_go_to_the_host(engine, resident):
    """The CPU path's default: every missing expert of a batch, however many rows use it, computed on the host."""
    steps = []
    got = _batch(engine, [engine.store.cpu_path.tokens] * STEPS, lambda before, after: steps.append((before[0], after[0])))
    for before, after in steps:
        misses = (after["uses"] - before["uses"]) - (after["hits"] - before["hits"])
        assert misses > 0 and after["cpu"] - before["cpu"] == misses and after["pcie"] == before["pcie"]
    for g, w in zip(got, _batch_resident(resident, len(got) - 1)):
        assert_close(g, w)
    assert engine.store.stats.to_json()["cpu_assignments_per_step"] > 0


def test_the_limit_changes_between_steps_of_one_run(engine, resident):
    """host_max_uses set before each step of one batched run: the host computes exactly the missing experts' assignments
    of experts at most that many rows use (none at 0), and the logits stay the resident ones."""
    limits = [0, 1, 2, 3, 1, 0]
    taken = []

    def check(before, after):
        (counts, in_vram, uses), (counts_after, uses_after) = before, after
        step_uses = (uses_after - uses).numpy()
        expected = np.where(~in_vram & (step_uses <= limits[len(taken)]), step_uses, 0).sum()
        taken.append(counts_after["cpu"] - counts["cpu"])
        assert taken[-1] == expected

    got = _batch(engine, limits, check)
    assert taken[0] == taken[-1] == 0 and taken[1] > 0 and taken[3] >= taken[2] >= taken[1]
    for g, w in zip(got, _batch_resident(resident, len(limits))):
        assert_close(g, w)


def _batch_resident(resident: Engine, steps: int) -> list[torch.Tensor]:
    sessions = [resident.session() for _ in PROMPTS]
    try:
        out = [torch.stack([s.prefill(p) for s, p in zip(sessions, PROMPTS)])]
        for _ in range(steps):
            out.append(resident.step_batch(sessions, out[-1].argmax(-1).tolist()))
        return out
    finally:
        for session in sessions:
            session.close()


RATES = MissRates(link_bps=20e9, cpu_bps=20e9, request_s=0.0)


def test_uses_of_an_expert_follow_its_picks_per_token():
    pmf = uses_pmf(np.array([0.0, 0.1, 0.5, 1.0]), 8)
    assert np.allclose(pmf.sum(axis=0), 1.0)
    assert np.allclose((np.arange(9)[:, None] * pmf).sum(axis=0), 8 * np.array([0.0, 0.1, 0.5, 1.0]))


def test_the_limit_balances_the_host_against_the_link():
    """32 missing experts of one layer, each picked by a quarter of the tokens: one row needs no limit; in a batch a
    faster host takes experts more rows use, never past the batch; no share or a host much slower than the link
    leaves the host the experts one row uses (m = 1: whether the host takes any is the share's call)."""
    expected, missing, nbytes = np.full((1, 32), 0.25), np.ones((1, 32), dtype=bool), np.array([1e6])
    limit = lambda rates, rows=8, share=1.0: host_max_uses(rates, rows, share, expected, missing, nbytes)  # noqa: E731
    assert limit(RATES, rows=1) == 1 and limit(RATES, share=0.0) == 1
    by_cpu = [limit(MissRates(20e9, cpu, 0.0)) for cpu in (1e9, 60e9, 200e9, 1e13)]
    assert by_cpu == sorted(by_cpu) and by_cpu[0] == 1 and 1 < by_cpu[1] < by_cpu[2] < 8
    assert by_cpu[-1] >= 6  # a host far faster than the link: all but experts nearly every row uses (P < 0.001)
    assert limit(MissRates(20e9, 60e9, 1.0)) == 1  # a hand-off dearer than any split: as little host work as the share allows
    assert host_max_uses(RATES, 8, 1.0, expected, np.zeros((1, 32), dtype=bool), nbytes) == 1  # nothing missing


def test_auto_sets_the_limit_for_each_steps_size(tiny_artifact_official, resident):
    """"auto" sets host_max_uses before each step from its rows and share (one row: 1), and the logits stay exact."""
    engine = Engine.load(tiny_artifact_official, experts="host", num_slots=4, miss_path="auto", max_sequences=len(PROMPTS), spec="none")
    try:
        path, store = engine.store.cpu_path, engine.store
        path.tuner.warmup = 1000  # the trials never start: share 1 (all) throughout
        nbytes = np.array([layout.nbytes for layout in store.layouts], dtype=np.float64)
        limits = []

        def check(before, _after):
            in_vram = before[1]
            limits.append(path.stats()["host_max_uses"])
            assert limits[-1] == host_max_uses(path.rates, len(PROMPTS), 1.0, store.placement.scores, ~in_vram, nbytes)

        got = _batch(engine, [path.tokens] * 2, check)  # (`_batch` sets a limit; the step's own replaces it)
        for g, w in zip(got, _batch_resident(resident, 2)):
            assert_close(g, w)
        assert all(1 <= limit <= len(PROMPTS) for limit in limits)
        session = engine.session()
        session.prefill(PROMPTS[0])
        session.step(3)
        assert path.stats()["host_max_uses"] == 1
        session.close()
    finally:
        engine.close()
