"""Staging a prefill chunk's host experts: which ones get the slots, and copying their records, one launch each.

`choose_staged` (one program) counts the chunk's uses per expert, ranks the used experts whose table
offsets fall outside the arena by uses (a sort of packed keys, ties to the lower id), gives the first
ones the slots and writes the table copy pointing at them, the staged mask, the per-slot lists and the
use counters; its reference op is `runtime.prefill_staging.choose_staged_reference` (the same choice
in a dozen torch ops). `gather_records` reads each chosen expert's record where the layer's table
points (host memory mapped for the device: a read over PCIe) and writes it into its slot; the few
programs the caller asks for walk the (record, block) pairs, so the copy takes a few SMs beside the
kernels that compute meanwhile. Which experts and slots are device tensors: nothing is decided on the
host. Its reference op is `runtime.prefill_staging.gather_records_reference`.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

BLOCK = 2048  # words per load (16 KiB in flight per program)
IDS_BLOCK = 1024  # routing ids counted per step of `choose_staged`


@triton.jit
def _choose_staged_kernel(
    ids, n, table, arena_bytes, offsets, slots_count, table_out, staged, experts_out, valid_out, uses, staged_uses,
    staged_records, left, E, BLOCK_E: tl.constexpr, IDS_BLOCK: tl.constexpr,
):
    e = tl.arange(0, BLOCK_E)
    counts = tl.zeros([BLOCK_E], dtype=tl.int32)
    for start in range(0, n, IDS_BLOCK):
        at = start + tl.arange(0, IDS_BLOCK)
        inside = at < n
        counts += tl.histogram(tl.load(ids + at, mask=inside, other=0).to(tl.int32), BLOCK_E)
        counts -= tl.where(e == 0, tl.sum((~inside).to(tl.int32)), 0)  # the padding counted as expert 0
    real = e < E
    tl.store(uses + e, tl.load(uses + e, mask=real, other=0) + counts, mask=real)
    offset = tl.load(table + e, mask=real, other=0)
    missing = real & (counts > 0) & ((offset < 0) | (offset >= arena_bytes))
    key = tl.where(real, tl.where(missing, counts, 0) * BLOCK_E + (BLOCK_E - 1 - e), -1)  # distinct keys
    ranked = tl.sort(key, descending=True)
    expert = BLOCK_E - 1 - ranked % BLOCK_E
    used = ranked // BLOCK_E
    rank = e
    taken = rank < slots_count  # (slots_count <= E: only real experts)
    valid = taken & (used > 0)
    slot = tl.load(offsets + rank, mask=taken, other=0)
    tl.store(experts_out + rank, expert.to(tl.int64), mask=taken)
    tl.store(valid_out + rank, valid.to(tl.int1), mask=taken)
    tl.store(table_out + e, offset, mask=real)
    tl.store(staged + e, tl.zeros([BLOCK_E], dtype=tl.int1), mask=real)
    tl.debug_barrier()  # the copies above land before the staged experts' entries overwrite them
    tl.store(table_out + expert, slot, mask=valid)
    tl.store(staged + expert, valid.to(tl.int1), mask=valid)
    tl.store(staged_uses + expert, tl.load(staged_uses + expert, mask=valid, other=0) + used.to(tl.int32), mask=valid)
    tl.store(staged_records + expert, tl.load(staged_records + expert, mask=valid, other=0) + 1, mask=valid)
    tl.store(left, tl.sum(missing.to(tl.int32)) > tl.sum(valid.to(tl.int32)))


def choose_staged(
    topk_ids: torch.Tensor, table: torch.Tensor, arena_bytes: int, offsets: torch.Tensor, uses: torch.Tensor,
    staged_uses: torch.Tensor, staged_records: torch.Tensor,
) -> tuple[torch.Tensor, ...]:
    """`runtime.prefill_staging.choose_staged_reference` in one launch (int32 counters): the fields of its
    `StagingChoice`, in order (the i-th chosen expert gets the slot at `offsets[i]`)."""
    experts, device = table.numel(), table.device
    count = min(offsets.numel(), experts)
    chosen, staged = torch.empty_like(table), torch.empty(experts, dtype=torch.bool, device=device)
    slot_experts, valid = torch.empty(count, dtype=torch.int64, device=device), torch.empty(count, dtype=torch.bool, device=device)
    left = torch.empty((), dtype=torch.bool, device=device)
    ids = topk_ids.reshape(-1).contiguous()
    _choose_staged_kernel[(1,)](
        ids, ids.numel(), table, arena_bytes, offsets, count, chosen, staged, slot_experts, valid, uses, staged_uses,
        staged_records, left, experts, BLOCK_E=triton.next_power_of_2(experts), IDS_BLOCK=IDS_BLOCK, num_warps=4,
    )
    return chosen, staged, slot_experts, offsets[:count], valid, left


@triton.jit
def _gather_records_kernel(arena, table, experts, slots, valid, n, words, WORD: tl.constexpr, BLOCK: tl.constexpr):
    blocks = tl.cdiv(words, BLOCK)
    for item in range(tl.program_id(0), n * blocks, tl.num_programs(0)):
        i = item // blocks
        if tl.load(valid + i) != 0:
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
    valid: torch.Tensor,
    nbytes: int,
    programs: int,
) -> None:
    """For each i with valid[i]: arena[slots[i] : slots[i] + nbytes] = the record table[experts[i]] points at,
    by at most `programs` programs (SMs taken from the kernels running meanwhile)."""
    word = 8 if nbytes % 8 == 0 else 1
    n = experts.numel()
    grid = max(1, min(programs, n * triton.cdiv(nbytes // word, BLOCK)))
    _gather_records_kernel[(grid,)](arena, table, experts, slots, valid, n, nbytes // word, WORD=word, BLOCK=BLOCK, num_warps=8)
