"""Router head in one kernel: fp32 softmax over expert logits, top-k, renormalised weights.

Reference op: `ReferenceBackend.route` (the logits product before it is a plain linear).
Top-k is taken by k rounds of one max over int64 keys (a probability's bits over its id's complement:
ties go to the lowest expert id, like `torch.topk` on distinct values), in one warp; the
renormalisation divides by the sum of the chosen probabilities.

Given the bank of expert records the routed experts read next (a decode step's few tokens), the kernel also
asks L2 for the chosen experts' gate/up objects (`launch.prefetch_lines`): a program per token and share of an
object, each computing the same top-k, so the gate/up kernel after it finds its weights in L2 or on their way.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ninfer_offload.artifact.records import ExpertRecordLayout
from ninfer_offload.kernels.launch import await_producer, compiled, launch_options, prefetch_lines
from ninfer_offload.model.experts import ExpertBank

# Up to this many tokens, the router asks L2 for the chosen experts' gate/up objects (8 tokens of random routing
# would ask for ~60 objects, more than the H200's L2), each program for LINES 128-byte lines of each.
# Module-level for A/B (`PREFETCH_MAX_TOKENS = 0`: never).
PREFETCH_MAX_TOKENS = 4
PREFETCH_LINES = 64


@triton.jit
def _softmax_topk_kernel(
    logits, ids, weights, E, stride, arena, table, object_bytes,
    TOP_K: tl.constexpr, K_PAD: tl.constexpr, BLOCK_E: tl.constexpr, LINES: tl.constexpr, PDL: tl.constexpr,
):
    """Row `program_id(0)`'s top-k into `ids` / `weights` (by the first program of the row); with LINES, each
    program asks L2 for share `program_id(1)` (LINES lines) of each chosen expert's first `object_bytes` bytes of
    its record (`arena` + `table[e]`)."""
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
    expert = BLOCK_E - 1 - (chosen & 0xFFFFFFFF)
    if tl.program_id(1) == 0:
        tl.store(ids + row * TOP_K + slots, expert, mask=keep)
        tl.store(weights + row * TOP_K + slots, (chosen_p / tl.sum(chosen_p)).to(weights.dtype.element_ty), mask=keep)
    if LINES > 0:
        records = arena + tl.load(table + expert, mask=keep, other=0)
        lines = tl.minimum(tl.program_id(1).to(tl.int64) * (LINES * 128) + tl.arange(0, LINES) * 128, object_bytes - 1)
        prefetch_lines(records[:, None] + lines[None, :])


def softmax_topk(
    logits: torch.Tensor, top_k: int, dtype: torch.dtype, experts: ExpertBank | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """(ids int64 [T, k], weights [T, k] in `dtype`) from router logits [T, E] (rows may be strided: a
    column slice of the product that also holds the shared-expert score). Given `experts` (records the routed
    experts read next) and at most PREFETCH_MAX_TOKENS rows, the chosen experts' gate/up objects are asked into L2."""
    t, e = logits.shape
    if logits.stride(1) != 1:
        logits = logits.contiguous()
    ids = torch.empty(t, top_k, dtype=torch.int64, device=logits.device)
    weights = torch.empty(t, top_k, dtype=dtype, device=logits.device)
    prefetch = (
        experts is not None and isinstance(experts.layout, ExpertRecordLayout) and t <= PREFETCH_MAX_TOKENS and compiled(logits.device)
    )
    object_bytes = experts.layout.gate_up.encoded_size if prefetch else 1
    arena, table = (experts.arena, experts.offsets) if prefetch else (logits, ids)
    if t:
        _softmax_topk_kernel[(t, triton.cdiv(object_bytes, PREFETCH_LINES * 128) if prefetch else 1)](
            logits, ids, weights, e, logits.stride(0), arena, table, object_bytes, TOP_K=top_k, K_PAD=triton.next_power_of_2(top_k),
            BLOCK_E=triton.next_power_of_2(e), LINES=PREFETCH_LINES if prefetch else 0,
            num_warps=1,  # every reduction stays inside one warp (shuffles, no shared-memory round trip)
            **launch_options(logits.device),
        )
    return ids, weights
