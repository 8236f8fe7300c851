"""Triton building blocks: decode a tile of an nvfp4 object (runtime form) in registers.

`load_nvfp4_code_tile` returns the E2M1 values of rows `rows`, columns `[k0, k0 + BLOCK_K)`, as
exact float32 in the position layout of `rowsplit.load_code_tile` (position i = nibble i of a
32-bit word of the packed plane = columns 8 j + i) with their E4M3FN block scales, reading the stored code plane and undoing the scale
plane's 128-row x 4-block swizzle (docs/format.md §6.3) on the fly; nothing is dequantized in
memory. This is the layout of a row-split code tile with 16-element groups, so the
matrix-vector kernels multiply it by x with the same `rowsplit.dot_code_tile`, and the tiled
kernels read it interleaved into `e2m1(code) * e4m3fn(scale)` (`tiles.load_tile`).
The FP32 divisor (one per 128-row tile in runtime form, §6.6) is applied to neither: kernels divide
their fp32 accumulators by each output row's divisor (`row_divisors`, loaded before their k loop). That split is the seam for
a tensor-core FP4 path on sm_120, whose block-scaled MMA would consume the stored codes and
(unswizzled) scales directly and keep the same divisor epilogue.

Reference op: `model.nvfp4.dequantize_nvfp4` (equal to `artifact.codecs.decode_nvfp4`).
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def _e2m1(word, P: tl.constexpr):
    """float32 values of the 4-bit E2M1 codes at bit P of `word` (int32): sign bit 3, magnitudes 0, 0.5,
    1, 1.5, 2, 3, 4, 6.

    The code's exponent and mantissa bits are moved to the bottom of a float32's exponent field and
    the top of its mantissa (bits 22-24), its sign to bit 31: that float is the E2M1 value times
    2^-126 (E2M1's subnormal 0.5 lands on a float32 subnormal), so one multiply by 2^126 gives it
    exactly. Three or four integer ops, no int-to-float conversion (a quarter-rate instruction)."""
    moved = word << (22 - P) if P <= 22 else word >> (P - 22)
    bits = (moved & 0x01C00000) | ((word << (28 - P)) & -0x80000000)
    return bits.to(tl.float32, bitcast=True) * 8.507059173023462e37  # 2^126


@triton.jit
def _e4m3fn(s):
    """float32 values of E4M3FN scale bytes (int32; sign 0 and not NaN, which the load checks): the
    exponent and mantissa moved to bits 20-26 are the value times 2^-120 (subnormals included)."""
    return ((s & 0x7F) << 20).to(tl.float32, bitcast=True) * 1.329227995784916e36  # 2^120


@triton.jit
def load_nvfp4_code_tile(
    obj,  # pointer to uint8: start of the nvfp4 object
    rows,  # [BLOCK_N] int64 row indices
    row_mask,  # [BLOCK_N] bool
    k0,  # first column of the tile (multiple of BLOCK_K)
    scale_offset,
    K: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    """(codes, scales): e2m1 values as eight position tiles [BLOCK_N, BLOCK_K // 8] float32 (position
    i = columns 8 j + i, nibble i of the packed plane's 32-bit word j) and the e4m3fn scales
    [BLOCK_N, BLOCK_K // 16] float32, without the divisor."""
    mask = row_mask[:, None]
    ptr = obj.to(tl.pointer_type(tl.int32)) + rows[:, None] * (K // 8) + k0 // 8 + tl.arange(0, BLOCK_K // 8)[None, :]
    word = tl.load(ptr, mask=mask, other=0)
    codes = (
        _e2m1(word, 0), _e2m1(word, 4), _e2m1(word, 8), _e2m1(word, 12),
        _e2m1(word, 16), _e2m1(word, 20), _e2m1(word, 24), _e2m1(word, 28),
    )
    # a row's four scales of one 64-column scale tile are one aligned 32-bit word of the swizzled plane: one
    # load per word, its bytes split in registers; with rows from `tiles.program_rows` a program's words are
    # contiguous, which matters most over host records (docs/performance.md, NVFP4 against the official recipe)
    inner = rows % 128
    scale_tiles = (rows // 128) * (K // 64)
    word = (scale_tiles[:, None] + (k0 // 64 + tl.arange(0, BLOCK_K // 64))[None, :]) * 128 + ((inner % 32) * 4 + inner // 32)[:, None]
    words = tl.load((obj + scale_offset).to(tl.pointer_type(tl.int32)) + word, mask=mask, other=0)
    lanes = (words[:, :, None] >> (tl.arange(0, 4) * 8)[None, None, :]) & 0xFF
    scales = _e4m3fn(tl.reshape(lanes, [BLOCK_N, BLOCK_K // 16]))
    return codes, scales


@triton.jit
def load_divisors(obj, rows, row_mask, divisor_offset):
    """float32 [BLOCK_N]: the divisor of each row (one FP32 word per 128-row tile)."""
    return tl.load((obj + divisor_offset).to(tl.pointer_type(tl.float32)) + rows // 128, mask=row_mask, other=1.0)


@triton.jit
def row_divisors(obj, rows, row_mask, divisor_offset, NVFP4: tl.constexpr):
    """float32 [BLOCK_N]: the rows' divisors of an nvfp4 object (`load_divisors`), ones for the row-split formats
    (which have none; unused there). Kernels load them before their k loop: loaded where the accumulators need them,
    after the loop, they would be the program's last global read, a memory round trip (over PCIe for host records)
    after all of its compute."""
    if NVFP4:
        divisors = load_divisors(obj, rows, row_mask, divisor_offset)
    else:
        divisors = tl.where(row_mask, 1.0, 1.0)
    return divisors
