"""Grouped quantized matrices kept in their stored `row_split_k128_v1` bytes, decoded with torch ops.

The decoder works on any device and on any leading batch of objects (a stack of expert records),
and reproduces `artifact.codecs.decode_row_split` + `dequantize` exactly: value = fp32(scale) * code.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ninfer_offload.artifact.formats import GroupedFormat, RowSplitGeometry


def plane_views(data: torch.Tensor, geometry: RowSplitGeometry) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor]:
    """Views of the planes of row-split objects `data [..., encoded_size]` (uint8).

    Returns base [..., n, gpr, B] uint8, high [..., n, gpr, H] uint8 (None for Q4/Q8) and
    scales [..., n, gpr] float16.
    """
    fmt, n, gpr = geometry.fmt, geometry.n, geometry.groups_per_row
    lead = data.shape[:-1]
    base = data[..., : geometry.base_bytes].reshape(*lead, n, gpr, fmt.base_bytes)
    high = None
    if fmt.high_bytes:
        high = data[..., geometry.high_offset : geometry.high_offset + geometry.high_bytes]
        high = high.reshape(*lead, n, gpr, fmt.high_bytes)
    scale_bytes = data[..., geometry.scale_offset : geometry.scale_offset + geometry.scale_bytes]
    scales = scale_bytes.contiguous().view(torch.float16).reshape(*lead, n, gpr)
    return base, high, scales


def decode_planes(
    fmt: GroupedFormat, base: torch.Tensor, high: torch.Tensor | None, scales: torch.Tensor, k: int, dtype: torch.dtype
) -> torch.Tensor:
    """Values [..., k] from plane bytes base [..., gpr, B], high [..., gpr, H], scales [..., gpr]."""
    lead = base.shape[:-2]
    gpr = base.shape[-2]
    if fmt.bits == 8:
        codes = base.view(torch.int8).to(torch.int16)
    else:
        u = torch.stack((base & 0x0F, base >> 4), dim=-1).reshape(*lead, gpr, fmt.group)
        if high is not None:
            extra = fmt.bits - 4
            shifts = torch.arange(8, dtype=torch.uint8, device=base.device)
            bits = (high.unsqueeze(-1) >> shifts) & 1  # little-endian bit stream, lane-major
            bits = bits.reshape(*lead, gpr, fmt.group, extra)
            for t in range(extra):
                u = u | (bits[..., t] << (4 + t))
        codes = u.to(torch.int16)
        codes = torch.where(codes >= (1 << (fmt.bits - 1)), codes - (1 << fmt.bits), codes)
    values = codes.to(torch.float32) * scales.to(torch.float32).unsqueeze(-1)
    return values.reshape(*lead, gpr * fmt.group)[..., :k].to(dtype)


def dequantize_objects(data: torch.Tensor, geometry: RowSplitGeometry, dtype: torch.dtype) -> torch.Tensor:
    """Values [..., n, k] of row-split objects `data [..., encoded_size]`."""
    base, high, scales = plane_views(data, geometry)
    return decode_planes(geometry.fmt, base, high, scales, geometry.k, dtype)


@dataclass
class QuantizedMatrix:
    """One [n, k] matrix in its stored row-split bytes (on the compute device or in host memory)."""

    fmt: GroupedFormat
    n: int
    k: int
    data: torch.Tensor  # uint8 [encoded_size]

    def __post_init__(self) -> None:
        if self.data.dtype != torch.uint8 or self.data.numel() != self.geometry.encoded_size:
            raise ValueError(f"{self.fmt.name} [{self.n}, {self.k}] needs {self.geometry.encoded_size} uint8 bytes")

    @property
    def geometry(self) -> RowSplitGeometry:
        return RowSplitGeometry(self.fmt, self.n, self.k)

    @property
    def shape(self) -> tuple[int, int]:
        return (self.n, self.k)

    @property
    def device(self) -> torch.device:
        return self.data.device

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """All values [n, k]."""
        return dequantize_objects(self.data, self.geometry, dtype)

    def dequantize_rows(self, rows: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """Values [len(rows), k] of the given row indices (an embedding lookup; no host sync)."""
        base, high, scales = plane_views(self.data, self.geometry)
        return decode_planes(
            self.fmt, base[rows], None if high is None else high[rows], scales[rows], self.k, dtype
        )

    def to(self, device: torch.device | str) -> "QuantizedMatrix":
        return QuantizedMatrix(self.fmt, self.n, self.k, self.data.to(device))
