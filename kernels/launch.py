"""Programmatic dependent launch (PDL) for the kernels of a decode step, on sm_90 and newer.

A step is a chain of short kernels, each of which reads its weights from memory only once the kernel
before it has finished. Launched with PDL (`launch_options`: `launch_pdl` and the `PDL` constexpr),
a kernel's programs may be scheduled while the kernel before it still runs: what they read before
`await_producer` overlaps that kernel's tail (the matrix-vector products read their first weight
tile there), and everything after it sees the earlier kernels' writes, as without PDL.

`await_producer` waits for the kernel before to complete, then lets the kernel after be scheduled:
so at most one kernel waits ahead of the one running and holds SM resources (a kernel that let the
next one be scheduled at its very start would let the whole chain's programs pile up waiting).
Before it a kernel may only read memory that no kernel of the step writes (weights), and must not
write; every kernel launched with PDL calls it on every program. Inside a CUDA graph the launches
become programmatic edges, so a replayed step keeps the overlap. `ENABLED = False` (or NINFER_PDL=0)
launches every kernel plainly, for A/B measurements and as a fallback.
"""

from __future__ import annotations

import functools
import os

import torch
import triton
import triton.language as tl

ENABLED = os.environ.get("NINFER_PDL", "1") != "0"
_INTERPRETED = os.environ.get("TRITON_INTERPRET", "0") == "1"  # read once, as Triton reads it when a kernel is defined


@functools.lru_cache(maxsize=None)
def _supported(device_index: int) -> bool:
    return torch.cuda.get_device_capability(device_index)[0] >= 9


def launch_options(device: torch.device) -> dict:
    """Keyword arguments for a launch on `device`: {"PDL": True, "launch_pdl": True} where PDL is on and the
    device supports it (CUDA sm_90+, not the Triton interpreter), else {"PDL": False}."""
    on = ENABLED and not _INTERPRETED and device.type == "cuda" and _supported(
        torch.cuda.current_device() if device.index is None else device.index
    )
    return {"PDL": True, "launch_pdl": True} if on else {"PDL": False}


@triton.jit
def await_producer(PDL: tl.constexpr):
    """Block until the kernel before this one has completed and its writes are visible, then let the
    kernel after this one be scheduled."""
    if PDL:
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()


@triton.jit
def prefetch_to_l2(start, NBYTES: tl.constexpr, LINES: tl.constexpr):
    """Ask L2 for the NBYTES bytes from `start` (a uint8 pointer), one `prefetch.global.L2` per 128-byte line
    (LINES >= NBYTES / 128; those past the end repeat the last line): a kernel's weights read into L2 before
    `await_producer` without holding a register."""
    offsets = tl.minimum(tl.arange(0, LINES).to(tl.int64) * 128, NBYTES - 1)
    tl.inline_asm_elementwise(
        "prefetch.global.L2 [$1];\n\tmov.u32 $0, 0;", "=r,l", [start + offsets], dtype=tl.int32, is_pure=False, pack=1
    )
