"""Dense matrix-vector kernel vs `x @ w.T` (Triton interpreter on CPU, real GPU with CUDA)."""

from __future__ import annotations

import pytest
import torch

from kernels_support import DEVICE, needs_triton_device

pytestmark = needs_triton_device


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.bfloat16, 1e-2)])
def test_few_tokens_match_the_matmul(dtype, tol):
    from ninfer_offload.kernels.dense_linear import dense_linear

    gen = torch.Generator().manual_seed(0)
    w = torch.randn(33, 300, generator=gen).to(dtype)  # odd rows, columns not a power of two
    for t in (1, 3, 8, 9):  # 9: past the kernel's limit, the library product
        x = torch.randn(t, 300, generator=gen).to(dtype)
        out = dense_linear(x.to(DEVICE), w.to(DEVICE))
        want = x.double() @ w.double().T
        assert out.shape == (t, 33) and out.dtype == dtype
        assert float((out.double().cpu() - want).norm() / want.norm()) < tol


def test_each_token_gets_what_it_gets_alone(monkeypatch):
    from ninfer_offload.kernels import dense_linear as module

    monkeypatch.setattr(module, "GEMV_BLOCK_K", 256)  # several column tiles
    gen = torch.Generator().manual_seed(1)
    w, x = torch.randn(20, 700, generator=gen), torch.randn(5, 700, generator=gen)
    together = module.dense_linear(x.to(DEVICE), w.to(DEVICE))
    for t in range(5):
        torch.testing.assert_close(module.dense_linear(x[t : t + 1].to(DEVICE), w.to(DEVICE)), together[t : t + 1])
