"""Device side of the CPU miss path's hand-off (`runtime.miss_handoff`): two kernels around a layer's
routed experts that exchange work with the host through mapped pinned memory, with no host sync,
so a step that uses them is still one CUDA graph.

`publish` decides which (token, expert) assignments the host computes (expert not in VRAM, taken
by the host per `take`, and used by at most `host_max_uses` rows of the call: its uses are counted by
comparing its id with every pair's), gives the device's routed-experts kernels the others (host
assignments become zero-weight uses of `anchor`, an expert in VRAM), writes the host's work into
the layer's mailbox (assignments, weights, the activations as float32) and, only if there is any,
raises the layer's request counter with a system-scope release store the host polls. `collect`
waits (volatile loads of the host's answer counter) for the answer to that request and adds the
host's float32 rows into the routed output. A layer without host work costs the two small
launches and no round trip. The reference ops are `runtime.miss_handoff.publish_reference` /
`collect_reference`.

Host memory is reached as byte offsets from a device tensor (`base`), as the MoE kernels reach
host expert records.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

# int64 words of a layer's mailbox header (`runtime.miss_handoff` names the same ones)
READY, TOKENS, DONE, FAILED = tl.constexpr(0), tl.constexpr(1), tl.constexpr(8), tl.constexpr(9)
SPIN_LIMIT = 1 << 24  # answer-counter reads before `collect` gives up (seconds), flags FAILED and adds NaN


@triton.jit
def _publish_kernel(
    x, ids, weights, table, take, host_max_uses, anchor, device_ids, device_weights, cpu_uses, state, base,
    header_offset, data_offset, arena_bytes, stride_x, T, H, ids_at, weights_at, x_at,
    TOP_K: tl.constexpr, BLOCK_P: tl.constexpr, BLOCK_Q: tl.constexpr, BLOCK_H: tl.constexpr,
):
    pairs = T * TOP_K
    p = tl.arange(0, BLOCK_P)
    valid = p < pairs
    e = tl.load(ids + p, mask=valid, other=0)
    offset = tl.load(table + e, mask=valid, other=0)
    in_vram = (offset >= 0) & (offset < arena_bytes)
    uses = tl.zeros([BLOCK_P], dtype=tl.int32)  # per pair, the pairs of the call routed to its expert
    for q0 in range(0, pairs, BLOCK_Q):
        q = q0 + tl.arange(0, BLOCK_Q)
        other = tl.load(ids + q, mask=q < pairs, other=-1)
        uses += tl.sum((e[:, None] == other[None, :]).to(tl.int32), axis=1)
    few = uses <= tl.load(host_max_uses)
    host = valid & (tl.load(take + e, mask=valid, other=0) != 0) & ~in_vram & few
    w = tl.load(weights + p, mask=valid, other=0.0)
    tl.store(device_ids + p, tl.where(host, tl.load(anchor), e), mask=valid)
    tl.store(device_weights + p, tl.where(host, 0.0, w), mask=valid)
    work = tl.max(host.to(tl.int32), axis=0)
    tl.store(state + 1, work.to(tl.int64))
    if work > 0:
        tl.atomic_add(cpu_uses + e, 1, mask=host)
        data = base + data_offset
        tl.store((data + ids_at).to(tl.pointer_type(tl.int32)) + p, tl.where(host, e, -1).to(tl.int32), mask=valid)
        tl.store((data + weights_at).to(tl.pointer_type(tl.float32)) + p, w.to(tl.float32), mask=valid)
        box_x = (data + x_at).to(tl.pointer_type(tl.float32))
        for t in range(T):
            for h0 in range(0, H, BLOCK_H):
                h = h0 + tl.arange(0, BLOCK_H)
                row = tl.load(x + t * stride_x + h, mask=h < H, other=0.0)
                tl.store(box_x + t * H + h, row.to(tl.float32), mask=h < H)
        ticket = tl.load(state) + 1
        tl.store(state, ticket)
        header = (base + header_offset).to(tl.pointer_type(tl.int64))
        tl.store(header + TOKENS, tl.zeros([], tl.int64) + T)
        tl.debug_barrier()  # every thread's writes above come before the release below
        tl.atomic_xchg(header + READY, ticket, sem="release", scope="sys")


@triton.jit
def _collect_kernel(
    out, state, base, header_offset, data_offset, stride_out, T, H, out_at, spin_limit, BLOCK_H: tl.constexpr,
):
    if tl.load(state + 1) != 0:
        header = (base + header_offset).to(tl.pointer_type(tl.int64))
        ticket = tl.load(state)
        answer = tl.load(header + DONE, volatile=True)
        spins = 0
        while (answer != ticket) & (spins < spin_limit):
            answer = tl.load(header + DONE, volatile=True)
            spins += 1
        answered = answer == ticket
        if not answered:
            tl.store(header + FAILED, 1)
        h = tl.program_id(0) * BLOCK_H + tl.arange(0, BLOCK_H)
        box_out = (base + data_offset + out_at).to(tl.pointer_type(tl.float32))
        for t in range(T):
            part = tl.load(box_out + t * H + h, mask=h < H, other=0.0, volatile=True)
            part = tl.where(answered, part, float("nan"))
            row = tl.load(out + t * stride_out + h, mask=h < H, other=0.0).to(tl.float32)
            tl.store(out + t * stride_out + h, (row + part).to(out.dtype.element_ty), mask=h < H)


def publish(
    x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor, table: torch.Tensor, take: torch.Tensor,
    host_max_uses: torch.Tensor, anchor: torch.Tensor, cpu_uses: torch.Tensor, state: torch.Tensor, base: torch.Tensor, header_offset: int,
    data_offset: int, regions,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(device ids, device weights) [T, k] for the routed-experts kernels; the host's share of the
    assignments published to the mailbox at `header_offset` / `data_offset` (bytes from `base`).
    take: int8 [E] and host_max_uses: int32 [1] (the host computes an expert not in VRAM when take is nonzero and
    at most host_max_uses pairs of the call are routed to it); anchor: int64 [1];
    base: the expert arena (uint8: its size tells VRAM offsets from host ones);
    cpu_uses: int32 [E], counts the host's assignments; state: int64 [2] (requests published,
    whether this call published one); regions: the mailbox's `MailboxRegions`."""
    t, k = topk_ids.shape
    device_ids, device_weights = torch.empty_like(topk_ids), torch.empty_like(topk_weights)
    _publish_kernel[(1,)](
        x, topk_ids.contiguous(), topk_weights.contiguous(), table, take, host_max_uses, anchor, device_ids, device_weights, cpu_uses,
        state, base, header_offset, data_offset, base.numel(), x.stride(0), t, x.shape[1], regions.ids_at,
        regions.weights_at, regions.x_at, TOP_K=k, BLOCK_P=triton.next_power_of_2(t * k), BLOCK_Q=16, BLOCK_H=1024,
        num_warps=4,
    )
    return device_ids, device_weights


def collect(
    out: torch.Tensor, state: torch.Tensor, base: torch.Tensor, header_offset: int, data_offset: int, regions,
    spin_limit: int = SPIN_LIMIT,
) -> torch.Tensor:
    """out [T, H] += the host's rows for the request `publish` made (in place; nothing without one)."""
    t, h = out.shape
    block = 512
    _collect_kernel[(triton.cdiv(h, block),)](
        out, state, base, header_offset, data_offset, out.stride(0), t, h, regions.out_at, spin_limit, BLOCK_H=block, num_warps=4,
    )
    return out
