"""Quantized linear kernel vs the reference dequantize + matmul (Triton interpreter on CPU, real GPU with CUDA)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from kernels_support import DEVICE, LaunchedWith, needs_cuda, needs_triton_device
from ninfer_offload.artifact.codecs import decode_row_split_values, encode_row_split
from ninfer_offload.artifact.formats import GROUPED_FORMATS, RowSplitGeometry

pytestmark = needs_triton_device


def _random_object(fmt: str, n: int, k: int, seed: int) -> tuple[torch.Tensor, torch.Tensor, RowSplitGeometry]:
    rng = np.random.default_rng(seed)
    values = rng.standard_normal((n, k)).astype(np.float32)
    raw = encode_row_split(values, fmt)
    reference = torch.from_numpy(decode_row_split_values(raw, fmt, n, k))
    geometry = RowSplitGeometry(GROUPED_FORMATS[fmt], n, k)
    return torch.from_numpy(raw).to(DEVICE), reference, geometry


def _relative_error(out: torch.Tensor, ref: torch.Tensor) -> float:
    return float((out.double().cpu() - ref).norm() / ref.norm())


@pytest.mark.parametrize("fmt", sorted(GROUPED_FORMATS))
@pytest.mark.parametrize("n,k", [(40, 200), (33, 256)])
def test_fused_kernel_matches_reference_for_every_format(fmt, n, k):
    from ninfer_offload.kernels.quant_linear import quantized_linear

    data, weight, geometry = _random_object(fmt, n, k, seed=n + k)
    for t in (1, 3, 8):
        x = torch.randn(t, k, generator=torch.Generator().manual_seed(t))
        out = quantized_linear(x.to(DEVICE), data, geometry)
        assert out.shape == (t, n) and out.dtype == torch.float32
        assert _relative_error(out, x.double() @ weight.double().T) < 1e-5


def test_split_k_and_dequantize_paths():
    from ninfer_offload.kernels.quant_linear import FUSED_MAX_TOKENS, dequantize_matrix, quantized_linear

    data, weight, geometry = _random_object("q5_g64_fp16", 20, 900, seed=7)
    assert torch.equal(dequantize_matrix(data, geometry, torch.float32).cpu(), weight)
    x = torch.randn(FUSED_MAX_TOKENS + 5, 900, generator=torch.Generator().manual_seed(1))
    out = quantized_linear(x.to(DEVICE), data, geometry)
    assert _relative_error(out, x.double() @ weight.double().T) < 1e-5
    few = quantized_linear(x[:20].to(DEVICE), data, geometry)  # tiled kernel, K = 1024 padded: split across programs
    assert _relative_error(few, x[:20].double() @ weight.double().T) < 1e-5


@pytest.mark.parametrize("fmt", ["q8_g32_fp16", "q5_g64_fp16"])
def test_split_k_sums_in_the_launch_as_a_sum_launch_would(fmt, monkeypatch):
    """A few tokens' tiled product splits K across programs; the last program of each tile to arrive sums the
    splits in split order: bit for bit what a `sum_middle` launch after it gives, the arrival counts zero again."""
    from ninfer_offload.kernels import quant_linear
    from ninfer_offload.kernels.arrivals import arrival_counts

    data, weight, geometry = _random_object(fmt, 40, 1024, seed=3)
    x = torch.randn(12, 1024, generator=torch.Generator().manual_seed(4)).to(DEVICE)
    in_launch = quant_linear.quantized_linear(x, data, geometry)
    assert int(arrival_counts("quant_linear.split_k", DEVICE).abs().sum()) == 0
    monkeypatch.setattr(quant_linear, "SUM_IN_PRODUCT", False)
    assert torch.equal(in_launch, quant_linear.quantized_linear(x, data, geometry))
    assert _relative_error(in_launch, x.double().cpu() @ weight.double().T) < 1e-5


@pytest.mark.parametrize("fmt", sorted(GROUPED_FORMATS))
@pytest.mark.parametrize("tensor_cores", [False, True])
def test_matrix_vector_kernel_walks_rows_in_several_tiles(fmt, tensor_cores, monkeypatch):
    from ninfer_offload.kernels import quant_linear

    for tiles in ("GEMV_TILES", "MMA_GEMV_TILES"):  # K = 900 -> 1024 padded: four column tiles
        monkeypatch.setattr(quant_linear, tiles, quant_linear.GemvTiles(16, 256, 8, 3))
    monkeypatch.setattr(quant_linear, "MMA_MIN_ROWS", 1 if tensor_cores else quant_linear.MMA_MIN_ROWS)
    data, weight, geometry = _random_object(fmt, 21, 900, seed=11)
    x = torch.randn(4, 900, generator=torch.Generator().manual_seed(2))  # a 21-row product's most tokens for this kernel
    out = quant_linear.quantized_linear(x.to(DEVICE), data, geometry)
    assert out.shape == (4, 21)
    assert _relative_error(out, x.double() @ weight.double().T) < 1e-5
    for t in range(4):  # each token's row is what it gets alone: bit for bit on CUDA cores, to rounding on tensor cores
        one = quant_linear.quantized_linear(x[t : t + 1].to(DEVICE), data, geometry)
        assert tensor_cores or torch.equal(one, out[t : t + 1])
        torch.testing.assert_close(one, out[t : t + 1], rtol=1e-5, atol=1e-4)


@pytest.mark.parametrize("fmt", ["q8_g32_fp16", "q5_g64_fp16"])
def test_paired_product_is_both_products_in_one_launch(fmt):
    """A quantized and a dense matrix of one input (GDN's projections and a/b, the shared expert's gate/up
    and the router): each output equals its own product, every token's row what it gets alone."""
    from ninfer_offload.kernels import quant_linear
    from ninfer_offload.kernels.dense_linear import dense_linear

    data, weight, geometry = _random_object(fmt, 37, 256, seed=5)
    dense = torch.randn(7, 256, generator=torch.Generator().manual_seed(6))
    x = torch.randn(8, 256, generator=torch.Generator().manual_seed(7)).to(DEVICE)
    for t in (1, 3, 8):
        yq, yd = quant_linear.paired_gemv(x[:t], data, geometry, dense.to(DEVICE))
        assert yq.shape == (t, 37) and yd.shape == (t, 7)
        assert torch.equal(yq, quant_linear.fused_gemv(x[:t], data, geometry))  # the same programs
        assert _relative_error(yq, x[:t].double().cpu() @ weight.double().T) < 1e-5
        torch.testing.assert_close(yd, dense_linear(x[:t], dense.to(DEVICE)), rtol=1e-5, atol=1e-5)
        for i in range(t):
            one_q, one_d = quant_linear.paired_gemv(x[i : i + 1], data, geometry, dense.to(DEVICE))
            assert torch.equal(one_q, yq[i : i + 1]) and torch.equal(one_d, yd[i : i + 1])
    with pytest.raises(ValueError, match="up to 8 rows"):
        quant_linear.paired_gemv(torch.randn(9, 256).to(DEVICE), data, geometry, dense.to(DEVICE))


