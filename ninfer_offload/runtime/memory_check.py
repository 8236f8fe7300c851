"""Memory checks before a load (refuse what cannot fit before any weight moves) and pinned host buffers.

The footprint comes from the planner's accounting (`planner.memory.load_footprint`): the weights
as loaded, the expert arena (pinned experts, cache slots, prefill staging slots), the state pool's KV cache and GDN
state. The host check covers the pool of offloaded expert records as it is locked (`host_pool`).
Activations of a forward are not counted; `ninfer plan` gives the full budget including workspace
and reserve.

Pinned buffers are allocated with malloc, their pages touched by several threads and then
registered with the driver (`register_pinned_allocations`), not with cudaHostAlloc, which zeroes
and locks pages in one driver thread (several times slower for the full-size pool: `bench/pinning.py`,
docs/performance.md).
"""

from __future__ import annotations

import os

import psutil
import torch

from ninfer_offload.errors import NinferError
from ninfer_offload.planner.memory import PINNED_ALIGN

_GIB = 1024**3


def check_fits(footprint: dict[str, int], free_bytes: int, device: torch.device) -> None:
    """NinferError naming the biggest items and the options that shrink them when the load cannot fit."""
    need = sum(footprint.values())
    if need <= free_bytes:
        return
    cache = footprint.get("prompt_cache", 0)
    if cache and need - cache <= free_bytes:
        raise NinferError(
            f"the prompt cache's {cache / _GIB:.2f} GiB of VRAM does not fit beside the load on {device}: at most "
            f"{(free_bytes - need + cache) >> 20} MiB does (--prompt-cache-vram)"
        )
    items = ", ".join(f"{name} {size / _GIB:.2f} GiB" for name, size in sorted(footprint.items(), key=lambda kv: -kv[1]))
    raise NinferError(
        f"needs {need / _GIB:.2f} GiB of VRAM ({items}), {device} has {free_bytes / _GIB:.2f} GiB free; "
        "use a --vram-budget (experts beyond it stay in host memory), a lower --max-context or --max-concurrency, "
        "or see `ninfer plan` for what fits"
    )


PINNED_REGISTER = "pinned_use_cuda_host_register:True,pinned_num_register_threads:8"


def register_pinned_allocations() -> None:
    """Have torch's pinned host allocations registered (malloc, pages touched by 8 threads,
    cudaHostRegister) instead of made by cudaHostAlloc, unless the allocator configuration in the
    environment already says how; the rest of that configuration is kept."""
    configured = os.environ.get("PYTORCH_ALLOC_CONF") or os.environ.get("PYTORCH_CUDA_ALLOC_CONF") or ""
    if "pinned_use_cuda_host_register" not in configured:
        torch._C._accelerator_setAllocatorSettings(",".join(filter(None, [configured, PINNED_REGISTER])))


def available_host_bytes() -> int:
    """Host memory the system can give this process now without swapping."""
    return int(psutil.virtual_memory().available)


def check_host_memory(pinned_bytes: int) -> None:
    """NinferError when the host cannot spare `pinned_bytes` of RAM for the pinned expert pool."""
    if not pinned_bytes:
        return
    available = available_host_bytes()
    if pinned_bytes > available:
        raise NinferError(
            f"the experts kept in host memory need {pinned_bytes / _GIB:.1f} GiB of pinned RAM, {available / _GIB:.1f} GiB "
            "is available; give a larger --vram-budget (more experts in VRAM) or free host memory"
        )


def host_tensor(shape: tuple[int, ...], dtype: torch.dtype, pinned: bool, what: str, remedy: str) -> torch.Tensor:
    """An uninitialized host tensor, page-locked (mapped for the device) and starting on a PINNED_ALIGN
    boundary when `pinned` (registered buffers start where malloc put them); pinning refused is a
    NinferError naming `what` it was for and the `remedy` (the option that avoids it), or raising the
    locked-memory limit."""
    if not pinned:
        return torch.empty(shape, dtype=dtype)
    nbytes = torch.Size(shape).numel() * dtype.itemsize
    try:
        flat = torch.empty(nbytes + PINNED_ALIGN, dtype=torch.uint8, pin_memory=True)
    except RuntimeError as err:
        raise NinferError(
            f"pinning {nbytes / 2**20:.0f} MiB of host memory for {what} failed ({str(err).splitlines()[0]}); "
            f"{remedy} or raise the locked-memory limit (ulimit -l)"
        ) from None
    start = -flat.data_ptr() % PINNED_ALIGN
    return flat[start : start + nbytes].view(dtype).view(shape)
