"""The staging kernels against their reference ops: the choice of staged experts (`choose_staged`), and the
gather (`gather_records`): the chosen host records land in their slots, byte for byte, and nothing else
in the arena changes."""

from __future__ import annotations

import pytest
import torch

from kernels_support import DEVICE  # noqa: F401  (sets the interpreter up first)
from ninfer_offload.kernels.staging import gather_records
from ninfer_offload.runtime.prefill_staging import gather_records_reference

EXPERTS, SLOT = 12, 2048


@pytest.mark.parametrize("programs", [1, 5])  # one walks every (record, block) pair; several share them
@pytest.mark.parametrize("nbytes", [1536, 1283])  # whole 8-byte words, and not
def test_gather_matches_reference(nbytes, programs):
    g = torch.Generator().manual_seed(nbytes)
    host = torch.randint(0, 256, (EXPERTS, nbytes), dtype=torch.uint8, generator=g)
    if DEVICE.type == "cuda":
        host = host.pin_memory()
    arenas = [torch.randint(0, 256, (6 * SLOT,), dtype=torch.uint8, generator=g).to(DEVICE) for _ in range(2)]
    arenas[1].copy_(arenas[0])
    table = torch.tensor([host[e].data_ptr() - arenas[0].data_ptr() for e in range(EXPERTS)], device=DEVICE)
    experts = torch.tensor([7, 2, 11, 0], device=DEVICE)
    slots = torch.tensor([0, 1, 3, 4], device=DEVICE) * SLOT
    valid = torch.tensor([True, True, False, True], device=DEVICE)
    gather_records(arenas[0], table, experts, slots, valid, nbytes, programs)
    gather_records_reference(arenas[1], host.to(DEVICE) if DEVICE.type == "cuda" else host, experts, slots, valid, nbytes)
    assert torch.equal(arenas[0], arenas[1])
    assert torch.equal(arenas[0][SLOT : SLOT + nbytes].cpu(), host[2])
    assert not torch.equal(arenas[0][3 * SLOT : 3 * SLOT + nbytes].cpu(), host[11])  # not valid: not copied


# fewer slots than missing experts, enough, counts of experts and ids that are not powers of two, the full model's shape
@pytest.mark.parametrize("experts, tokens, slots", [(8, 40, 3), (8, 40, 8), (12, 300, 5), (256, 1100, 128)])
def test_choose_staged_matches_reference(experts, tokens, slots):
    """The one-program choice of staged experts gives the reference op's table copy, staged mask, per-slot
    lists, counters and whether a used expert outside VRAM was left, on routing with many tied counts."""
    from ninfer_offload.kernels.staging import choose_staged
    from ninfer_offload.runtime.prefill_staging import StagingChoice, choose_staged_reference

    g = torch.Generator().manual_seed(experts + tokens)
    top_k = 4 if experts < 256 else 8
    ids = torch.stack([torch.randperm(experts, generator=g)[:top_k] for _ in range(tokens)]).to(DEVICE)
    arena_bytes = 1 << 20
    inside = torch.rand(experts, generator=g) < 0.4  # in VRAM: offsets inside the arena, the others outside (host)
    table = torch.where(inside, torch.randint(0, arena_bytes // 256, (experts,), generator=g) * 256, -(torch.arange(experts) + 1) * 4096)
    table = table.to(DEVICE)
    offsets = (arena_bytes + torch.arange(slots) * 512).to(DEVICE)  # the slots, past the arena for this test
    # uses, staged uses, staged records
    mine = [torch.randint(0, 3, (experts,), generator=g, dtype=torch.int32).to(DEVICE) for _ in range(3)]
    theirs = [c.clone() for c in mine]
    got = StagingChoice(*choose_staged(ids, table, arena_bytes, offsets, *mine))
    want = choose_staged_reference(ids, table, arena_bytes, offsets, *theirs)
    for name, a, b in zip(StagingChoice._fields, got, want):
        assert torch.equal(a.cpu(), b.cpu()), name
    for a, b in zip(mine, theirs):
        assert torch.equal(a, b)
    assert int(want.valid.sum()) == min(slots, int((~inside & (torch.bincount(ids.cpu().reshape(-1), minlength=experts) > 0)).sum()))