def test_products_normalise_their_own_residual_input():
    """A layer's first products read (1 + w) * rmsnorm(x + delta) without a norm launch before them: the
    outputs and the x + delta and normed rows they store equal `add_rmsnorm` followed by the products."""
    from ninfer_offload.kernels import quant_linear
    from ninfer_offload.kernels.dense_linear import dense_linear
    from ninfer_offload.kernels.norm import add_rmsnorm

    data, _, geometry = _random_object("q8_g32_fp16", 37, 200, seed=8)
    dense = torch.randn(7, 200, generator=torch.Generator().manual_seed(9)).to(DEVICE)
    gen = torch.Generator().manual_seed(10)
    x, delta = (torch.randn(8, 200, generator=gen).to(DEVICE) for _ in range(2))
    w = torch.randn(200, generator=gen).to(DEVICE)
    for t in (1, 5, 8):
        total, normed = add_rmsnorm(x[:t], delta[:t], w, 1e-6, offset=True)
        y, got_total, got_normed = quant_linear.residual_norm_gemv(x[:t], delta[:t], w, 1e-6, data, geometry)
        assert torch.equal(got_total, total)
        torch.testing.assert_close(got_normed, normed, rtol=1e-6, atol=1e-6)
        torch.testing.assert_close(y, quant_linear.quantized_linear(normed, data, geometry), rtol=1e-5, atol=1e-5)
        yq, yd, pair_total, pair_normed = quant_linear.paired_gemv(x[:t], data, geometry, dense, residual=(delta[:t], w, 1e-6))
        assert torch.equal(yq, y) and torch.equal(pair_total, total) and torch.equal(pair_normed, got_normed)
        torch.testing.assert_close(yd, dense_linear(normed, dense), rtol=1e-5, atol=1e-5)
        one = quant_linear.residual_norm_gemv(x[t - 1 : t], delta[t - 1 : t], w, 1e-6, data, geometry)
        assert torch.equal(one[0], y[t - 1 : t])  # a token's row does not depend on the others in the step


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), pytest.param(torch.bfloat16, 2e-2, marks=needs_cuda)])
def test_tensor_core_products_equal_the_cuda_core_ones(dtype, tol, monkeypatch):
    """Several tokens of a large product multiply on tensor cores; every fused input and epilogue of the
    matrix-vector kernel gives there what the per-token CUDA-core path gives (to rounding), and the
    stored residual sums bit for bit. (bf16 on CUDA only: the interpreter's bf16 tl.dot is wrong.)"""
    from ninfer_offload.kernels import quant_linear
    from ninfer_offload.kernels.quant_linear import GATED_NORM, SIGMOID_GATE, SWIGLU

    gen = torch.Generator().manual_seed(12)
    data, _, geometry = _random_object("q6_g64_fp16", 48, 256, seed=13)
    x, x2 = (torch.randn(8, 256, generator=gen).to(dtype).to(DEVICE) for _ in range(2))
    norm_w = (torch.rand(256, generator=gen) + 0.5).to(dtype).to(DEVICE)
    dense = torch.randn(5, 256, generator=gen).to(dtype).to(DEVICE)
    routed, score = torch.randn(8, 48, generator=gen).to(dtype).to(DEVICE), torch.randn(8, 1, generator=gen).to(dtype).to(DEVICE)

    def products():
        return (
            quant_linear.quantized_linear(x, data, geometry),
            *quant_linear.residual_norm_gemv(x, x2, norm_w, 1e-6, data, geometry),
            *quant_linear.paired_gemv(x, data, geometry, dense, residual=(x2, norm_w, 1e-6)),
            quant_linear.fused_gemv(x, data, geometry, x2, SWIGLU, routed, score),
            quant_linear.fused_gemv(x, data, geometry, x2, SIGMOID_GATE),
            quant_linear.fused_gemv(x, data, geometry, x2, GATED_NORM, norm_w=norm_w[:64], eps=1e-6),
        )

    cuda_cores = products()
    monkeypatch.setattr(quant_linear, "MMA_MIN_ROWS", 1)  # this 48-row product on tensor cores too
    assert quant_linear.gemv_tiles(geometry.n, 8) == quant_linear.MMA_GEMV_TILES
    for got, want in zip(products(), cuda_cores):
        assert got.shape == want.shape and _relative_error(got.float(), want.double().cpu()) < tol
    total = quant_linear.residual_norm_gemv(x, x2, norm_w, 1e-6, data, geometry)[1]
    assert torch.equal(total, cuda_cores[2])  # the normed rows' statistic sums in the launch's own order


