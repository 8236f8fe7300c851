"""The hand-off kernels (`kernels.miss_handoff`) against their reference ops (`runtime.miss_handoff`):
the same device ids and weights, the same request in the mailbox, the same answer added; the host
taking only experts used by at most `host_max_uses` pairs of the call; a device that waits for the
host (on CUDA, answered from another thread); a missing answer flagged."""

from __future__ import annotations

import threading
import time

import numpy as np
import pytest
import torch

from kernels_support import DEVICE, INTERPRETED  # noqa: F401  (sets the interpreter up first)
from ninfer_offload.kernels import miss_handoff as kernels
from ninfer_offload.runtime.miss_handoff import DONE, FAILED, HEADER_WORDS, READY, TOKENS, Mailbox, collect_reference, publish_reference

EXPERTS, TOP_K, HIDDEN, ARENA = 16, 4, 96, 4096


def _setup(seed: int, tokens: int, host_share: float = 0.5):
    g = torch.Generator().manual_seed(seed)
    arena = torch.zeros(ARENA, dtype=torch.uint8, device=DEVICE)
    in_vram = torch.rand(EXPERTS, generator=g) > host_share
    # VRAM experts at offsets inside the arena, host ones outside it (either side)
    table = torch.where(in_vram, torch.arange(EXPERTS) * 256, torch.where(torch.arange(EXPERTS) % 2 == 0, -(2**20), 2**30)).to(DEVICE)
    take = (torch.rand(EXPERTS, generator=g) > 0.2).to(torch.int8).to(DEVICE)
    ids = torch.stack([torch.randperm(EXPERTS, generator=g)[:TOP_K] for _ in range(tokens)]).to(DEVICE)
    weights = torch.rand(tokens, TOP_K, generator=g).to(DEVICE)
    x = torch.randn(tokens, HIDDEN, generator=g).to(DEVICE)
    anchor = torch.tensor([int(torch.nonzero(in_vram)[0])], device=DEVICE)
    return arena, table, take, ids, weights, x, anchor


def _publish_both(tokens: int, layer: int = 1, seed: int = 0, host_share: float = 0.5, max_uses: int = 64):
    arena, table, take, ids, weights, x, anchor = _setup(seed, tokens, host_share)
    limit = torch.tensor([max_uses], dtype=torch.int32, device=DEVICE)
    boxes = [Mailbox(3, TOP_K, HIDDEN, torch.device(DEVICE), tokens=8) for _ in range(2)]
    uses = [torch.zeros(EXPERTS, dtype=torch.int32, device=DEVICE) for _ in range(2)]
    header, data = boxes[0].offsets(layer, arena)
    got = kernels.publish(
        x, ids, weights, table, take, limit, anchor, uses[0], boxes[0].state[layer], arena, header, data, boxes[0].regions
    )
    want = publish_reference(boxes[1], layer, x, ids, weights, table, take, limit, anchor, uses[1], arena.numel())
    return got, want, boxes, uses, arena


@pytest.mark.parametrize("tokens", [1, 3, 8])
def test_publish_matches_reference(tokens):
    (got_ids, got_w), (want_ids, want_w), (mine, theirs), uses, _ = _publish_both(tokens)
    assert torch.equal(got_ids, want_ids) and torch.equal(got_w, want_w)
    assert torch.equal(uses[0], uses[1]) and int(uses[0].sum()) > 0
    assert torch.equal(mine.state.cpu(), theirs.state.cpu())
    assert torch.equal(mine.headers, theirs.headers) and mine.flags[HEADER_WORDS + READY] == 1
    for a, b in zip(mine.request(1), theirs.request(1)):
        np.testing.assert_array_equal(a, b)


