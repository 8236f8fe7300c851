"""Routed-expert records as the compute sees them, and their decoding to weight matrices.

The record layouts themselves (`ExpertRecordLayout` for quantized banks, `DenseRecordLayout` for
lossless bf16/fp32 ones) belong to the format: `ninfer_offload.artifact.records`.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ninfer_offload.artifact.formats import BlockScaleGeometry, ObjectGeometry
from ninfer_offload.artifact.records import ExpertRecordLayout, RecordLayout
from ninfer_offload.model.nvfp4 import dequantize_nvfp4
from ninfer_offload.model.quant import dequantize_objects

_TORCH_WORDS = {"bf16": torch.bfloat16, "fp32": torch.float32}
RECORD_ALIGN = 256  # every record offset in an arena is a multiple of this


def _dequantize(data: torch.Tensor, geometry: ObjectGeometry, dtype: torch.dtype) -> torch.Tensor:
    if isinstance(geometry, BlockScaleGeometry):
        return dequantize_nvfp4(data, geometry, dtype)
    return dequantize_objects(data, geometry, dtype)


def record_weights(records: torch.Tensor, layout: RecordLayout, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """Decode records [M, nbytes] (uint8) to gate/up weights [M, 2I, H] and down weights [M, H, I]."""
    if isinstance(layout, ExpertRecordLayout):
        gu, dn = layout.gate_up, layout.down
        gate_up = _dequantize(records[:, : gu.encoded_size], gu, dtype)
        down = _dequantize(records[:, layout.down_offset : layout.down_offset + dn.encoded_size], dn, dtype)
        return gate_up, down
    m, words = records.shape[0], _TORCH_WORDS[layout.fmt]
    gate_up = records[:, : layout.gate_up_bytes].contiguous().view(words)
    down = records[:, layout.down_offset : layout.down_offset + layout.down_bytes].contiguous().view(words)
    return (
        gate_up.reshape(m, 2 * layout.intermediate, layout.hidden).to(dtype),
        down.reshape(m, layout.hidden, layout.intermediate).to(dtype),
    )


def count_uses(uses: torch.Tensor, topk_ids: torch.Tensor) -> None:
    """Adds each (token, expert) assignment of `topk_ids` to `uses` (int32 [num_experts])."""
    flat = topk_ids.reshape(-1)
    uses.index_add_(0, flat, torch.ones_like(flat, dtype=torch.int32))


@dataclass
class ExpertBank:
    """One layer's routed experts as the compute sees them: a byte offset per expert from the start
    of `arena` (uint8, on the compute device, 256-byte aligned).

    An offset inside the arena is a record in device memory; any other points at the expert's row
    of `host` (host memory mapped into the device's address space: the MoE kernels read it over
    PCIe). `records` resolves offsets to tensors for ops that index records instead. With `uses`, the op
    that computes the experts also counts their assignments there (the expert cache's statistics), in
    its own kernels where it can: no launch of its own in a decode step.
    """

    layout: RecordLayout
    arena: torch.Tensor  # uint8 [N]
    offsets: torch.Tensor  # int64 [num_experts], on the arena's device
    host: torch.Tensor | None = None  # uint8 [num_experts, layout.nbytes]: every expert's host record
    uses: torch.Tensor | None = None  # int32 [num_experts]: the op that computes the experts counts each assignment here
    shared_uses: torch.Tensor | None = None  # int32 [num_experts]: and here those that read no record of their own

    def count(self, topk_ids: torch.Tensor) -> None:
        """`count_uses` of `topk_ids` where the bank has `uses`."""
        if self.uses is not None:
            count_uses(self.uses, topk_ids)

    @classmethod
    def of_records(cls, layout: RecordLayout, records: torch.Tensor) -> "ExpertBank":
        """A bank over records [E, nbytes] held back to back in one contiguous tensor."""
        if not records.is_contiguous() or records.shape[1] != layout.nbytes:
            raise ValueError(f"expert records must be one contiguous [experts, {layout.nbytes}] uint8 tensor")
        offsets = torch.arange(records.shape[0], dtype=torch.int64, device=records.device) * layout.nbytes
        return cls(layout, records.view(-1), offsets)

    def records(self, experts: torch.Tensor) -> torch.Tensor:
        """Records [n, nbytes] of `experts` (int [n]) on the arena's device. With every record in the
        arena this is a device gather (no host sync, so it can be captured); otherwise the offsets are
        read on the host to find the host records."""
        nbytes, size = self.layout.nbytes, self.arena.numel()
        if self.host is None:
            blocks = self.arena.view(-1, RECORD_ALIGN)  # records start at multiples of RECORD_ALIGN
            rows = self.offsets[experts] // RECORD_ALIGN
            index = rows[:, None] + torch.arange(-(-nbytes // RECORD_ALIGN), device=rows.device)
            return blocks[index].reshape(len(experts), -1)[:, :nbytes]
        rows = []
        for expert, offset in zip(experts.tolist(), self.offsets[experts].tolist()):
            if 0 <= offset <= size - nbytes:
                rows.append(self.arena[offset : offset + nbytes])
            elif self.host is not None:
                rows.append(self.host[expert].to(self.arena.device))
            else:
                raise ValueError(f"expert {expert} has no record in the arena and the bank has no host records")
        return torch.stack(rows) if rows else self.arena.new_empty(0, nbytes)
