"""nvfp4 through the Triton kernels (dense linear, its dequantize path, routed experts; matrix-vector
and tiled kernels) against the codec's values and the torch reference op: the Triton interpreter on
tiny shapes, and the 35B shapes in bf16 on CUDA."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch
from kernels_support import DEVICE, needs_cuda, needs_triton_device
from nvfp4_support import random_nvfp4

from ninfer_offload.artifact.codecs import decode_nvfp4, decode_row_split_values, encode_row_split, materialize_rows
from ninfer_offload.artifact.formats import runtime_geometry
from ninfer_offload.artifact.records import ExpertRecordLayout
from ninfer_offload.model.backend import ReferenceBackend
from ninfer_offload.model.experts import ExpertBank

pytestmark = needs_triton_device


def _matrix(n: int, k: int, divisors: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(runtime-form bytes on DEVICE, float32 values from the codec) of a random nvfp4 matrix."""
    data = materialize_rows(random_nvfp4(np.random.default_rng(seed), n, k, divisors), "nvfp4", n, k, 0, n)
    return torch.from_numpy(data).to(DEVICE), torch.from_numpy(decode_nvfp4(data, n, k, n // 128))


def _relative_error(out: torch.Tensor, ref: torch.Tensor) -> float:
    return float((out.double().cpu() - ref).norm() / ref.norm())


@pytest.mark.parametrize("scale_order", [True, False])
@pytest.mark.parametrize("n,k", [(128, 64), (256, 320)])
def test_linear_matches_codec_values(n, k, scale_order, monkeypatch):
    from ninfer_offload.kernels import quant_linear
    from ninfer_offload.kernels.quant_linear import FUSED_MAX_TOKENS, dequantize_matrix, quantized_linear

    monkeypatch.setattr(quant_linear, "TILED_SCALE_ORDER", scale_order)  # the tiled kernel's rows in either order
    data, weight = _matrix(n, k, divisors=n // 128, seed=n + k)
    geometry = runtime_geometry("nvfp4", n, k)
    assert torch.equal(dequantize_matrix(data, geometry, torch.float32).cpu(), weight)  # correctly rounded division
    for t in (1, 5, FUSED_MAX_TOKENS + 3):  # split-K decode, one block, the dequantize + matmul path
        x = torch.randn(t, k, generator=torch.Generator().manual_seed(t))
        out = quantized_linear(x.to(DEVICE), data, geometry)
        assert out.shape == (t, n) and _relative_error(out, x.double() @ weight.double().T) < 1e-5


class _NotLaunched:
    """Stands in for a tiled kernel that a test expects not to run."""

    def __getitem__(self, grid):
        raise AssertionError("the tiled kernel ran instead of the matrix-vector one")


@pytest.mark.parametrize("n,k,block_k", [(256, 320, 2048), (384, 256, 128)])
def test_matrix_vector_linear_matches_codec_values(n, k, block_k, monkeypatch):
    """1, 3 and 4 tokens (the most it takes for a product of these rows) through the matrix-vector kernel:
    several column tiles (320 = 5 x 64, or 256 = 2 x 128), several row tiles with their own divisors; each
    token's row is what it gets alone."""
    from ninfer_offload.kernels import quant_linear

    monkeypatch.setattr(quant_linear, "SMALL_GEMV_TILES", quant_linear.GemvTiles(8, block_k, 8, 3))  # n < FEW_ROWS
    monkeypatch.setattr(quant_linear, "_quantized_matmul_kernel", _NotLaunched())
    data, weight = _matrix(n, k, divisors=n // 128, seed=n + k + 1)
    geometry = runtime_geometry("nvfp4", n, k)
    x = torch.randn(4, k, generator=torch.Generator().manual_seed(3))
    for t in (1, 3, 4):
        out = quant_linear.quantized_linear(x[:t].to(DEVICE), data, geometry)
        assert out.shape == (t, n) and _relative_error(out, x[:t].double() @ weight.double().T) < 1e-5
        torch.testing.assert_close(out[-1:], quant_linear.quantized_linear(x[t - 1 : t].to(DEVICE), data, geometry))


def _records(gate_up_fmt: str, down_fmt: str, hidden: int, inter: int, experts: int, seed: int, tile_divisors: bool = False):
    """(layout, records on DEVICE, per-expert float64 (gate/up, down)) cut from random fused banks: one
    divisor per expert (gate/up) or per bank (down), or with `tile_divisors` one per 128-row tile."""
    rng = np.random.default_rng(seed)
    gate_up_divisors = experts * 2 * inter // 128 if tile_divisors else experts
    gate_up = random_nvfp4(rng, experts * 2 * inter, hidden, divisors=gate_up_divisors)
    gate_up_values = decode_nvfp4(gate_up, experts * 2 * inter, hidden, gate_up_divisors)
    if down_fmt == "nvfp4":
        down_divisors = experts * hidden // 128 if tile_divisors else 1
        down = random_nvfp4(rng, experts * hidden, inter, divisors=down_divisors)
        down_values = decode_nvfp4(down, experts * hidden, inter, down_divisors)
    else:
        down = encode_row_split(rng.standard_normal((experts * hidden, inter)).astype(np.float32) / inter**0.5, down_fmt)
        down_values = decode_row_split_values(down, down_fmt, experts * hidden, inter)
    layout = ExpertRecordLayout.create(gate_up_fmt, down_fmt, hidden, inter)
    records = np.empty((experts, layout.nbytes), dtype=np.uint8)
    layout.pack_all(gate_up, down, experts, records)
    gate_up_rows, down_rows = torch.from_numpy(gate_up_values).double(), torch.from_numpy(down_values).double()
    weights = [(gate_up_rows[2 * inter * e : 2 * inter * (e + 1)], down_rows[hidden * e : hidden * (e + 1)]) for e in range(experts)]
    return layout, torch.from_numpy(records).to(DEVICE), weights


def _expected(x, ids, w, weights, inter):
    out = torch.zeros(x.shape, dtype=torch.float64)
    for t in range(x.shape[0]):
        for j in range(ids.shape[1]):
            gu, dn = weights[int(ids[t, j])]
            h = gu @ x[t].double()
            out[t] += float(w[t, j]) * (dn @ (torch.nn.functional.silu(h[:inter]) * h[inter:]))
    return out


@pytest.mark.parametrize("down_fmt", ["nvfp4", "q5_g64_fp16"])
def test_routed_experts_match_codec_values(down_fmt):
    from ninfer_offload.kernels.moe import record_table, routed_experts

    hidden, inter, experts = 128, 64, 4
    layout, records, weights = _records("nvfp4", down_fmt, hidden, inter, experts, seed=2)
    table = record_table(torch.arange(experts, device=DEVICE), layout.nbytes)
    gen = torch.Generator().manual_seed(0)
    for t in (1, 3, 40):  # one pair per block; 40 x 2 pairs: grouped by expert
        x = torch.randn(t, hidden, generator=gen)
        ids = torch.stack([torch.randperm(experts, generator=gen)[:2] for _ in range(t)])
        w = torch.softmax(torch.randn(t, 2, generator=gen), dim=-1)
        out = routed_experts(x.to(DEVICE), ids.to(DEVICE), w.to(DEVICE), records, table, layout)
        assert _relative_error(out, _expected(x, ids, w, weights, inter)) < 1e-5


def _routed_gemv(ids, w, monkeypatch, seed: int, block_k: int = 64):
    """Routed experts of nvfp4 gate/up and down records (gate and up rows with their own divisors)
    through the matrix-vector kernels, with `block_k`-wide column tiles (64: two per row), against the
    float64 evaluation of the codec's values."""
    from ninfer_offload.kernels import moe

    monkeypatch.setattr(moe, "GEMV_TILES", dataclasses.replace(moe.GEMV_TILES, block_k=block_k))
    monkeypatch.setattr(moe, "_gate_up_swiglu_kernel", _NotLaunched())
    hidden, inter, experts = 128, 128, 4
    layout, records, weights = _records("nvfp4", "nvfp4", hidden, inter, experts, seed=seed, tile_divisors=True)
    table = moe.record_table(torch.arange(experts, device=DEVICE), layout.nbytes)
    x = torch.randn(ids.shape[0], hidden, generator=torch.Generator().manual_seed(seed))
    out = moe.routed_experts(x.to(DEVICE), ids.to(DEVICE), w.to(DEVICE), records, table, layout)
    assert _relative_error(out, _expected(x, ids, w, weights, inter)) < 1e-5


@pytest.mark.parametrize("tokens", [1, 3, 8])
def test_matrix_vector_routed_experts_tokens_sharing_experts(tokens, monkeypatch):
    """One token; several tokens routed to the same experts in different slots (each pair's program reads its
    expert)."""
    ids = torch.stack([torch.tensor([0, 2, 3]).roll(t) for t in range(tokens)])
    w = torch.softmax(torch.randn(tokens, 3, generator=torch.Generator().manual_seed(tokens)), dim=-1)
    _routed_gemv(ids, w, monkeypatch, seed=tokens)


@pytest.mark.parametrize("tokens", [1, 3])
def test_matrix_vector_routed_experts_repeating_an_expert(tokens, monkeypatch):
    """A token using one expert in two slots, the first with a zero weight (the host-miss path)."""
    ids = torch.tensor([[3, 1, 3]] * tokens)
    w = torch.softmax(torch.randn(tokens, 3, generator=torch.Generator().manual_seed(9)), dim=-1)
    w[0, 0] = 0.0
    _routed_gemv(ids, w, monkeypatch, seed=10 + tokens)


@pytest.mark.gpu
@needs_cuda
def test_35b_shapes_in_bf16_match_the_reference_op():
    """The 35B model's nvfp4 shapes on the GPU in bf16 (decode, verification and prefill token counts)
    against the reference backend, which decodes the same bytes exactly."""
    from ninfer_offload.kernels.backend import TritonBackend
    from ninfer_offload.model.nvfp4 import Nvfp4Matrix

    triton_backend, reference = TritonBackend(), ReferenceBackend()
    gen = torch.Generator().manual_seed(1)
    for n, k in ((4096, 2048), (2048, 512), (512, 2048)):  # attention q/gate, shared down, shared gate
        data, _ = _matrix(n, k, divisors=2, seed=n + k)
        w = Nvfp4Matrix(n, k, data)
        for t in (1, 4, 300):
            x = torch.randn(t, k, generator=gen).to(DEVICE, torch.bfloat16)
            ref = reference.linear(x.float(), w.to(DEVICE))
            assert _relative_error(triton_backend.linear(x, w), ref.cpu().double()) < 1e-2
    layout, records, _ = _records("nvfp4", "nvfp4", 2048, 512, 16, seed=3)
    bank = ExpertBank.of_records(layout, records)
    for t in (1, 8, 200):  # one pair per block; grouped by expert; prefill tiles
        x = torch.randn(t, 2048, generator=gen).to(DEVICE, torch.bfloat16)
        ids = torch.stack([torch.randperm(16, generator=gen)[:8] for _ in range(t)]).to(DEVICE)
        w = torch.softmax(torch.randn(t, 8, generator=gen), dim=-1).to(DEVICE, torch.bfloat16)
        ref = reference.routed_experts(x.float(), ids, w.float(), bank)
        assert _relative_error(triton_backend.routed_experts(x, ids, w, bank), ref.cpu().double()) < 2e-2
