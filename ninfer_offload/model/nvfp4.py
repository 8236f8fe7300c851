"""nvfp4 matrices kept in their stored bytes, and the reference decoder (torch ops, any device).

The runtime holds every nvfp4 matrix and expert-record part in `runtime_geometry` form: the
stored code plane and swizzled scale plane of whole 128-row tiles, then one FP32 divisor per row
tile (docs/format.md §6.3, §6.6). The decoder reproduces `artifact.codecs.decode_nvfp4` exactly:
value = e2m1(code) * e4m3fn(scale) / divisor, in float32, on any leading batch of objects.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache

import numpy as np
import torch

from ninfer_offload.artifact.codecs import E2M1_VALUES, E4M3FN_VALUES
from ninfer_offload.artifact.formats import NVFP4, NVFP4_TILE_ROWS, BlockScaleGeometry, runtime_geometry

@lru_cache(maxsize=8)
def _tables(device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """On `device`, copied there once (a step captured in a CUDA graph must not copy from the host): the
    E2M1 values of both codes of every code byte [256, 2] (low nibble first), and the E4M3FN values."""
    byte = np.arange(256)
    pairs = np.stack([E2M1_VALUES[byte & 0x0F], E2M1_VALUES[byte >> 4]], axis=-1)
    return torch.from_numpy(pairs).to(device), torch.from_numpy(E4M3FN_VALUES).to(device)


def _codes(packed: torch.Tensor) -> torch.Tensor:
    """E2M1 values [..., 2m] of packed code bytes [..., m] (low nibble first)."""
    return _tables(packed.device)[0][packed.long()].reshape(*packed.shape[:-1], -1)


def _divisors(data: torch.Tensor, geometry: BlockScaleGeometry) -> torch.Tensor:
    """float32 [..., row tiles]: the divisor words of objects data [..., encoded_size]."""
    words = data[..., geometry.divisor_offset : geometry.encoded_size].contiguous()
    return words.view(torch.float32).reshape(*data.shape[:-1], geometry.divisors)


def dequantize_nvfp4(data: torch.Tensor, geometry: BlockScaleGeometry, dtype: torch.dtype) -> torch.Tensor:
    """Values [..., n, k] of nvfp4 objects data [..., encoded_size] (uint8) with one divisor per row tile."""
    if geometry.divisors != geometry.row_tiles:
        raise ValueError(f"nvfp4 objects must carry one divisor per row tile, not {geometry.divisors}")
    lead, n, k = data.shape[:-1], geometry.n, geometry.k
    values = _codes(data[..., : geometry.code_bytes].reshape(*lead, n, k // 2))
    stored = data[..., geometry.scale_offset : geometry.divisor_offset].reshape(*lead, geometry.row_tiles, geometry.k_tiles, 32, 4, 4)
    d = len(lead)
    natural = stored.permute(*range(d), d, d + 3, d + 2, d + 1, d + 4).reshape(*lead, n, k // 16)  # undo the tile swizzle
    values = values.reshape(*lead, n, k // 16, 16) * _tables(data.device)[1][natural.long()].unsqueeze(-1)
    divisors = _divisors(data, geometry).repeat_interleave(NVFP4_TILE_ROWS, dim=-1)
    return (values.reshape(*lead, n, k) / divisors.unsqueeze(-1)).to(dtype)


def scale_index(rows: torch.Tensor, geometry: BlockScaleGeometry) -> torch.Tensor:
    """Scale-plane byte offsets [len(rows), k / 16] of the blocks of `rows` (the §6.3 swizzle)."""
    blocks = torch.arange(geometry.k // 16, device=rows.device)
    tile, inner = (rows // NVFP4_TILE_ROWS)[:, None], (rows % NVFP4_TILE_ROWS)[:, None]
    return (tile * geometry.k_tiles + blocks // 4) * 512 + (inner % 32) * 16 + (inner // 32) * 4 + blocks % 4


@dataclass
class Nvfp4Matrix:
    """One [n, k] nvfp4 matrix in runtime form (on the compute device or in host memory)."""

    n: int
    k: int
    data: torch.Tensor  # uint8 [encoded_size]

    def __post_init__(self) -> None:
        if self.data.dtype != torch.uint8 or self.data.numel() != self.geometry.encoded_size:
            raise ValueError(f"{NVFP4} [{self.n}, {self.k}] needs {self.geometry.encoded_size} uint8 bytes")

    @property
    def geometry(self) -> BlockScaleGeometry:
        return runtime_geometry(NVFP4, self.n, self.k)

    @property
    def shape(self) -> tuple[int, int]:
        return (self.n, self.k)

    @property
    def device(self) -> torch.device:
        return self.data.device

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """All values [n, k]."""
        return dequantize_nvfp4(self.data, self.geometry, dtype)

    def dequantize_rows(self, rows: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """Values [len(rows), k] of the given row indices (an embedding lookup; no host sync)."""
        geometry = self.geometry
        rows = rows.long()
        packed = self.data[: geometry.code_bytes].view(self.n, self.k // 2)[rows]
        scales = self.data[geometry.scale_offset : geometry.divisor_offset][scale_index(rows, geometry)]
        values = _codes(packed).view(-1, self.k // 16, 16) * _tables(self.device)[1][scales.long()].unsqueeze(-1)
        divisors = _divisors(self.data, geometry)[rows // NVFP4_TILE_ROWS]
        return (values.view(-1, self.k) / divisors[:, None]).to(dtype)

    def to(self, device: torch.device | str) -> "Nvfp4Matrix":
        return Nvfp4Matrix(self.n, self.k, self.data.to(device))
