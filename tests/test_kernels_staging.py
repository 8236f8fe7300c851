"""The staging gather (`gather_records`) against its reference op: the listed host records land in their
slots, byte for byte, and nothing else in the arena changes."""

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
    before = arenas[0].cpu().view(6, SLOT)
    table = torch.tensor([host[e].data_ptr() - arenas[0].data_ptr() for e in range(EXPERTS)], device=DEVICE)
    experts = torch.tensor([7, 2, 0], device=DEVICE)
    slots = torch.tensor([0, 1, 4], device=DEVICE) * SLOT
    gather_records(arenas[0], table, experts, slots, nbytes, programs)
    gather_records_reference(arenas[1], host.to(DEVICE) if DEVICE.type == "cuda" else host, experts, slots, nbytes)
    assert torch.equal(arenas[0], arenas[1])
    assert torch.equal(arenas[0][SLOT : SLOT + nbytes].cpu(), host[2])
    after = arenas[0].cpu().view(6, SLOT)
    assert torch.equal(after[[2, 3, 5]], before[[2, 3, 5]]) and torch.equal(after[1, nbytes:], before[1, nbytes:])  # nothing else


