"""Saved pieces of one sequence's pooled state, for the prompt cache (`runtime.prefix_cache`).

A piece covers the tokens [start, end) of a sequence: the K and V rows of those positions in every
target attention layer, the MTP layer's rows of the entries that pair them with their successors
([start - 1, end - 1): entry i joins token i's hidden state to token i + 1) where the sequence drafts
with MTP, the GDN conv window and recurrent state after token end - 1 (a fixed-size summary of every
token before, so a piece can only be resumed at its end), and the final-normed hidden state of token
end - 1 (the MTP layer's next input). Restoring the pieces of a chain, in order, into a slot gives the
slot exactly the state the sequence had at the last piece's end.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ninfer_offload.model.state_pool import StatePool


@dataclass(frozen=True)
class StatePiece:
    """One sequence's state over the tokens [start, end) (see the module docstring)."""

    start: int
    end: int
    kv: dict[int, tuple[torch.Tensor, torch.Tensor]]  # attention layer key -> K, V rows [end - start, Hkv, D]
    conv: torch.Tensor  # [GDN layers, W - 1, C] after token end - 1
    recurrent: torch.Tensor  # [GDN layers, Hv, Dk, Dv] FP32 after token end - 1
    mtp_kv: tuple[torch.Tensor, torch.Tensor] | None = None  # the MTP layer's rows [max(start - 1, 0), end - 1)
    hidden: torch.Tensor | None = None  # [1, H] final-normed hidden state of token end - 1, kept with `mtp_kv`

    def tensors(self) -> list[torch.Tensor]:
        pairs = [*self.kv.values(), *([self.mtp_kv] if self.mtp_kv is not None else [])]
        extra = [self.hidden] if self.hidden is not None else []
        return [t for pair in pairs for t in pair] + [self.conv, self.recurrent] + extra

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.tensors())

    @property
    def device(self) -> torch.device:
        return self.conv.device

    def moved(self, device: torch.device, stream: torch.cuda.Stream | None = None) -> "StatePiece":
        """This piece's copy on `device` (host memory: pinned where CUDA exists, so the way back is asynchronous).
        `stream`: a CUDA stream for the copies from the device (queued after the work queued so far, which wrote the
        piece, and beside what is queued next: a demotion does not hold up the decode steps behind it); the device
        tensors are kept from reuse until the copies are done."""
        pin = device.type == "cpu" and torch.cuda.is_available() and self.device.type == "cuda"
        if stream is not None and pin:
            stream.wait_stream(torch.cuda.current_stream(self.device))
            for t in self.tensors():
                t.record_stream(stream)
            with torch.cuda.stream(stream):
                return self.moved(device)

        def move(t: torch.Tensor) -> torch.Tensor:
            if pin:
                out = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
                return out.copy_(t, non_blocking=True)
            return t.to(device, non_blocking=True, copy=True)

        return StatePiece(
            self.start, self.end, {key: (move(k), move(v)) for key, (k, v) in self.kv.items()}, move(self.conv),
            move(self.recurrent), None if self.mtp_kv is None else (move(self.mtp_kv[0]), move(self.mtp_kv[1])),
            None if self.hidden is None else move(self.hidden),
        )


def capture(pool: StatePool, slot: int, start: int, end: int, mtp_key: int | None, hidden: torch.Tensor | None) -> StatePiece:
    """Copy the state of the sequence in `slot` over the tokens [start, end) (it holds `end` tokens); with `mtp_key`
    (the MTP layer's key) also that layer's rows and `hidden`, the hidden state of token end - 1."""
    kv = {}
    for key in pool.kv:
        if key != mtp_key:
            k, v = pool.kv_of(key, slot)
            kv[key] = (k[start:end].clone(), v[start:end].clone())
    mtp_kv = None
    if mtp_key is not None:
        k, v = pool.kv_of(mtp_key, slot)
        rows = slice(max(start - 1, 0), end - 1)
        mtp_kv = (k[rows].clone(), v[rows].clone())
        hidden = hidden.detach().reshape(1, -1).clone()
    conv, recurrent = pool.gdn_state(slot)
    return StatePiece(start, end, kv, conv.clone(), recurrent.clone(), mtp_kv, hidden if mtp_key is not None else None)


def restore(pool: StatePool, slot: int, pieces: list[StatePiece], mtp_key: int | None) -> None:
    """Write the chain `pieces` (consecutive, the first starting at 0) into `slot`: every piece's rows (with `mtp_key`
    also the MTP layer's, which every piece then holds), the last one's GDN state. The copies are queued on the
    device's stream; from pinned host memory they do not block the host."""
    for piece in pieces:
        for key, (k, v) in piece.kv.items():
            slot_k, slot_v = pool.kv_of(key, slot)
            slot_k[piece.start : piece.end].copy_(k, non_blocking=True)
            slot_v[piece.start : piece.end].copy_(v, non_blocking=True)
    if mtp_key is not None:
        slot_k, slot_v = pool.kv_of(mtp_key, slot)
        for piece in pieces:
            rows = slice(max(piece.start - 1, 0), piece.end - 1)
            slot_k[rows].copy_(piece.mtp_kv[0], non_blocking=True)
            slot_v[rows].copy_(piece.mtp_kv[1], non_blocking=True)
    last = pieces[-1]
    pool.set_gdn_state(slot, last.conv, last.recurrent)
