"""L2 prefetch of weights a later kernel will read: bulk prefetches issued, nothing waited for.

A decode step reads its weights in small products separated by latency-bound kernels (routing,
recurrences, attention over a short cache) during which the memory sits mostly idle. A kernel that
issues `cp.async.bulk.prefetch.L2` (sm_90+) for the next product's bytes and exits lets that
product find its weights in L2. No reference op: a prefetch changes no value, only where the bytes
are read from; its test checks the ranges it covers and that results are unchanged.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

# Bytes per bulk prefetch instruction (a multiple of 16) and instructions per program.
CHUNK = 1 << 16
CHUNKS_PER_PROGRAM = 4


@triton.jit
def _bulk_prefetch(address, size):
    """cp.async.bulk.prefetch.L2 of `size` bytes at `address` (both multiples of 16; size 0: nothing)."""
    return tl.inline_asm_elementwise(
        "{ .reg .pred p; setp.ne.u32 p, $2, 0; @p cp.async.bulk.prefetch.L2.global [$1], $2; mov.u32 $0, 0; }",
        "=r,l,r",
        [address, size],
        dtype=tl.int32,
        is_pure=False,
        pack=1,
    )


@triton.jit
def _l2_prefetch_kernel(ranges, sink, RANGES: tl.constexpr, CHUNK: tl.constexpr, PER_PROGRAM: tl.constexpr):
    """Program p prefetches chunks [p * PER_PROGRAM, (p + 1) * PER_PROGRAM) of each range (address, bytes)."""
    pid = tl.program_id(0)
    chunk = pid * PER_PROGRAM + tl.arange(0, PER_PROGRAM).to(tl.int64)
    for r in tl.static_range(RANGES):
        base = tl.load(ranges + 2 * r)
        nbytes = tl.load(ranges + 2 * r + 1)
        start = chunk * CHUNK
        size = tl.minimum(tl.maximum(nbytes - start, 0), CHUNK).to(tl.int32)
        done = _bulk_prefetch(base + start, size)
        tl.store(sink + chunk, done, mask=done != 0)  # never stored: keeps the prefetch


class L2Prefetch:
    """Bulk L2 prefetches of fixed byte ranges (tensors' storage rounded to 16-byte bounds), one launch each call."""

    def __init__(self, tensors: list[torch.Tensor]):
        rows = []
        for t in tensors:
            start = t.data_ptr() & ~15
            end = (t.data_ptr() + t.numel() * t.element_size() + 15) & ~15
            rows.append((start, end - start))
        self.nbytes = sum(size for _, size in rows)
        self.ranges = torch.tensor(rows, dtype=torch.int64, device=tensors[0].device)
        self.programs = triton.cdiv(triton.cdiv(max(size for _, size in rows), CHUNK), CHUNKS_PER_PROGRAM)
        self.sink = torch.zeros(self.programs * CHUNKS_PER_PROGRAM, dtype=torch.int32, device=self.ranges.device)

    def __call__(self) -> None:
        """Issue the prefetches and return (no host sync: capturable)."""
        _l2_prefetch_kernel[(self.programs,)](
            self.ranges, self.sink, RANGES=self.ranges.shape[0], CHUNK=CHUNK, PER_PROGRAM=CHUNKS_PER_PROGRAM, num_warps=1
        )
