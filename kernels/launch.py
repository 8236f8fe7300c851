"""Programmatic dependent launch (PDL): a kernel of a step may start while the one before it finishes.

On sm_90 and newer every kernel of this package is launched with `launch_pdl=True` and the `PDL`
constexpr set (`launch_options`). Such a kernel calls `launch_dependents` at its start, so that the
next kernel's programs may be scheduled as soon as all of this one's are running, and
`wait_for_producer` before it reads anything an earlier kernel wrote and before it writes anything:
that blocks until the kernel before it has completed and its writes are visible. What comes before
the wait may only read memory no kernel of the step writes (the weights); the matrix-vector kernels
load their first weight tile there, so a small product's DRAM latency overlaps its producer's tail
instead of following it. Inside a CUDA graph the launches become programmatic edges, so a decode
step keeps the overlap on replay. Kernels that wait before everything else behave exactly as
without PDL, and a PDL launch after a kernel that never signals simply starts when it completes.
`NINFER_PDL=0` turns PDL off (for A/B measurements and as a fallback).
"""

from __future__ import annotations

import functools
import os

import torch
import triton
import triton.language as tl


@functools.lru_cache(maxsize=1)
def launch_options() -> dict:
    """Keyword arguments for every kernel launch: {"PDL": on, "launch_pdl": on}, on where the current
    CUDA device supports PDL (sm_90+, not the Triton interpreter, not disabled by NINFER_PDL=0)."""
    on = (
        os.environ.get("TRITON_INTERPRET", "0") != "1"
        and os.environ.get("NINFER_PDL", "1") != "0"
        and torch.cuda.is_available()
        and torch.cuda.get_device_capability()[0] >= 9
    )
    return {"PDL": on, "launch_pdl": on}


@triton.jit
def launch_dependents(PDL: tl.constexpr):
    """Let the next kernel's programs be scheduled once every program of this one has got here."""
    if PDL:
        tl.extra.cuda.gdc_launch_dependents()


@triton.jit
def wait_for_producer(PDL: tl.constexpr):
    """Block until the kernel before this one has completed and its writes are visible."""
    if PDL:
        tl.extra.cuda.gdc_wait()
