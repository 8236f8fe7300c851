"""Where kernel tests run: on CUDA when present, else under the Triton interpreter on CPU.

Triton chooses interpretation when a kernel module is imported, so on a machine without CUDA
this module turns the interpreter on before any test imports `ninfer_offload.kernels`.
"""

from __future__ import annotations

import os
import sys

import pytest
import torch

HAS_CUDA = torch.cuda.is_available()
if not HAS_CUDA and "ninfer_offload.kernels.rowsplit" not in sys.modules:
    os.environ["TRITON_INTERPRET"] = "1"
INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"
DEVICE = torch.device("cuda" if HAS_CUDA else "cpu")

needs_triton_device = pytest.mark.skipif(not (HAS_CUDA or INTERPRETED), reason="needs CUDA or the Triton interpreter")
needs_cuda = pytest.mark.skipif(not HAS_CUDA, reason="needs CUDA")


class LaunchedWith:
    """Stands in for a Triton kernel: launches it as it is, after checking that each launch passes the
    given constexpr values (which of its paths ran)."""

    def __init__(self, kernel, **expected) -> None:
        self.kernel, self.expected = kernel, expected

    def __getitem__(self, grid):
        launch = self.kernel[grid]

        def checked(*args, **kwargs):
            wrong = {name: kwargs.get(name) for name, value in self.expected.items() if kwargs.get(name) != value}
            assert not wrong, f"launched with {wrong}, expected {self.expected}"
            return launch(*args, **kwargs)

        return checked


# Each routed-experts matrix-vector product with a tensor-core path: its threshold and its kernel (kernels/moe.py).
TENSOR_CORE_PRODUCTS = {
    "gate_up": ("MMA_GATE_UP_MIN_TOKENS", "_gate_up_swiglu_gemv_kernel"),
    "down": ("MMA_DOWN_MIN_TOKENS", "_down_shared_gemv_kernel"),
}


def product_on_tensor_cores(monkeypatch, product: str) -> None:
    """Make the routed experts' `product` run on tensor cores from 2 tokens (the down product of any token
    count on the several-token kernel), each launch checked to take that path."""
    from ninfer_offload.kernels import moe

    threshold, kernel = TENSOR_CORE_PRODUCTS[product]
    monkeypatch.setattr(moe, "SHARED_DOWN_MIN_TOKENS", 1)
    monkeypatch.setattr(moe, threshold, 2)
    monkeypatch.setattr(moe, kernel, LaunchedWith(getattr(moe, kernel), MMA=True))
