"""The few-token tensor-core product (`kernels/small_batch.py`) against the reference dequantize + matmul
(Triton interpreter on CPU, real GPU with CUDA)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from kernels_support import DEVICE, needs_triton_device
from ninfer_offload.artifact.codecs import decode_row_split_values, encode_row_split
from ninfer_offload.artifact.formats import GROUPED_FORMATS, RowSplitGeometry

pytestmark = needs_triton_device


def _random_object(fmt: str, n: int, k: int) -> tuple[torch.Tensor, torch.Tensor, RowSplitGeometry]:
    """A row-split object of random weights on the test device, its dequantized values (float64) and geometry."""
    rng = np.random.default_rng(n + k)
    raw = encode_row_split(rng.standard_normal((n, k)).astype(np.float32), fmt)
    weight = torch.from_numpy(decode_row_split_values(raw, fmt, n, k)).double()
    return torch.from_numpy(raw).to(DEVICE), weight, RowSplitGeometry(GROUPED_FORMATS[fmt], n, k)


@pytest.mark.parametrize("fmt", ["q8_g32_fp16", "q4_g64_fp16"])
@pytest.mark.parametrize("n,k", [(64, 256), (100, 300)])
@pytest.mark.parametrize("weights_as_m", [True, False])
def test_few_token_product_matches_reference(fmt, n, k, weights_as_m):
    from ninfer_offload.kernels.small_batch import few_tokens_linear

    data, weight, geometry = _random_object(fmt, n, k)
    for t in (1, 3, 16):
        x = torch.randn(t, k, generator=torch.Generator().manual_seed(t))
        expected = x.double() @ weight.T
        for split in (1, 3):  # K = 384 padded: three tiles of 128, one per split
            out = few_tokens_linear(x.to(DEVICE), data, geometry, block_n=64, block_k=128, split=split, weights_as_m=weights_as_m)
            assert out.shape == (t, n) and out.dtype == torch.float32
            assert float((out.double().cpu() - expected).norm() / expected.norm()) < 1e-5


@pytest.mark.parametrize("fmt", ["q8_g32_fp16", "q4_g64_fp16"])
def test_deferred_gemv_matches_reference(fmt):
    from ninfer_offload.kernels.small_batch import deferred_gemv

    n, k = 100, 300
    data, weight, geometry = _random_object(fmt, n, k)
    for t in (1, 3, 8, 16):
        x = torch.randn(t, k, generator=torch.Generator().manual_seed(t))
        expected = x.double() @ weight.T
        out = deferred_gemv(x.to(DEVICE), data, geometry, block_n=8, block_k=128)
        assert out.shape == (t, n) and float((out.double().cpu() - expected).norm() / expected.norm()) < 1e-5


@pytest.mark.parametrize("fmt", ["q8_g32_fp16", "q4_g64_fp16"])
def test_group_dot_product_matches_reference(fmt):
    from ninfer_offload.kernels.small_batch import group_dot_linear

    n, k = 100, 300
    data, weight, geometry = _random_object(fmt, n, k)
    for t in (1, 3, 16):
        x = torch.randn(t, k, generator=torch.Generator().manual_seed(t))
        expected = x.double() @ weight.T
        for split in (1, 3):
            out = group_dot_linear(x.to(DEVICE), data, geometry, block_n=32, split=split)
            assert out.shape == (t, n) and float((out.double().cpu() - expected).norm() / expected.norm()) < 1e-5


def test_few_token_product_refuses_what_it_cannot_take():
    from ninfer_offload.kernels.small_batch import few_tokens_linear

    geometry = RowSplitGeometry(GROUPED_FORMATS["q5_g64_fp16"], 64, 256)
    data = torch.zeros(geometry.encoded_size, dtype=torch.uint8, device=DEVICE)
    with pytest.raises(ValueError, match="q8/q4"):
        few_tokens_linear(torch.zeros(2, 256, device=DEVICE), data, geometry)
