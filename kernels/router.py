"""Router head in one kernel: fp32 softmax over expert logits, top-k, renormalised weights.

Reference op: `ReferenceBackend.route` (the logits product before it is a plain linear).
Top-k is taken by k rounds of one max over int64 keys (a probability's bits over its id's complement:
ties go to the lowest expert id, like `torch.topk` on distinct values), in one warp; the
renormalisation divides by the sum of the chosen probabilities.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ninfer_offload.kernels.launch import await_producer, launch_options


@triton.jit
def _softmax_topk_kernel(
    logits, ids, weights, E, stride, TOP_K: tl.constexpr, K_PAD: tl.constexpr, BLOCK_E: tl.constexpr, PDL: tl.constexpr
):
    await_producer(PDL)
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK_E)
    mask = cols < E
    z = tl.load(logits + row * stride + cols, mask=mask, other=float("-inf")).to(tl.float32)
    p = tl.exp(z - tl.max(z))
    p = p / tl.sum(p)
    # One int64 key per expert: the probability's bits (non-negative floats order as their bits) over
    # the complement of its id, so one max picks the largest probability and, among equal ones, the
    # lowest id. Padding lanes get -1.
    key = tl.where(mask, (p.to(tl.int32, bitcast=True).to(tl.int64) << 32) | (BLOCK_E - 1 - cols), -1)
    slots = tl.arange(0, K_PAD)
    chosen = tl.zeros([K_PAD], dtype=tl.int64)
    for j in tl.static_range(TOP_K):
        best = tl.max(key)
        chosen = tl.where(slots == j, best, chosen)
        key = tl.where(key == best, -1, key)
    keep = slots < TOP_K
    chosen_p = tl.where(keep, (chosen >> 32).to(tl.int32).to(tl.float32, bitcast=True), 0.0)
    tl.store(ids + row * TOP_K + slots, BLOCK_E - 1 - (chosen & 0xFFFFFFFF), mask=keep)
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
            logits, ids, weights, e, logits.stride(0), TOP_K=top_k, K_PAD=triton.next_power_of_2(top_k), BLOCK_E=triton.next_power_of_2(e),
            num_warps=1,  # every reduction stays inside one warp (shuffles, no shared-memory round trip)
            **launch_options(logits.device),
        )
    return ids, weights
