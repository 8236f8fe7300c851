"""Arrival counts for kernels whose last program to finish a shared result takes the step after it.

Each program writes its part, then adds one to a count here (acquire-release, device scope); the
program that finds every other one already counted reads the parts (through L2: other programs
wrote them) and finishes, then sets the count back to zero. Every launch leaves its counts zeroed,
so a captured step may replay it, and the step after needs no launch of its own. Each kernel family
has its own buffer, so two of them never share a count.
"""

from __future__ import annotations

import torch

# Counts per buffer: the most row slices x tokens one launch counts.
ARRIVAL_COUNTS = 4096
_BUFFERS: dict[tuple[torch.device, str], torch.Tensor] = {}


def arrival_counts(device: torch.device, family: str) -> torch.Tensor:
    """The int32 counts [ARRIVAL_COUNTS] (zero between launches) of kernel `family` on `device`."""
    key = (torch.device(device), family)
    if key not in _BUFFERS:
        _BUFFERS[key] = torch.zeros(ARRIVAL_COUNTS, dtype=torch.int32, device=device)
    return _BUFFERS[key]
