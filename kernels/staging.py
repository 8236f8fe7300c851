"""Staging a prefill chunk's host experts: copying their records into VRAM slots, one launch per layer.

`gather_records` reads each listed expert's record where the layer's table points (host memory mapped
for the device: a read over PCIe) and writes it into its slot; the few programs the caller asks for walk
the (record, block) pairs, so the copy takes a few SMs beside the kernels that compute meanwhile. Its
reference op is `runtime.prefill_staging.gather_records_reference`.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

BLOCK = 2048  # words per load (16 KiB in flight per program)


@triton.jit
def _gather_records_kernel(arena, table, experts, slots, n, words, WORD: tl.constexpr, BLOCK: tl.constexpr):
    blocks = tl.cdiv(words, BLOCK)
    for item in range(tl.program_id(0), n * blocks, tl.num_programs(0)):
        i = item // blocks
        w = (item % blocks) * BLOCK + tl.arange(0, BLOCK).to(tl.int64)
        src = arena + tl.multiple_of(tl.load(table + tl.load(experts + i)), 256)  # record offsets are 256-aligned
        dst = arena + tl.multiple_of(tl.load(slots + i), 256)
        if WORD == 8:
            src_words, dst_words = src.to(tl.pointer_type(tl.int64)), dst.to(tl.pointer_type(tl.int64))
        else:
            src_words, dst_words = src, dst
        tl.store(dst_words + w, tl.load(src_words + w, mask=w < words), mask=w < words)


def gather_records(
    arena: torch.Tensor,
    table: torch.Tensor,
    experts: torch.Tensor,
    slots: torch.Tensor,
    nbytes: int,
    programs: int,
) -> None:
    """For each i: arena[slots[i] : slots[i] + nbytes] = the record table[experts[i]] points at,
    by at most `programs` programs (SMs taken from the kernels running meanwhile)."""
    word = 8 if nbytes % 8 == 0 else 1
    n = experts.numel()
    grid = max(1, min(programs, n * triton.cdiv(nbytes // word, BLOCK)))
    _gather_records_kernel[(grid,)](arena, table, experts, slots, n, nbytes // word, WORD=word, BLOCK=BLOCK, num_warps=8)
