"""A load's peak VRAM against its plan: torch's peak allocated bytes plus the CUDA context (the driver's share of the
card before anything was allocated), as the plan promises to bound it."""

from __future__ import annotations

import torch

_CONTEXT: int | None = None


def context_bytes() -> int:
    """VRAM the process holds besides torch's allocator: the CUDA context and the libraries' workspaces, measured once
    (card in use minus torch's reserved pool; other processes on the card count too, so run alone)."""
    global _CONTEXT
    if _CONTEXT is None:
        free, total = torch.cuda.mem_get_info()
        _CONTEXT = total - free - torch.cuda.memory_reserved()
    return _CONTEXT


def start() -> None:
    """Begin a load's VRAM window (before `Engine.load`)."""
    context_bytes()
    torch.cuda.reset_peak_memory_stats()


def against_plan(planned: int | None) -> dict:
    """The window's peak (`start` to now) against the plan's VRAM use."""
    peak = torch.cuda.max_memory_allocated() + context_bytes()
    return {
        "peak_vram_bytes": peak, "cuda_context_bytes": context_bytes(), "planned_vram_bytes": planned,
        "peak_within_plan": None if planned is None else peak <= planned,
    }
