"""The mailbox through which a step hands missing experts to the host without a host sync.

Per MoE layer, pinned host memory (mapped into the device's address space on CUDA) holds a header
of int64 words and a data region: the host's assignments (expert id, or -1 for the device's),
their weights, the activations and the host's answer, all float32 / int32. The device side
(`publish`, `collect`: Triton kernels on CUDA, the reference ops below elsewhere) writes a request
and raises the header's READY counter; the host worker (`runtime.cpu_experts.CpuMissPath`) sees
READY != DONE, computes, writes the answer and sets DONE = READY; `collect` waits for that and
adds the answer. Counters only grow, one request per layer is open at a time, and a layer with no
host work raises nothing, so the host sees exactly the requests to answer. Steps of more than
`HANDOFF_TOKENS` tokens do not use the mailbox (the device reads their misses over PCIe).
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import numpy as np
import torch

from ninfer_offload.errors import NinferError
from ninfer_offload.runtime.memory_check import host_tensor

HANDOFF_TOKENS = 64  # most tokens of a forward whose misses go to the host
HEADER_WORDS = 16  # int64 per layer header: READY and DONE in separate 64-byte lines
READY, TOKENS, DONE, FAILED = 0, 1, 8, 9  # the same words as `kernels.miss_handoff`
ANSWER_TIMEOUT_S = 30.0  # the reference `collect`'s wait (the kernel's is its spin limit)
_ALIGN = 256


def _aligned(n: int) -> int:
    return -(-n // _ALIGN) * _ALIGN


@dataclass(frozen=True)
class MailboxRegions:
    """Byte offsets of the arrays inside one layer's data region."""

    tokens: int
    top_k: int
    hidden: int

    @property
    def ids_at(self) -> int:
        return 0

    @property
    def weights_at(self) -> int:
        return _aligned(self.tokens * self.top_k * 4)

    @property
    def x_at(self) -> int:
        return 2 * _aligned(self.tokens * self.top_k * 4)

    @property
    def out_at(self) -> int:
        return self.x_at + _aligned(self.tokens * self.hidden * 4)

    @property
    def nbytes(self) -> int:
        return self.out_at + _aligned(self.tokens * self.hidden * 4)


class Mailbox:
    """Headers [layers, HEADER_WORDS] and data regions of every MoE layer, plus the device-side
    state [layers, 2] (requests published, whether the current call published one)."""

    def __init__(self, layers: int, top_k: int, hidden: int, device: torch.device, tokens: int = HANDOFF_TOKENS):
        pinned = device.type == "cuda"
        self.regions = MailboxRegions(tokens, top_k, hidden)
        what, remedy = "the CPU miss path", "use --miss-path pcie"
        self.headers = host_tensor((layers, HEADER_WORDS), torch.int64, pinned, what, remedy).zero_()
        self.data = host_tensor((layers, self.regions.nbytes), torch.uint8, pinned, what, remedy).zero_()
        self.state = torch.zeros(layers, 2, dtype=torch.int64, device=device)
        self.flags = self.headers.numpy().reshape(-1)  # what the host polls (numba)
        self._data = self.data.numpy()

    @property
    def tokens(self) -> int:
        return self.regions.tokens

    def _array(self, layer: int, at: int, count: int, dtype) -> np.ndarray:
        return self._data[layer, at : at + count * np.dtype(dtype).itemsize].view(dtype)

    def request(self, layer: int) -> tuple[int, np.ndarray, np.ndarray, np.ndarray]:
        """(tokens T, ids int32 [T, k] with -1 for the device's assignments, weights float32 [T, k],
        activations float32 [T, H]) of layer `layer`'s open request."""
        r = self.regions
        t = int(self.flags[layer * HEADER_WORDS + TOKENS])
        ids = self._array(layer, r.ids_at, t * r.top_k, np.int32).reshape(t, r.top_k)
        weights = self._array(layer, r.weights_at, t * r.top_k, np.float32).reshape(t, r.top_k)
        return t, ids, weights, self._array(layer, r.x_at, t * r.hidden, np.float32).reshape(t, r.hidden)

    def answer(self, layer: int, tokens: int) -> np.ndarray:
        """The host's answer rows float32 [tokens, H] of layer `layer` (written in place)."""
        r = self.regions
        return self._array(layer, r.out_at, tokens * r.hidden, np.float32).reshape(tokens, r.hidden)

    def failed(self) -> bool:
        """Whether a device `collect` gave up waiting for an answer."""
        return bool(self.headers[:, FAILED].any())

    def offsets(self, layer: int, base: torch.Tensor) -> tuple[int, int]:
        """(header, data) byte offsets of layer `layer` from `base`'s first byte (for the kernels)."""
        return self.headers[layer].data_ptr() - base.data_ptr(), self.data[layer].data_ptr() - base.data_ptr()


