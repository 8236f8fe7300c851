"""Routed-expert records as the compute sees them, and their decoding to weight matrices.

The record layouts themselves (`ExpertRecordLayout` for quantized banks, `DenseRecordLayout` for
lossless bf16/fp32 ones) belong to the format: `ninfer_offload.artifact.records`.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ninfer_offload.artifact.records import ExpertRecordLayout, RecordLayout
from ninfer_offload.model.quant import dequantize_objects

_TORCH_WORDS = {"bf16": torch.bfloat16, "fp32": torch.float32}


def record_weights(records: torch.Tensor, layout: RecordLayout, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """Decode records [M, nbytes] (uint8) to gate/up weights [M, 2I, H] and down weights [M, H, I]."""
    if isinstance(layout, ExpertRecordLayout):
        gu, dn = layout.gate_up, layout.down
        gate_up = dequantize_objects(records[:, : gu.encoded_size], gu, dtype)
        down = dequantize_objects(records[:, layout.down_offset : layout.down_offset + dn.encoded_size], dn, dtype)
        return gate_up, down
    m, words = records.shape[0], _TORCH_WORDS[layout.fmt]
    gate_up = records[:, : layout.gate_up_bytes].contiguous().view(words)
    down = records[:, layout.down_offset : layout.down_offset + layout.down_bytes].contiguous().view(words)
    return (
        gate_up.reshape(m, 2 * layout.intermediate, layout.hidden).to(dtype),
        down.reshape(m, layout.hidden, layout.intermediate).to(dtype),
    )


@dataclass
class ExpertBank:
    """One layer's routed experts ready for compute: records on the compute device and a slot table.

    `slots[e]` is the row of `records` holding expert e; the store guarantees that every expert
    routed to in the current call has a valid slot before the backend runs.
    """

    layout: RecordLayout
    records: torch.Tensor  # uint8 [S, layout.nbytes]
    slots: torch.Tensor  # int64 [num_experts]
