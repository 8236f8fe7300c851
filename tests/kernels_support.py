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
