"""Fixed-order sum over the middle axis with the cast to the output dtype, in one launch.

Used to combine split-K partial products and the k routed-expert outputs of each token; it
replaces a `sum` followed by a cast (two kernels) inside every decode-step linear and MoE block.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _sum_middle_kernel(src, out, S, C, BLOCK: tl.constexpr):
    r = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < C
    acc = tl.zeros([BLOCK], dtype=tl.float32)
    for s in range(S):
        acc += tl.load(src + (r * S + s) * C + cols, mask=mask, other=0.0).to(tl.float32)
    tl.store(out + r * C + cols, acc.to(out.dtype.element_ty), mask=mask)


def sum_middle(src: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """src [R, S, C] (contiguous) -> sum over S in float32, as [R, C] in `dtype`."""
    r, s, c = src.shape
    out = torch.empty(r, c, device=src.device, dtype=dtype)
    block = 1024
    _sum_middle_kernel[(r, triton.cdiv(c, block))](src.contiguous(), out, s, c, BLOCK=block)
    return out
