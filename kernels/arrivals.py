"""Arrival counts: zeroed int32 counters on a device for kernels whose last program to arrive finishes the
launch's work (a sum, a top-k) and zeroes its counter again, so a CUDA graph may replay the launch. Each
owner has its own counters; one owner's launches run one after another on the compute stream."""

from __future__ import annotations

import torch

_COUNTS: dict[tuple[str, torch.device], torch.Tensor] = {}


def arrival_counts(owner: str, size: int, device: torch.device) -> torch.Tensor:
    """`owner`'s `size` counters on `device` (allocated zeroed on first use)."""
    key = (owner, torch.device(device))
    if key not in _COUNTS:
        _COUNTS[key] = torch.zeros(size, dtype=torch.int32, device=device)
    return _COUNTS[key]
