"""Kernel launches at a pipeline depth that fits the device's shared memory.

A Triton kernel launched with `num_stages` software-pipeline stages keeps that many tiles of its loads in
shared memory. Tiles and depths are tuned on the H200, which gives a block 227 KB of shared memory; the
consumer Blackwell cards of the profiles (sm_120: RTX 5090, RTX 5060 Ti, RTX PRO 6000) give it 99 KB, where
the attention decode kernel's three stages of bf16 K/V tiles (138 KB) and the MoE prefill tiles over host
records (up to 130 KB) cannot load (`bench/kernel_resources.py`). `launch` tries the tuned
depth and, where Triton reports the shared memory short, one stage fewer, down to one; a reduced depth is
kept per kernel, device and launch configuration, so later launches and graph captures take it at once.
"""

from __future__ import annotations

import torch
from triton.runtime.errors import OutOfResources

_REDUCED: dict[tuple, int] = {}  # launch configurations that loaded only with fewer stages than asked, and how many


def launch(kernel, grid: tuple, *args, num_stages: int, **kwargs) -> None:
    """`kernel[grid](*args, **kwargs)` with `num_stages` pipeline stages, or the most that fit the device (no
    configuration to look up until one has needed fewer: a launch that fits costs nothing more)."""
    key = _configuration(kernel, args, kwargs) if _REDUCED else None
    stages = _REDUCED.get(key, num_stages)
    while True:
        try:
            kernel[grid](*args, num_stages=stages, **kwargs)
            break
        except OutOfResources as short:
            if short.name != "shared memory" or stages == 1:
                raise
            stages -= 1
    if stages < num_stages:
        _REDUCED[key or _configuration(kernel, args, kwargs)] = stages


def _configuration(kernel, args: tuple, kwargs: dict) -> tuple:
    """What a launch's shared memory depends on: the kernel, its constexpr and launch options, its tensors'
    dtypes and their device."""
    tensors = [value for value in (*args, *kwargs.values()) if isinstance(value, torch.Tensor)]
    options = tuple(sorted((name, value) for name, value in kwargs.items() if not isinstance(value, torch.Tensor)))
    return (kernel, tensors[0].device if tensors else None, options, tuple(tensor.dtype for tensor in tensors))
