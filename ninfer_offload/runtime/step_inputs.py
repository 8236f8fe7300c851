"""Step inputs on the device: token ids and the step context, packed into one int64 buffer so that
a step costs one host-to-device copy (eager steps copy into a fresh buffer, captured steps into
their graph's static one).

Layout of the buffer for B sequences of T tokens: tokens [B*T] | positions [B*T] | KV rows [B*T] |
slots [B] | lengths [B] | valid [B].
"""

from __future__ import annotations

import torch

from ninfer_offload.model.context import StepContext


def pack_inputs(
    tokens: list[int], slots: list[int], starts: list[int], tokens_per_sequence: int, capacity: int, pinned: bool = False,
    valid: list[int] | None = None,
) -> torch.Tensor:
    """Host int64 buffer of one step: `tokens` (T per sequence, sequence-major) added to the
    sequences in `slots` that hold `starts` tokens; in pinned memory when `pinned` (its upload is then
    queued without waiting for the device). `valid`: how many of each sequence's T tokens are real
    (default all); the others are padding, computed but leaving no GDN state behind."""
    t = tokens_per_sequence
    positions = [start + i for start in starts for i in range(t)]
    rows = [slot * capacity + start + i for slot, start in zip(slots, starts) for i in range(t)]
    lengths = [start + t for start in starts]
    valid = [t] * len(slots) if valid is None else valid
    return torch.tensor(tokens + positions + rows + list(slots) + lengths + valid, dtype=torch.int64, pin_memory=pinned)


def unpack_inputs(
    packed: torch.Tensor,
    batch: int,
    tokens_per_sequence: int,
    prefill: bool,
    keep_states: bool,
    host: tuple[tuple[int, ...], tuple[int, ...]] | None,
    staged: bool = False,
    stage_tokens: int = 0,
    span_row: int = 0,
) -> tuple[torch.Tensor, StepContext]:
    """(token ids [B*T], context) as views of a packed device buffer; `host` = (slots, starts) on the
    host, or None for a captured step; `staged`, `stage_tokens`, `span_row`: as `StepContext`'s."""
    n = batch * tokens_per_sequence
    tokens, positions, rows = packed[:n], packed[n : 2 * n], packed[2 * n : 3 * n]
    slots, lengths = packed[3 * n : 3 * n + batch], packed[3 * n + batch : 3 * n + 2 * batch]
    ctx = StepContext(
        positions=positions,
        slots=slots,
        lengths=lengths,
        valid=packed[3 * n + 2 * batch : 3 * n + 3 * batch],
        kv_rows=rows,
        tokens_per_sequence=tokens_per_sequence,
        prefill=prefill,
        keep_states=keep_states,
        host_slots=None if host is None else host[0],
        host_starts=None if host is None else host[1],
        staged=staged,
        stage_tokens=stage_tokens,
        span_row=span_row,
    )
    return tokens, ctx


def step_inputs(
    tokens: list[int],
    slots: list[int],
    starts: list[int],
    tokens_per_sequence: int,
    capacity: int,
    device: torch.device,
    prefill: bool = False,
    keep_states: bool = False,
    valid: list[int] | None = None,
    staged: bool = False,
    stage_tokens: int = 0,
    span_row: int = 0,
) -> tuple[torch.Tensor, StepContext]:
    """Token ids and context of an eager step, on `device` with one copy (`valid`: as `pack_inputs`; `staged`: a
    prompt chunk of the target whose host experts the store stages, `StepContext.staged`; `stage_tokens`,
    `span_row`: where it is one chunk of a span, as `StepContext`'s)."""
    packed = pack_inputs(tokens, slots, starts, tokens_per_sequence, capacity, pinned=device.type == "cuda", valid=valid)
    packed = packed.to(device, non_blocking=True)
    host = (tuple(slots), tuple(starts))
    return unpack_inputs(
        packed, len(slots), tokens_per_sequence, prefill, keep_states, host, staged, stage_tokens, span_row
    )


def upload(tensor: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A small host tensor on `device`, in stream order; on CUDA through pinned memory, queued without
    waiting for the device (the store's table updates, the server's token ids)."""
    if device.type != "cuda":
        return tensor.to(device)
    return tensor.pin_memory().to(device, non_blocking=True)