@pytest.mark.parametrize("max_uses", [0, 1, 2, 3])
def test_the_host_takes_only_experts_few_pairs_use(max_uses):
    """A batch of 8 tokens: the host takes a missing expert of its `take` share only when at most `max_uses` pairs
    of the call use it; kernel and reference agree on which, and the mailbox holds exactly those."""
    tokens = 8
    (got_ids, got_w), (want_ids, want_w), (mine, theirs), uses, _ = _publish_both(tokens, max_uses=max_uses)
    assert torch.equal(got_ids, want_ids) and torch.equal(got_w, want_w) and torch.equal(uses[0], uses[1])
    arena, table, take, ids, _, _, _ = (t.cpu() if isinstance(t, torch.Tensor) else t for t in _setup(0, tokens, 0.5))
    pairs = ids.reshape(-1).numpy()
    count = {e: int((pairs == e).sum()) for e in pairs}
    miss = lambda e: not 0 <= int(table[e]) < arena.numel()  # noqa: E731
    host = {e for e in pairs if miss(e) and take[e] and count[e] <= max_uses}
    assert any(miss(e) and take[e] and count[e] > 1 for e in pairs)  # the batch repeats some missing experts
    assert set(torch.nonzero(uses[0].cpu()).flatten().tolist()) == host
    assert int(uses[0].sum()) == sum(count[e] for e in host)
    if host:
        _, box_ids, _, _ = mine.request(1)
        np.testing.assert_array_equal(box_ids.reshape(-1), [e if e in host else -1 for e in pairs])
        for a, b in zip(mine.request(1), theirs.request(1)):
            np.testing.assert_array_equal(a, b)
    else:
        assert int(mine.state[1, 1]) == 0 and not mine.headers.any()


def test_publish_without_host_work_opens_no_request():
    (got_ids, got_w), (want_ids, _), (mine, _), uses, _ = _publish_both(2, host_share=0.0)
    assert torch.equal(got_ids, want_ids)
    assert int(mine.state[1, 1]) == 0 and not mine.headers.any() and int(uses[0].sum()) == 0


@pytest.mark.parametrize("tokens", [1, 5])
def test_collect_adds_the_answer_like_reference(tokens):
    _, _, (mine, theirs), _, arena = _publish_both(tokens)
    answer = np.random.default_rng(1).standard_normal((tokens, HIDDEN)).astype(np.float32)
    for box in (mine, theirs):
        box.answer(1, tokens)[:] = answer
        box.flags[HEADER_WORDS + DONE] = box.flags[HEADER_WORDS + READY]
    base = torch.randn(tokens, HIDDEN, generator=torch.Generator().manual_seed(2)).to(DEVICE)
    header, data = mine.offsets(1, arena)
    got = kernels.collect(base.clone(), mine.state[1], arena, header, data, mine.regions)
    want = collect_reference(theirs, 1, base.clone())
    assert torch.equal(got, want)
    assert torch.allclose(got.cpu(), base.cpu() + torch.from_numpy(answer))


def test_collect_without_an_answer_flags_the_failure():
    _, _, (mine, _), _, arena = _publish_both(2)
    header, data = mine.offsets(1, arena)
    out = kernels.collect(torch.zeros(2, HIDDEN, device=DEVICE), mine.state[1], arena, header, data, mine.regions, spin_limit=4)
    assert torch.isnan(out).all() and mine.flags[HEADER_WORDS + FAILED] == 1 and mine.failed()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_device_waits_for_a_late_host_answer():
    """On CUDA the mailbox is pinned host memory: `collect` spins until another thread answers."""
    _, _, (mine, _), _, arena = _publish_both(2)
    torch.cuda.synchronize()
    assert mine.flags[HEADER_WORDS + READY] == 1 and mine.flags[HEADER_WORDS + TOKENS] == 2

    def answer_late():
        time.sleep(0.2)
        mine.answer(1, 2)[:] = 1.5
        mine.flags[HEADER_WORDS + DONE] = mine.flags[HEADER_WORDS + READY]

    thread = threading.Thread(target=answer_late)
    thread.start()
    header, data = mine.offsets(1, arena)
    out = kernels.collect(torch.zeros(2, HIDDEN, device=DEVICE), mine.state[1], arena, header, data, mine.regions)
    torch.cuda.synchronize()
    thread.join()
    assert torch.equal(out.cpu(), torch.full((2, HIDDEN), 1.5)) and not mine.failed()
