"""Dense (bf16/fp32) products of a few tokens, `y = x @ W^T`, as one matrix-vector kernel.

Reference op: `ReferenceBackend.linear(x, w)` with a dense `w`, i.e. `x @ w.T`. The dense products
of a decode step are small stacked control matrices (the router with the shared-expert score, GDN
a/b: `model/stacked.py`), which a library GEMM serves with more than one launch; here each program
owns a few rows, reads them once and multiplies them by every token's x in registers, with float32
accumulation. Above `GEMV_MAX_TOKENS` tokens: cuBLAS.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ninfer_offload.kernels.norm import offset_normed, residual_inv_rms, residual_sum

GEMV_MAX_TOKENS = 8
# Rows per program, widest column tile, warps (module-level so benchmarks can sweep them).
GEMV_BLOCK_N = 2
GEMV_BLOCK_K = 2048
GEMV_WARPS = 4


@triton.jit
def dense_gemv_rows(
    pid, x, x2, stride_x, stride_x2, norm_w, eps, w, out, T, N, K,
    BLOCK_T: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, ADD_NORM: tl.constexpr, ROW_BLOCK: tl.constexpr,
):
    """Rows [pid * BLOCK_N, (pid + 1) * BLOCK_N) of every token's product (also a part of
    `quant_linear.paired_gemv`); with ADD_NORM the input is (1 + norm_w) * rmsnorm(x + x2), each
    token's statistic over its whole rows (ROW_BLOCK >= K columns), as `add_rmsnorm` computes it."""
    rows = pid * BLOCK_N + tl.arange(0, BLOCK_N).to(tl.int64)
    row_mask = rows < N
    toks = tl.arange(0, BLOCK_T)
    acc = tl.zeros([BLOCK_T, BLOCK_N], dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        cols = k0 + tl.arange(0, BLOCK_K)
        col_mask = cols < K
        tile = tl.load(w + rows[:, None] * K + cols[None, :], mask=row_mask[:, None] & col_mask[None, :], other=0.0).to(tl.float32)
        for t in tl.static_range(BLOCK_T):  # the rows are read once for every token
            token = tl.minimum(t, T - 1).to(tl.int64)  # rows past T repeat the last (never stored)
            xv = tl.load(x + token * stride_x + cols, mask=col_mask, other=0.0)
            xk = xv.to(tl.float32)
            if ADD_NORM:
                inv_rms = residual_inv_rms(x + token * stride_x, x2 + token * stride_x2, K, eps, ROW_BLOCK)
                dv = tl.load(x2 + token * stride_x2 + cols, mask=col_mask, other=0.0)
                wv = tl.load(norm_w + cols, mask=col_mask, other=0.0)
                xk = offset_normed(residual_sum(xv, dv), inv_rms, wv).to(xv.dtype).to(tl.float32)
            part = tl.sum(tile * xk[None, :], axis=1)
            acc = tl.where(toks[:, None] == t, acc + part[None, :], acc)
    optr = out + toks[:, None].to(tl.int64) * N + rows[None, :]
    tl.store(optr, acc.to(out.dtype.element_ty), mask=(toks < T)[:, None] & row_mask[None, :])


@triton.jit
def _dense_gemv_kernel(x, w, out, T, N, K, stride_x, BLOCK_T: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    dense_gemv_rows(tl.program_id(0), x, x, stride_x, stride_x, x, 0.0, w, out, T, N, K, BLOCK_T, BLOCK_N, BLOCK_K, False, 1)


def dense_linear(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """x [T, k] @ w[n, k]^T -> [T, n] in x's dtype."""
    t, k = x.shape
    if k != w.shape[1]:
        raise ValueError(f"input has {k} columns, weight expects {w.shape[1]}")
    if t > GEMV_MAX_TOKENS:
        return x @ w.T
    x, w = x.contiguous(), w.contiguous()
    n = w.shape[0]
    out = torch.empty(t, n, device=x.device, dtype=x.dtype)
    _dense_gemv_kernel[(triton.cdiv(n, GEMV_BLOCK_N),)](
        x, w, out, t, n, k, x.stride(0),
        BLOCK_T=triton.next_power_of_2(t), BLOCK_N=GEMV_BLOCK_N, BLOCK_K=min(GEMV_BLOCK_K, triton.next_power_of_2(k)),
        num_warps=GEMV_WARPS,
    )
    return out