@pytest.mark.parametrize("tokens", [2, 4])
def test_input_steps_computed_before_the_product_equal_the_folded_ones(tokens, monkeypatch):
    """Past FOLD_INPUT_MAX_TOKENS tokens a matrix-vector product's input step (the residual norm, the gates, the
    gated norm) runs once before it, in the elementwise kernels: the products equal the folded ones to rounding,
    and the residual sums bit for bit."""
    from ninfer_offload.kernels import quant_linear
    from ninfer_offload.kernels.quant_linear import SIGMOID_GATE, SWIGLU

    gen = torch.Generator().manual_seed(31)
    data, _, geometry = _random_object("q5_g64_fp16", 48, 256, seed=32)
    x, x2 = (torch.randn(tokens, 256, generator=gen).to(DEVICE) for _ in range(2))
    norm_w = (torch.rand(256, generator=gen) + 0.5).to(DEVICE)
    dense = torch.randn(5, 256, generator=gen).to(DEVICE)
    assert quant_linear.on_matrix_vector(geometry.n, tokens)

    def products():
        return (
            *quant_linear.residual_norm_gemv(x, x2, norm_w, 1e-6, data, geometry),
            *quant_linear.paired_gemv(x, data, geometry, dense, residual=(x2, norm_w, 1e-6)),
            quant_linear.quantized_linear(x, data, geometry, x2, SWIGLU),
            quant_linear.quantized_linear(x, data, geometry, x2, SIGMOID_GATE),
            quant_linear.gated_norm_linear(x.reshape(tokens, 4, 64), x2.reshape(tokens, 4, 64), norm_w[:64], 1e-6, data, geometry),
        )

    folded = products()
    monkeypatch.setattr(quant_linear, "FOLD_INPUT_MAX_TOKENS", 1)
    monkeypatch.setattr(  # every product reads its input as it is
        quant_linear, "_quantized_gemv_kernel", LaunchedWith(quant_linear._quantized_gemv_kernel, INPUT=quant_linear.PLAIN.value)
    )
    unfolded = products()
    for got, want in zip(unfolded, folded):
        assert got.shape == want.shape and _relative_error(got.float(), want.double().cpu()) < 1e-5
    assert torch.equal(unfolded[1], folded[1]) and torch.equal(unfolded[5], folded[5])  # x + delta


