"""Arrival counts: zeroed int32 counters on a device for kernels whose last program to arrive finishes the
launch's work (a sum over the programs' partial rows) and zeroes its counter again, so a CUDA graph may
replay the launch. Each owner has its own counters; one owner's launches run one after another on the
compute stream. In a kernel: `last_to_arrive` after a program's rows are stored, `rearm` by the last.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

ARRIVAL_COUNTS = 4096  # counters per owner: one per output slice of a launch

_COUNTS: dict[tuple[str, torch.device], torch.Tensor] = {}


def arrival_counts(owner: str, device: torch.device) -> torch.Tensor:
    """`owner`'s ARRIVAL_COUNTS counters on `device` (allocated zeroed on first use)."""
    key = (owner, torch.device(device))
    if key not in _COUNTS:
        _COUNTS[key] = torch.zeros(ARRIVAL_COUNTS, dtype=torch.int32, device=device)
    return _COUNTS[key]


@triton.jit
def last_to_arrive(count, programs):
    """Whether this program is the last of `programs` to arrive at `count` (after every thread's stores: what
    the programs wrote before it is then visible through L2, loads with cache_modifier=".cg")."""
    tl.debug_barrier()
    return tl.atomic_add(count, 1, sem="acq_rel", scope="gpu") == programs - 1


@triton.jit
def rearm(count):
    """Zero `count` again for the next launch (by the last program to arrive)."""
    tl.atomic_xchg(count, 0, sem="relaxed", scope="gpu")