def publish_reference(
    mailbox: Mailbox, layer: int, x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor, table: torch.Tensor,
    take: torch.Tensor, host_max_uses: torch.Tensor, anchor: torch.Tensor, cpu_uses: torch.Tensor, arena_bytes: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """What `kernels.miss_handoff.publish` computes, in torch and numpy (eager, syncs on CUDA)."""
    offsets = table[topk_ids]
    flat = topk_ids.reshape(-1)
    uses = (flat[:, None] == flat[None, :]).sum(1).reshape(topk_ids.shape)  # pairs of the call routed to each pair's expert
    host = (take[topk_ids] != 0) & ((offsets < 0) | (offsets >= arena_bytes)) & (uses <= host_max_uses[0])
    device_ids = torch.where(host, anchor[0], topk_ids)
    device_weights = torch.where(host, torch.zeros_like(topk_weights), topk_weights)
    state, work = mailbox.state[layer], bool(host.any())
    state[1] = int(work)
    if not work:
        return device_ids, device_weights
    cpu_uses.index_add_(0, topk_ids[host], torch.ones_like(topk_ids[host], dtype=cpu_uses.dtype))
    t = x.shape[0]
    mailbox.flags[layer * HEADER_WORDS + TOKENS] = t
    _, ids, weights, activations = mailbox.request(layer)
    ids[:] = torch.where(host, topk_ids, -1).cpu().numpy()
    weights[:] = topk_weights.float().cpu().numpy()
    activations[:] = x.float().cpu().numpy()
    state[0] += 1
    mailbox.flags[layer * HEADER_WORDS + READY] = int(state[0])
    return device_ids, device_weights


def collect_reference(mailbox: Mailbox, layer: int, out: torch.Tensor, timeout_s: float = ANSWER_TIMEOUT_S) -> torch.Tensor:
    """What `kernels.miss_handoff.collect` computes: wait for the answer, out += it (in place)."""
    ticket, pending = (int(v) for v in mailbox.state[layer])
    if not pending:
        return out
    deadline = time.monotonic() + timeout_s
    while int(mailbox.flags[layer * HEADER_WORDS + DONE]) != ticket:
        if time.monotonic() > deadline:
            mailbox.flags[layer * HEADER_WORDS + FAILED] = 1
            raise NinferError(f"the CPU miss path did not answer layer {layer} within {timeout_s:.0f} s")
        time.sleep(0)
    answer = torch.from_numpy(mailbox.answer(layer, out.shape[0]).copy()).to(out.device)
    out.copy_((out.float() + answer).to(out.dtype))
    return out


def publish(
    mailbox: Mailbox, layer: int, x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor, table: torch.Tensor,
    take: torch.Tensor, host_max_uses: torch.Tensor, anchor: torch.Tensor, cpu_uses: torch.Tensor, arena: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(device ids, device weights) for the routed-experts kernels; the host's share published: the assignments of
    experts not in VRAM that `take` gives the host and that at most `host_max_uses` (int32 [1]) pairs use."""
    if arena.device.type != "cuda":
        return publish_reference(
            mailbox, layer, x, topk_ids, topk_weights, table, take, host_max_uses, anchor, cpu_uses, arena.numel()
        )
    from ninfer_offload.kernels import miss_handoff

    header, data = mailbox.offsets(layer, arena)
    state = mailbox.state[layer]
    return miss_handoff.publish(
        x, topk_ids, topk_weights, table, take, host_max_uses, anchor, cpu_uses, state, arena, header, data, mailbox.regions
    )


def collect(mailbox: Mailbox, layer: int, out: torch.Tensor, arena: torch.Tensor) -> torch.Tensor:
    """out += the host's answer to this call's request, if it made one (in place)."""
    if arena.device.type != "cuda":
        return collect_reference(mailbox, layer, out)
    from ninfer_offload.kernels import miss_handoff

    header, data = mailbox.offsets(layer, arena)
    return miss_handoff.collect(out, mailbox.state[layer], arena, header, data, mailbox.regions)
