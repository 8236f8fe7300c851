"""Arrival counts: zeroed int32 counters on a device for kernels whose last program to arrive finishes the
launch's work (a sum over the programs' partial rows) and zeroes its counter again, so a CUDA graph may
replay the launch. Each owner has its own counters; one owner's launches run one after another on the
compute stream."""

from __future__ import annotations

import torch

ARRIVAL_COUNTS = 4096  # counters per owner: one per output slice of a launch

_COUNTS: dict[tuple[str, torch.device], torch.Tensor] = {}


def arrival_counts(owner: str, device: torch.device) -> torch.Tensor:
    """`owner`'s ARRIVAL_COUNTS counters on `device` (allocated zeroed on first use)."""
    key = (owner, torch.device(device))
    if key not in _COUNTS:
        _COUNTS[key] = torch.zeros(ARRIVAL_COUNTS, dtype=torch.int32, device=device)
    return _COUNTS[key]
