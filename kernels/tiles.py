"""Which tile decoder a quantized kernel uses: the one seam between the kernels and the weight formats.

Every quantized kernel (dense linear, routed MoE) addresses its weight object through a
`TileGeometry` and reads tiles through this module, which dispatches on the `NVFP4` constexpr:
row-split objects (`kernels/rowsplit.py`: values `fp32(scale) * code`) or nvfp4 objects
(`kernels/nvfp4.py`: `e2m1(code) * e4m3fn(scale)`, the row divisor applied by the kernel to its
accumulators after the k loop). Both formats decode to one layout, code tiles (`load_gemv_tile`:
codes in stored order with their scales, nvfp4 ones laid out as 4-bit row-split codes in
16-element groups): the matrix-vector kernels dot them with x (`rowsplit.dot_code_tile`, or both
at once: `gemv_tile`), the tiled `tl.dot` kernels read them interleaved and scaled (`load_tile`). A further format (or a tensor-core FP4
path on sm_120 that skips the register decode) is one more branch here and in the kernels'
epilogues. Kernels take their rows from `program_rows`, which orders nvfp4 rows so that a program's
scale reads are contiguous.
"""

from __future__ import annotations

from dataclasses import dataclass

import triton
import triton.language as tl

from ninfer_offload.artifact.formats import BlockScaleGeometry, ObjectGeometry
from ninfer_offload.kernels.nvfp4 import load_nvfp4_code_tile
from ninfer_offload.kernels.rowsplit import dot_code_tile, load_code_tile, scaled_columns


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


def gemv_block_k(k_pad: int, preferred: int) -> int:
    """Largest power-of-two tile width <= preferred that divides the stored row (row-split: a multiple
    of 128, nvfp4: of 64), so the matrix-vector kernels' tiles never cross a row's end."""
    block = preferred
    while k_pad % block:
        block //= 2
    return block


@triton.jit
def program_rows(block, BLOCK_N: tl.constexpr, NVFP4: tl.constexpr):
    """int64 [BLOCK_N]: the output rows of a program's `block`-th row slice. Row-split: BLOCK_N consecutive rows.
    nvfp4 (BLOCK_N a divisor of 128, at least 4): BLOCK_N / 4 consecutive rows of each 32-row quarter of a
    128-row tile; the scale swizzle interleaves the quarters, so those rows' scale words of one scale tile
    are contiguous (consecutive rows' words lie 16 bytes apart: a quarter of every sector read)."""
    j = tl.arange(0, BLOCK_N)
    if NVFP4 and BLOCK_N >= 4 and 128 % BLOCK_N == 0:
        slices: tl.constexpr = 128 // BLOCK_N
        rows = (block // slices) * 128 + (j % 4) * 32 + (block % slices) * (BLOCK_N // 4) + j // 4
    else:
        rows = block * BLOCK_N + j
    return rows.to(tl.int64)


@triton.jit
def load_gemv_tile(
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
    """(codes, scales) of a tile for `dot_code_tile`: eight position tiles of row-split codes, or of
    nvfp4 e2m1 values with e4m3fn scales (GROUP 16) before their row divisor."""
    if NVFP4:
        codes, scales = load_nvfp4_code_tile(obj, rows, row_mask, k0, scale_offset, K_PAD, BLOCK_N, BLOCK_K)
    else:
        codes, scales = load_code_tile(obj, rows, row_mask, k0, high_offset, scale_offset, BITS, GROUP, K_PAD, BLOCK_N, BLOCK_K)
    return codes, scales


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
    """float32 tile [BLOCK_N, BLOCK_K] of the object, columns in order: `load_gemv_tile`'s codes
    interleaved (position i to columns 8 j + i) and times their group's scale (nvfp4: before the row
    divisor; its products carry at most 6 significant bits, so they are exact in bf16)."""
    codes, scales = load_gemv_tile(obj, rows, row_mask, k0, high_offset, scale_offset, NVFP4, BITS, GROUP, K_PAD, BLOCK_N, BLOCK_K)
    return scaled_columns(codes, scales, GROUP, BLOCK_N, BLOCK_K)


@triton.jit
def gemv_tile(
    obj,
    rows,
    row_mask,
    k0,
    x,  # the tile's x columns in order (`rowsplit.load_columns`)
    high_offset,
    scale_offset,
    NVFP4: tl.constexpr,
    BITS: tl.constexpr,
    GROUP: tl.constexpr,
    K_PAD: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    """[BLOCK_N] float32: sum over the tile's columns of W[rows, k] * x[k] (nvfp4: before the row divisor),
    W decoded in registers (the matrix-vector form of `load_tile` for one x; no tensor-core padding)."""
    codes, scales = load_gemv_tile(obj, rows, row_mask, k0, high_offset, scale_offset, NVFP4, BITS, GROUP, K_PAD, BLOCK_N, BLOCK_K)
    return dot_code_tile(codes, scales, x, GROUP, BLOCK_N, BLOCK_K)
