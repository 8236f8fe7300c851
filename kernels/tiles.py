"""Which tile decoder a quantized kernel uses: the one seam between the kernels and the weight formats.

Every quantized kernel (dense linear, routed MoE) addresses its weight object through a
`TileGeometry` and reads tiles through `load_tile`, which dispatches on the `NVFP4` constexpr:
row-split objects (`kernels/rowsplit.py`: values `fp32(scale) * code`) or nvfp4 objects
(`kernels/nvfp4.py`: `e2m1(code) * e4m3fn(scale)`, the row divisor applied by the kernel to its
accumulators). A further format (or a tensor-core FP4 path on sm_120 that skips the register
decode) is one more branch here and in the kernels' epilogues.
"""

from __future__ import annotations

from dataclasses import dataclass

import triton
import triton.language as tl

from ninfer_offload.artifact.formats import BlockScaleGeometry, ObjectGeometry
from ninfer_offload.kernels.nvfp4 import load_nvfp4_tile
from ninfer_offload.kernels.rowsplit import load_weight_tile


@dataclass(frozen=True)
class TileGeometry:
    """The constants a kernel needs to address one quantized object (or every record of a bank)."""

    nvfp4: bool
    bits: int  # row-split code bits (4 for nvfp4)
    group: int  # elements per scale (16 for nvfp4)
    k_pad: int  # stored row length (nvfp4: K itself)
    high_offset: int  # row-split high plane (0 for nvfp4)
    scale_offset: int
    divisor_offset: int  # nvfp4 divisor words (0 for row-split)

    @classmethod
    def of(cls, geometry: ObjectGeometry) -> "TileGeometry":
        if isinstance(geometry, BlockScaleGeometry):
            if geometry.divisors != geometry.row_tiles:
                raise ValueError(f"nvfp4 kernels need one divisor per row tile, not {geometry.divisors}")
            return cls(True, 4, 16, geometry.k, 0, geometry.scale_offset, geometry.divisor_offset)
        return cls(False, geometry.fmt.bits, geometry.fmt.group, geometry.k_pad, geometry.high_offset, geometry.scale_offset, 0)


def block_k_for(k_pad: int, preferred: int = 256) -> int:
    """Largest tile width <= preferred (256, 128 or 64) that divides the stored row."""
    return next(width for width in (preferred, 128, 64) if width <= preferred and k_pad % width == 0)


@triton.jit
def load_tile(
    obj,
    rows,
    row_mask,
    k0,
    high_offset,
    scale_offset,
    NVFP4: tl.constexpr,
    BITS: tl.constexpr,
    GROUP: tl.constexpr,
    K_PAD: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    """float32 tile [BLOCK_N, BLOCK_K] of the object: row-split values, or nvfp4 values before their row divisor."""
    if NVFP4:
        tile = load_nvfp4_tile(obj, rows, row_mask, k0, scale_offset, K_PAD, BLOCK_N, BLOCK_K)
    else:
        tile = load_weight_tile(obj, rows, row_mask, k0, high_offset, scale_offset, BITS, GROUP, K_PAD, BLOCK_N, BLOCK_K)
    return tile
