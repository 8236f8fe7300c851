"""Launches at a pipeline depth the device's shared memory holds (`kernels/fitting.py`).

The sm_120 cards of the profiles give a block 99 KB of shared memory where the H200 gives 227 KB. On the CPU a
stand-in launcher refuses deeper pipelines the way Triton does (its own `OutOfResources`); on the GPU Triton's
shared-memory limit is set to sm_120's and the attention decode kernel (138 KB at three stages) runs anyway.
"""

from __future__ import annotations

import pytest
import torch

from kernels_support import HAS_CUDA, needs_cuda  # (sets the interpreter up before anything imports triton)
from ninfer_offload.kernels import fitting
from triton.runtime.errors import OutOfResources

SM_120_SHARED = 101_376  # bytes of shared memory per block on sm_120 (99 KB)


class _Launcher:
    """Launches nothing; refuses more than `fits` stages as Triton refuses a kernel the device cannot hold."""

    def __init__(self, fits: int) -> None:
        self.fits, self.tried = fits, []

    def __getitem__(self, grid):
        def run(*args, num_stages: int, **kwargs) -> None:
            self.tried.append(num_stages)
            if num_stages > self.fits:
                raise OutOfResources(num_stages * 47_000, SM_120_SHARED, "shared memory")

        return run


def test_a_launch_takes_the_deepest_pipeline_that_fits_and_keeps_it():
    kernel = _Launcher(fits=2)
    x = torch.zeros(4)
    fitting.launch(kernel, (1,), x, 7, num_stages=4, BLOCK=64)
    assert kernel.tried == [4, 3, 2]
    fitting.launch(kernel, (1,), x, 8, num_stages=4, BLOCK=64)  # the same configuration: the kept depth at once
    assert kernel.tried == [4, 3, 2, 2]
    fitting.launch(kernel, (1,), x, 8, num_stages=4, BLOCK=32)  # another constexpr: tried afresh
    assert kernel.tried == [4, 3, 2, 2, 4, 3, 2]


def test_a_kernel_that_fits_no_depth_raises():
    kernel = _Launcher(fits=0)
    with pytest.raises(OutOfResources):
        fitting.launch(kernel, (1,), torch.zeros(1), num_stages=2)
    assert kernel.tried == [2, 1]


@pytest.mark.gpu
@needs_cuda
def test_attention_decode_runs_in_sm_120_shared_memory(monkeypatch):
    """A head layout no other test compiles (12 query heads over 3 KV heads of 256 dims), so Triton loads the
    kernel here, against sm_120's limit: the decode still matches the reference."""
    import triton.compiler.compiler as compiler

    from ninfer_offload.kernels.attention import attention_decode
    from ninfer_offload.model.backend import ReferenceBackend

    assert HAS_CUDA
    monkeypatch.setattr(compiler, "max_shared_mem", lambda device: SM_120_SHARED)
    gen = torch.Generator().manual_seed(0)
    hq, hkv, d, capacity = 12, 3, 256, 512
    q = torch.randn(2, hq, d, generator=gen).to(torch.bfloat16)
    k_pool, v_pool = (torch.randn(2 * capacity, hkv, d, generator=gen).to(torch.bfloat16) for _ in range(2))
    slots, lengths = torch.tensor([1, 0]), torch.tensor([300, 77])  # int64, as a step context holds them
    got = attention_decode(q.cuda(), k_pool.cuda(), v_pool.cuda(), slots.cuda(), lengths.cuda(), 1, capacity)
    for b in range(2):
        rows = slice(int(slots[b]) * capacity, int(slots[b]) * capacity + int(lengths[b]))
        want = ReferenceBackend().attention_prefill(q[b : b + 1].float(), k_pool[rows].float(), v_pool[rows].float(), int(lengths[b]) - 1)
        torch.testing.assert_close(got[b : b + 1].float().cpu(), want, rtol=2e-2, atol=2e-2)
