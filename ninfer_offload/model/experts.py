"""Routed-expert records as the compute sees them, and their decoding to weight matrices.

Quantized banks use the shared `ExpertRecordLayout` (two standalone row-split objects per
expert). Lossless banks (bf16/fp32, the `bf16` recipe) use `DenseRecordLayout`: the expert's
gate/up words [2I, H] then, at the next 256-byte boundary, its down words [H, I].
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from ninfer_offload.artifact.formats import DIRECT_FORMATS, align_up
from ninfer_offload.model.quant import dequantize_objects
from ninfer_offload.runtime.expert_record import ExpertRecordLayout

_TORCH_WORDS = {"bf16": torch.bfloat16, "fp32": torch.float32}


@dataclass(frozen=True)
class DenseRecordLayout:
    """Record geometry of an expert whose banks are stored as contiguous bf16/fp32 words."""

    fmt: str
    hidden: int
    intermediate: int

    @property
    def word(self) -> int:
        return DIRECT_FORMATS[self.fmt]

    @property
    def gate_up_bytes(self) -> int:
        return 2 * self.intermediate * self.hidden * self.word

    @property
    def down_offset(self) -> int:
        return align_up(self.gate_up_bytes, 256)

    @property
    def down_bytes(self) -> int:
        return self.hidden * self.intermediate * self.word

    @property
    def nbytes(self) -> int:
        return align_up(self.down_offset + self.down_bytes, 256)

    def pack(self, gate_up_bank, down_bank, num_experts: int, expert: int, out: np.ndarray | None = None) -> np.ndarray:
        """Cut expert `expert` out of a layer's banks (raw contiguous bytes) into one record."""
        record = np.zeros(self.nbytes, dtype=np.uint8) if out is None else out
        gu, dn = self.gate_up_bytes, self.down_bytes
        record[:gu] = np.asarray(gate_up_bank)[expert * gu : (expert + 1) * gu]
        record[self.down_offset : self.down_offset + dn] = np.asarray(down_bank)[expert * dn : (expert + 1) * dn]
        return record


RecordLayout = ExpertRecordLayout | DenseRecordLayout


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
