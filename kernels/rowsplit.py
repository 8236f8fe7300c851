"""Triton building blocks: decode a tile of a `row_split_k128_v1` object in registers.

`load_code_tile` takes the object's base address and its plane offsets (docs/format.md §6.2) and
returns the codes of rows `rows`, columns `[k0, k0 + BLOCK_K)`, as exact floats in stored order,
with their scales. The matrix-vector kernels multiply them by x in that order (`dot_code_tile`,
which also serves nvfp4 code tiles: 4-bit, 16-element groups); the tiled `tl.dot` kernels read
them interleaved and scaled (`tiles.load_tile`). Both reach the kernels by way of
`kernels/tiles.py`. Nothing is dequantized in memory. `BLOCK_K` is
a multiple of 128, so a tile never crosses a row's padded end and padding lanes (code 0, scale 0)
need no mask.
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def split_even_odd(xk, BLOCK_K: tl.constexpr):
    """x columns [BLOCK_K] -> (even columns, odd columns), each [BLOCK_K // 2]: the low and high
    nibbles of the packed plane's bytes."""
    return tl.split(tl.reshape(xk, [BLOCK_K // 2, 2]))


@triton.jit
def signed_code_float(u, HALF_RANGE: tl.constexpr):
    """Two's-complement codes held as unsigned ints `u` (< 2 * HALF_RANGE) -> exact float32 values.

    Flipping the sign bit gives the code plus HALF_RANGE; OR-ing that into the mantissa of 2^23
    and subtracting 2^23 + HALF_RANGE yields the code as a float with integer ops and one
    subtraction, instead of an int-to-float conversion (a quarter-rate instruction)."""
    biased = (u ^ HALF_RANGE) | 0x4B000000
    return biased.to(tl.float32, bitcast=True) - (8388608.0 + HALF_RANGE)


@triton.jit
def load_code_tile(
    obj,  # pointer to uint8: start of the row-split object
    rows,  # [BLOCK_N] int64 row indices
    row_mask,  # [BLOCK_N] bool
    k0,  # first column of the tile (multiple of BLOCK_K)
    high_offset,
    scale_offset,
    BITS: tl.constexpr,
    GROUP: tl.constexpr,
    K_PAD: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    """The tile's codes as exact float32 in stored order, and its scales: (low, high, scales).

    8-bit: low = high = codes [BLOCK_N, BLOCK_K]. 4-6 bit: low = codes of the even columns, high =
    codes of the odd columns (the low and high nibbles of the packed plane), each
    [BLOCK_N, BLOCK_K // 2]. scales [BLOCK_N, BLOCK_K // GROUP]. Nothing is interleaved or laid out
    as a dequantized tile: `dot_code_tile` multiplies the codes by x in this order."""
    mask = row_mask[:, None]
    if BITS == 8:
        ptr = obj + rows[:, None] * K_PAD + k0 + tl.arange(0, BLOCK_K)[None, :]
        low = signed_code_float(tl.load(ptr, mask=mask, other=0).to(tl.int32), 128)
        high = low
    else:
        HALF: tl.constexpr = BLOCK_K // 2
        ptr = obj + rows[:, None] * (K_PAD // 2) + k0 // 2 + tl.arange(0, HALF)[None, :]
        packed = tl.load(ptr, mask=mask, other=0).to(tl.int32)
        lo = packed & 15
        hi = packed >> 4
        if BITS == 5:  # element k's fifth bit: bit k % 8 of high byte k // 8
            hptr = obj + high_offset + rows[:, None] * (K_PAD // 8) + k0 // 8 + tl.arange(0, BLOCK_K // 8)[None, :]
            hb = tl.load(hptr, mask=mask, other=0).to(tl.int32)
            hx = tl.reshape(tl.broadcast_to(hb[:, :, None], [BLOCK_N, BLOCK_K // 8, 4]), [BLOCK_N, HALF])
            shift = (2 * (tl.arange(0, HALF) % 4))[None, :]
            lo = lo | (((hx >> shift) & 1) << 4)
            hi = hi | (((hx >> (shift + 1)) & 1) << 4)
        if BITS == 6:  # element k's top two bits: bits 2 (k % 4) of high byte k // 4
            hptr = obj + high_offset + rows[:, None] * (K_PAD // 4) + k0 // 4 + tl.arange(0, BLOCK_K // 4)[None, :]
            hb = tl.load(hptr, mask=mask, other=0).to(tl.int32)
            hx = tl.reshape(tl.broadcast_to(hb[:, :, None], [BLOCK_N, BLOCK_K // 4, 2]), [BLOCK_N, HALF])
            shift = (4 * (tl.arange(0, HALF) % 2))[None, :]
            lo = lo | (((hx >> shift) & 3) << 4)
            hi = hi | (((hx >> (shift + 2)) & 3) << 4)
        low = signed_code_float(lo, 1 << (BITS - 1))
        high = signed_code_float(hi, 1 << (BITS - 1))
    sptr = (obj + scale_offset).to(tl.pointer_type(tl.float16))
    sptr = sptr + rows[:, None] * (K_PAD // GROUP) + k0 // GROUP + tl.arange(0, BLOCK_K // GROUP)[None, :]
    scales = tl.load(sptr, mask=mask, other=0.0).to(tl.float32)
    return low, high, scales


@triton.jit
def dot_code_tile(low, high, scales, xk, BITS: tl.constexpr, GROUP: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """[BLOCK_N] float32: sum over a tile's columns of W[rows, k] * x[k] from `load_code_tile`'s
    output (or `nvfp4.load_nvfp4_code_tile`'s, with BITS 4 and GROUP 16) and the tile's x columns `xk`
    [BLOCK_K] (float32). Products are summed per scale group and only then scaled."""
    if BITS == 8:
        per_group = tl.sum(tl.reshape(low * xk[None, :], [BLOCK_N, BLOCK_K // GROUP, GROUP]), axis=2)
    else:
        x_even, x_odd = split_even_odd(xk, BLOCK_K)
        products = low * x_even[None, :] + high * x_odd[None, :]
        per_group = tl.sum(tl.reshape(products, [BLOCK_N, BLOCK_K // GROUP, GROUP // 2]), axis=2)
    return tl.sum(per_group * scales, axis=1)
