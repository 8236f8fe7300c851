"""Record layouts of routed experts: the byte layout of one expert's record, the unit the expert store moves.

Quantized banks use `ExpertRecordLayout`: a record is two standalone quantized objects back to
back: the expert's gate/up rows ([2I, H]: I gate rows then I up rows, cut from the layer's gate/up
bank) and its down rows ([H, I], cut from the down bank), the second starting at the next 256-byte
boundary. Each part is a valid object on its own, so the reference decoder, the Triton MoE kernel
and the numba CPU kernels all read records with the same geometry. Row-split parts are the row
views of docs/format.md §6.2. nvfp4 parts are whole 128-row scale tiles copied verbatim (codes,
swizzled scales) plus one FP32 divisor per row tile (§6.6); each bank may be either kind.

Lossless banks (bf16/fp32, the `bf16` recipe) use `DenseRecordLayout`: the expert's gate/up words
[2I, H] then, at the next 256-byte boundary, its down words [H, I].
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property

import numpy as np

from ninfer_offload.artifact.codecs import materialize_rows, nvfp4_tile_divisors
from ninfer_offload.artifact.formats import (
    DIRECT_FORMATS,
    BlockScaleGeometry,
    ObjectGeometry,
    RowSplitGeometry,
    align_up,
    runtime_geometry,
)


@dataclass(frozen=True)
class ExpertRecordLayout:
    """Geometry of every record of one layer (all experts of a layer share it)."""

    gate_up: ObjectGeometry  # [2 * intermediate, hidden]
    down: ObjectGeometry  # [hidden, intermediate]

    @classmethod
    def create(cls, gate_up_format: str, down_format: str, hidden: int, intermediate: int) -> "ExpertRecordLayout":
        """ArtifactError when a format is not quantized, or an nvfp4 expert is not whole 128-row tiles."""
        return cls(runtime_geometry(gate_up_format, 2 * intermediate, hidden), runtime_geometry(down_format, hidden, intermediate))

    @property
    def gate_up_offset(self) -> int:
        return 0

    @cached_property  # these two once per layout: the CPU miss path reads them per request
    def down_offset(self) -> int:
        return align_up(self.gate_up.encoded_size, 256)

    @cached_property
    def nbytes(self) -> int:
        """Record size, padded to 256 bytes so records can be packed back to back."""
        return align_up(self.down_offset + self.down.encoded_size, 256)

    def pack(self, gate_up_bank, down_bank, num_experts: int, expert: int, out: np.ndarray | None = None) -> np.ndarray:
        """Cut expert `expert` out of a layer's fused banks (their raw bytes) into one record."""
        record = np.zeros(self.nbytes, dtype=np.uint8) if out is None else out
        for bank, geometry, base in ((gate_up_bank, self.gate_up, 0), (down_bank, self.down, self.down_offset)):
            record[base : base + geometry.encoded_size] = materialize_rows(
                bank, geometry.format, geometry.n * num_experts, geometry.k, expert * geometry.n, geometry.n
            )
        return record

    def pack_all(self, gate_up_bank, down_bank, num_experts: int, out: np.ndarray) -> None:
        """Every expert's record into `out` [num_experts, nbytes] (what `pack` gives each), at once: in
        each plane of a fused bank (codes, high bits, scales) an expert's rows are one span, so a plane
        moves as one strided copy; nvfp4 divisors are expanded to one per row tile."""
        filled = 0
        for bank, geometry, base in ((gate_up_bank, self.gate_up, 0), (down_bank, self.down, self.down_offset)):
            data = np.asarray(bank).view(np.uint8).reshape(-1)
            rows = geometry.n * num_experts
            # the bank's plane spans (the nvfp4 ones do not depend on its divisor count)
            if isinstance(geometry, RowSplitGeometry):
                fused = RowSplitGeometry(geometry.fmt, rows, geometry.k)
            else:
                fused = BlockScaleGeometry(rows, geometry.k)
            for (offset, total), start in zip(fused.row_spans(0, fused.n), geometry.plane_offsets):
                length = total // num_experts
                out[:, filled : base + start] = 0
                out[:, base + start : base + start + length] = data[offset : offset + total].reshape(num_experts, length)
                filled = base + start + length
            if isinstance(geometry, BlockScaleGeometry):
                divisors = nvfp4_tile_divisors(data, fused.n, fused.k).reshape(num_experts, geometry.divisors)
                out[:, base + geometry.divisor_offset : base + geometry.encoded_size] = divisors.view(np.uint8)
                filled = base + geometry.encoded_size
        out[:, filled:] = 0


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

    def pack_all(self, gate_up_bank, down_bank, num_experts: int, out: np.ndarray) -> None:
        """Every expert's record into `out` [num_experts, nbytes] (what `pack` gives each), at once."""
        gu, dn = self.gate_up_bytes, self.down_bytes
        out[:, :gu] = np.asarray(gate_up_bank).view(np.uint8).reshape(-1)[: num_experts * gu].reshape(num_experts, gu)
        out[:, gu : self.down_offset] = 0
        out[:, self.down_offset : self.down_offset + dn] = np.asarray(down_bank).view(np.uint8).reshape(-1)[: num_experts * dn].reshape(
            num_experts, dn
        )
        out[:, self.down_offset + dn :] = 0


RecordLayout = ExpertRecordLayout | DenseRecordLayout
