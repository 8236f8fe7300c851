"""Router head in one kernel: fp32 softmax over expert logits, top-k, renormalised weights.

Reference op: `ReferenceBackend.route` (the logits product before it is a plain linear).
Top-k is taken by k rounds of arg-max (ties go to the lowest expert id, like `torch.topk` on
distinct values); the renormalisation divides by the sum of the chosen probabilities.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _softmax_topk_kernel(logits, ids, weights, E, stride, TOP_K: tl.constexpr, K_PAD: tl.constexpr, BLOCK_E: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK_E)
    mask = cols < E
    z = tl.load(logits + row * stride + cols, mask=mask, other=float("-inf")).to(tl.float32)
    p = tl.exp(z - tl.max(z))
    p = p / tl.sum(p)
    p = tl.where(mask, p, -1.0)
    slots = tl.arange(0, K_PAD)
    chosen_ids = tl.zeros([K_PAD], dtype=tl.int64)
    chosen_p = tl.zeros([K_PAD], dtype=tl.float32)
    for j in tl.static_range(TOP_K):
        best = tl.max(p)
        idx = tl.min(tl.where(p == best, cols, BLOCK_E))
        chosen_ids = tl.where(slots == j, idx.to(tl.int64), chosen_ids)
        chosen_p = tl.where(slots == j, best, chosen_p)
        p = tl.where(cols == idx, -1.0, p)
    keep = slots < TOP_K
    tl.store(ids + row * TOP_K + slots, chosen_ids, mask=keep)
    tl.store(weights + row * TOP_K + slots, (chosen_p / tl.sum(chosen_p)).to(weights.dtype.element_ty), mask=keep)


def softmax_topk(logits: torch.Tensor, top_k: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """(ids int64 [T, k], weights [T, k] in `dtype`) from router logits [T, E] (rows may be strided: a
    column slice of the product that also holds the shared-expert score)."""
    t, e = logits.shape
    if logits.stride(1) != 1:
        logits = logits.contiguous()
    ids = torch.empty(t, top_k, dtype=torch.int64, device=logits.device)
    weights = torch.empty(t, top_k, dtype=dtype, device=logits.device)
    if t:
        _softmax_topk_kernel[(t,)](
            logits, ids, weights, e, logits.stride(0), TOP_K=top_k, K_PAD=triton.next_power_of_2(top_k), BLOCK_E=triton.next_power_of_2(e)
        )
    return ids, weights
