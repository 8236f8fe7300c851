"""Kernel launches at a pipeline depth that fits the device's shared memory.

A Triton kernel launched with `num_stages` software-pipeline stages keeps that many tiles of its loads in
shared memory. Tiles and depths are tuned on the H200, which gives a block 227 KB of shared memory; the
consumer Blackwell cards of the profiles (sm_120: RTX 5090, RTX 5060 Ti, RTX PRO 6000) give it 99 KB, where
the attention decode kernel's three stages of bf16 K/V tiles (138 KB) and the MoE prefill tiles over host
records (up to 130 KB) cannot load (`bench/kernel_resources.py`). `launch` tries the tuned
depth and, where Triton reports the shared memory short, one stage fewer, down to one; the depth that loaded
is kept per kernel, device and launch configuration, so later launches and graph captures take it at once.
"""

from __future__ import annotations

import torch
from triton.runtime.errors import OutOfResources

_DEPTHS: dict[tuple, int] = {}


def launch(kernel, grid: tuple, *args, num_stages: int, **kwargs) -> None:
    """`kernel[grid](*args, **kwargs)` with `num_stages` pipeline stages, or the most that fit the device."""
    key = _configuration(kernel, args, kwargs)
    stages = _DEPTHS.get(key, num_stages)
    while True:
        try:
            kernel[grid](*args, num_stages=stages, **kwargs)
        except OutOfResources as short:
            if short.name != "shared memory" or stages == 1:
                raise
            stages -= 1
            continue
        _DEPTHS[key] = stages
        return


def _configuration(kernel, args: tuple, kwargs: dict) -> tuple:
    """What a launch's shared memory depends on: the kernel, its constexpr and launch options, its tensors'
    dtypes and their device."""
    tensors = [value for value in (*args, *kwargs.values()) if isinstance(value, torch.Tensor)]
    options = tuple(sorted((name, value) for name, value in kwargs.items() if not isinstance(value, torch.Tensor)))
    return (kernel, tensors[0].device if tensors else None, options, tuple(tensor.dtype for tensor in tensors))