def test_gated_norm_product_whose_groups_do_not_fit_the_tile():
    """One token's GDN output product with heads of 24 columns (not whole words of the column tile): the gated norm
    runs before the matrix-vector product (no fused input), with the reference's result."""
    from ninfer_offload.kernels import quant_linear

    gen = torch.Generator().manual_seed(21)
    data, weight, geometry = _random_object("q8_g32_fp16", 40, 96, seed=22)
    x, z = torch.randn(1, 4, 24, generator=gen, dtype=torch.float64), torch.randn(1, 4, 24, generator=gen, dtype=torch.float64)
    norm_w = torch.rand(24, generator=gen, dtype=torch.float64) + 0.5
    assert quant_linear.on_matrix_vector(geometry.n, 1)
    got = quant_linear.gated_norm_linear(x.float().to(DEVICE), z.float().to(DEVICE), norm_w.float().to(DEVICE), 1e-6, data, geometry)
    normed = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6) * norm_w * torch.nn.functional.silu(z)
    assert _relative_error(got, normed.reshape(1, 96) @ weight.double().T) < 1e-5


@pytest.mark.parametrize("sum_in_product", [True, False])
def test_paired_tiled_product_is_both_products_in_one_launch(sum_in_product, monkeypatch):
    """Past the matrix-vector kernel's tokens, a quantized and a dense matrix of one input (the shared expert's
    gate/up and the router) share one tiled launch: the quantized rows bit for bit the tiled product's, the dense
    rows the dense product's (to float32 summation order), the split-K arrival counts zero again."""
    from ninfer_offload.kernels import quant_linear
    from ninfer_offload.kernels.arrivals import arrival_counts

    monkeypatch.setattr(quant_linear, "SUM_IN_PRODUCT", sum_in_product)
    data, weight, geometry = _random_object("q8_g32_fp16", 40, 1024, seed=18)
    dense = torch.randn(45, 1024, generator=torch.Generator().manual_seed(19)).to(DEVICE)  # two row blocks, one partial
    x = torch.randn(12, 1024, generator=torch.Generator().manual_seed(20)).to(DEVICE)
    for t in (5, 12):
        assert not quant_linear.on_matrix_vector(geometry.n, t)
        yq, yd = quant_linear.paired_tiled(x[:t], data, geometry, dense)
        assert yq.shape == (t, 40) and yd.shape == (t, 45)
        assert torch.equal(yq, quant_linear.quantized_linear(x[:t], data, geometry))
        assert _relative_error(yq, x[:t].double().cpu() @ weight.double().T) < 1e-5
        assert _relative_error(yd, x[:t].double().cpu() @ dense.double().cpu().T) < 1e-5
    assert int(arrival_counts("quant_linear.split_k", DEVICE).abs().sum()) == 0
    with pytest.raises(ValueError, match="paired tiled product"):
        quant_linear.paired_tiled(torch.randn(65, 1024).to(DEVICE), data, geometry, dense)


