"""Stacked products: a row-stacked quantized object decodes to the stacked matrices, and one stacked
product equals the separate ones."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from nvfp4_support import random_nvfp4

from ninfer_offload.artifact.codecs import encode_row_split, materialize_rows
from ninfer_offload.artifact.formats import GROUPED_FORMATS, grouped_format
from ninfer_offload.model.backend import ReferenceBackend
from ninfer_offload.model.nvfp4 import Nvfp4Matrix
from ninfer_offload.model.quant import QuantizedMatrix
from ninfer_offload.model.stacked import StackedLinear, stack_quantized


def _matrix(fmt: str, n: int, k: int, seed: int) -> QuantizedMatrix:
    values = np.random.default_rng(seed).standard_normal((n, k)).astype(np.float32)
    return QuantizedMatrix(grouped_format(fmt), n, k, torch.from_numpy(encode_row_split(values, fmt)))


@pytest.mark.parametrize("fmt", sorted(GROUPED_FORMATS))
def test_stacked_object_decodes_to_the_stacked_matrices(fmt):
    parts = [_matrix(fmt, n, 200, seed) for seed, n in enumerate((3, 16, 1, 7))]
    stacked = stack_quantized(parts)
    assert stacked.shape == (27, 200)
    assert torch.equal(stacked.dequantize(), torch.cat([p.dequantize() for p in parts]))


def test_stacked_nvfp4_object_decodes_to_the_stacked_matrices():
    """nvfp4 parts (the shared expert's gate and up) stack tile by tile, each tile keeping its own divisor."""
    parts = []
    for seed, n in enumerate((256, 128, 384)):
        parent = random_nvfp4(np.random.default_rng(seed), n, 192, n // 128)
        parts.append(Nvfp4Matrix(n, 192, torch.from_numpy(materialize_rows(parent, "nvfp4", n, 192, 0, n))))
    stacked = StackedLinear.of(parts)
    assert len(stacked.weights) == 1 and stacked.weights[0].shape == (768, 192)
    assert torch.equal(stacked.weights[0].dequantize(), torch.cat([p.dequantize() for p in parts]))
    x = torch.randn(2, 192, generator=torch.Generator().manual_seed(3))
    for got, part in zip(stacked(ReferenceBackend(), x), parts):
        torch.testing.assert_close(got, ReferenceBackend().linear(x, part))


def test_one_stacked_product_equals_the_separate_products():
    backend = ReferenceBackend()
    x = torch.randn(3, 200, generator=torch.Generator().manual_seed(0))
    parts = [_matrix("q8_g32_fp16", n, 200, seed) for seed, n in enumerate((8, 4, 5))]
    stacked = StackedLinear.of(parts)
    assert len(stacked.weights) == 1
    for got, part in zip(stacked(backend, x), parts):
        torch.testing.assert_close(got, backend.linear(x, part))
    dense = [torch.randn(n, 200, generator=torch.Generator().manual_seed(n)) for n in (10, 1)]
    got = StackedLinear.of(dense)(backend, x)
    assert [g.shape[-1] for g in got] == [10, 1]
    torch.testing.assert_close(got[1], x @ dense[1].T)


def test_grouped_outputs_put_consecutive_parts_side_by_side():
    backend = ReferenceBackend()
    x = torch.randn(2, 200, generator=torch.Generator().manual_seed(2))
    stackable = [_matrix("q8_g32_fp16", n, 200, n) for n in (3, 5, 2)]
    mixed = [_matrix("q8_g32_fp16", 3, 200, 0), _matrix("q4_g64_fp16", 5, 200, 1), _matrix("q8_g32_fp16", 2, 200, 2)]
    for parts in (stackable, mixed):
        joined, last = StackedLinear.of(parts, groups=(2, 1))(backend, x)
        torch.testing.assert_close(joined, torch.cat([backend.linear(x, p) for p in parts[:2]], dim=-1))
        torch.testing.assert_close(last, backend.linear(x, parts[2]))
    with pytest.raises(ValueError, match="do not cover"):
        StackedLinear.of(parts, groups=(1, 1))


def test_parts_of_different_formats_stay_separate_products():
    backend = ReferenceBackend()
    x = torch.randn(2, 200, generator=torch.Generator().manual_seed(1))
    parts = [_matrix("q8_g32_fp16", 6, 200, 0), _matrix("q4_g64_fp16", 6, 200, 1), torch.randn(2, 200)]
    stacked = StackedLinear.of(parts)
    assert stacked.weights == tuple(parts)
    for got, part in zip(stacked(backend, x), parts):
        torch.testing.assert_close(got, backend.linear(x, part))