@pytest.mark.parametrize("k,sum_in_product", [(256, True), (1024, True), (1024, False)])  # 1024: K split across programs
def test_tiled_products_take_their_input_step_and_gated_add(k, sum_in_product, monkeypatch):
    """A batched step's small products (5-64 tokens: the tiled kernel) with SwiGLU, the sigmoid gate or the gated
    norm of their input (computed before the launch) and the shared expert's gated add (in the launch where it
    stores, or an `add_gated` launch after it): the reference's input step, product and add."""
    from ninfer_offload.kernels import quant_linear
    from ninfer_offload.kernels.quant_linear import ADD_GATED, GATED_NORM, SIGMOID_GATE, STORE, SWIGLU

    monkeypatch.setattr(quant_linear, "SUM_IN_PRODUCT", sum_in_product)
    gen = torch.Generator().manual_seed(16)
    data, weight, geometry = _random_object("q5_g64_fp16", 40, k, seed=17)
    wide = torch.randn(8, 3 * k, generator=gen)
    norm_w, routed, score = torch.rand(64, generator=gen) + 0.5, torch.randn(8, 40, generator=gen), torch.randn(8, 3, generator=gen)[:, 1:2]
    x, x2 = wide[:, :k].double(), wide[:, 2 * k :].double()
    groups = x.reshape(8, -1, 64)
    normed = groups * torch.rsqrt(groups.pow(2).mean(-1, keepdim=True) + 1e-6) * norm_w.double()
    inputs = {SWIGLU: torch.nn.functional.silu(x) * x2, SIGMOID_GATE: x * torch.sigmoid(x2),
              GATED_NORM: (normed * torch.nn.functional.silu(x2.reshape(8, -1, 64))).reshape(8, k)}
    wide, norm_w, routed, score = wide.to(DEVICE), norm_w.to(DEVICE), routed.to(DEVICE), score.to(DEVICE)
    assert not quant_linear.on_matrix_vector(geometry.n, 8)
    for op, want in inputs.items():
        got = quant_linear.quantized_linear(wide[:, :k], data, geometry, wide[:, 2 * k :], op, norm_w=norm_w, eps=1e-6)
        assert _relative_error(got, want @ weight.double().T) < 1e-5, op

    tiled = quant_linear._quantized_matmul_kernel
    shared = {}
    for in_launch in (True, False):
        monkeypatch.setattr(quant_linear, "GATED_ADD_IN_TILED", in_launch)
        epilogue = ADD_GATED if in_launch and sum_in_product else STORE
        monkeypatch.setattr(quant_linear, "_quantized_matmul_kernel", LaunchedWith(tiled, EPILOGUE=epilogue.value))
        shared[in_launch] = quant_linear.quantized_linear(wide[:, :k], data, geometry, wide[:, 2 * k :], SWIGLU, routed, score)
    want = routed.double().cpu() + torch.sigmoid(score.double().cpu()) * (inputs[SWIGLU] @ weight.double().T)
    assert _relative_error(shared[True], want) < 1e-5
    torch.testing.assert_close(shared[True], shared[False], rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("tensor_cores", [False, True])
def test_paired_product_runs_the_conv_of_its_first_channels(tensor_cores, monkeypatch):
    """GDN's q/k/v/z product with the conv in its epilogue (one token per sequence): the first channels
    come out as `conv_update` gives them after the plain product, its windows advanced alike (a token
    with valid 0 leaves its window), the other channels and the dense rows as the plain product's."""
    from ninfer_offload.kernels import gdn, quant_linear

    monkeypatch.setattr(quant_linear, "MMA_MIN_ROWS", 1 if tensor_cores else quant_linear.MMA_MIN_ROWS)
    gen = torch.Generator().manual_seed(14)
    data, _, geometry = _random_object("q8_g32_fp16", 48, 256, seed=15)
    dense = torch.randn(5, 256, generator=gen).to(DEVICE)
    x = torch.randn(3, 256, generator=gen).to(DEVICE)
    channels, taps = 32, 4
    weight = torch.randn(taps, channels, generator=gen).to(DEVICE)
    states = torch.randn(4, taps - 1, channels, generator=gen).to(DEVICE)
    before = states.clone()
    slots, valid = torch.tensor([2, 0, 3], device=DEVICE), torch.tensor([1, 1, 0], device=DEVICE)
    plain, plain_dense = quant_linear.paired_gemv(x, data, geometry, dense)
    want_states = states.clone()
    want = torch.cat([gdn.conv_update(plain[:, :channels], want_states, weight, slots, valid, 1, None), plain[:, channels:]], dim=1)
    got, got_dense = quant_linear.paired_gemv(x, data, geometry, dense, conv=(states, weight, slots, valid, channels))
    assert torch.equal(got_dense, plain_dense) and torch.equal(got[:, channels:], plain[:, channels:])
    torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(states, want_states, rtol=0, atol=0)
    assert torch.equal(states[3], before[3]) and not torch.equal(states[2], before[2]) and torch.equal(states[1], before[1])


def test_sum_middle_is_a_float32_sum_then_cast():
    from ninfer_offload.kernels.reduce import sum_middle

    src = torch.randn(3, 5, 1500, generator=torch.Generator().manual_seed(3))
    out = sum_middle(src.to(DEVICE), torch.bfloat16)
    assert out.dtype == torch.bfloat16
    torch.testing.assert_close(out.cpu().float(), src.sum(1), rtol=8e-3, atol=1e-5)  # one bf16 rounding
