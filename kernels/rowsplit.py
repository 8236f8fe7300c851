"""Triton building blocks: decode a tile of a `row_split_k128_v1` object in registers.

`load_code_tile` takes the object's base address and its plane offsets (docs/format.md §6.2) and
returns the codes of rows `rows`, columns `[k0, k0 + BLOCK_K)`, as exact floats, with their scales.
The codes come as eight position tensors [BLOCK_N, BLOCK_K // 8]: position i holds columns
`8 j + i`, the order in which eight columns sit in one 32-bit word of a packed 4-bit plane. Working
on whole words keeps the integer work near one instruction per weight:

* a code's bits are OR-ed, where they already sit in the word (bit b = 4 (i % 4) of the word or of
  the word shifted right by 16), into the mantissa of the float 2^(23 - b), whose mantissa bit b is
  worth 1; subtracting that float (plus the code bias) leaves the code, exactly. No shift per code,
  no int-to-float conversion (a quarter-rate instruction).
* the sign bits are flipped once per word (two's complement code + bias = an unsigned field).
* Q5 and Q6 high bits (one byte, or one 16-bit unit, per word of codes) are moved next to their low
  four bits with one shift and OR-ed in with one mask.
* Q8 codes are read as 64-bit words (eight columns), one byte per position at bit 0 or 8.

Every kernel interleaves the positions back into columns in registers (`interleave_positions`: joins,
no data movement between threads) and multiplies them with x's columns in order: the matrix-vector
kernels per token on CUDA cores (`dot_code_tile`; nvfp4 code tiles come in the same layout), or
scaled and rounded for several tokens at once on tensor cores (`mma_code_tile`, `scaled_columns`),
the tiled `tl.dot` kernels likewise (`tiles.load_tile`). Nothing is dequantized in memory.
`BLOCK_K` is a multiple of 128, so a tile never crosses a row's padded end and padding lanes (code 0,
scale 0) need no mask.
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def load_columns(ptr, k0, limit, BLOCK_K: tl.constexpr):
    """A vector's tile of columns [k0, k0 + BLOCK_K) in its dtype, 0 past `limit`."""
    cols = k0 + tl.arange(0, BLOCK_K)
    return tl.load(ptr + cols, mask=cols < limit, other=0.0)


@triton.jit
def interleave_positions(c, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """Eight position tiles [BLOCK_N, BLOCK_K // 8] -> the columns in order, [BLOCK_N, BLOCK_K]."""
    even = tl.join(tl.join(c[0], c[4]), tl.join(c[2], c[6]))
    odd = tl.join(tl.join(c[1], c[5]), tl.join(c[3], c[7]))
    return tl.reshape(tl.join(even, odd), [BLOCK_N, BLOCK_K])


@triton.jit
def _field_value(field, B: tl.constexpr, BIAS: tl.constexpr):
    """The code held by `field` (an int32 with the sign-flipped code, code + BIAS, at bit B and nothing
    else set), as an exact float32: OR-ed into the mantissa of 2^(23 - B), whose bit B is worth 1."""
    magic: tl.constexpr = (150 - B) << 23  # float bits of 2^(23 - B)
    value = (field | magic).to(tl.float32, bitcast=True)
    return value - tl.full([1], magic | (BIAS << B), tl.int32).to(tl.float32, bitcast=True)


@triton.jit
def _code(word, B: tl.constexpr, LOW_MASK: tl.constexpr, BIAS: tl.constexpr):
    """The code whose LOW_MASK bits sit at bit B of `word`."""
    return _field_value(word & (LOW_MASK << B), B, BIAS)


@triton.jit
def _with_high(word, high, B: tl.constexpr, SHIFT: tl.constexpr, HIGH_MASK: tl.constexpr, BIAS: tl.constexpr):
    """The code whose low four bits sit at bit B of `word` and whose high bits (HIGH_MASK) sit at bit
    4 + B - SHIFT of `high`."""
    moved = high << SHIFT if SHIFT >= 0 else high >> -SHIFT
    return _field_value((word & (15 << B)) | (moved & (HIGH_MASK << (B + 4))), B, BIAS)


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
    """(codes, scales): the tile's eight position tiles as exact float32 (a tuple, position i =
    columns 8 j + i) and its scales [BLOCK_N, BLOCK_K // GROUP] (float32)."""
    W: tl.constexpr = BLOCK_K // 8
    mask = row_mask[:, None]
    words = tl.arange(0, W)[None, :]
    if BITS == 8:
        ptr = obj.to(tl.pointer_type(tl.int64)) + rows[:, None] * (K_PAD // 8) + k0 // 8 + words
        packed = tl.load(ptr, mask=mask, other=0)
        low = packed.to(tl.int32) ^ -0x7F7F7F80  # flip each byte's sign bit: code + 128
        high = (packed >> 32).to(tl.int32) ^ -0x7F7F7F80
        low2, high2 = low >> 16, high >> 16
        codes = (
            _code(low, 0, 255, 128), _code(low, 8, 255, 128), _code(low2, 0, 255, 128), _code(low2, 8, 255, 128),
            _code(high, 0, 255, 128), _code(high, 8, 255, 128), _code(high2, 0, 255, 128), _code(high2, 8, 255, 128),
        )
    else:
        ptr = obj.to(tl.pointer_type(tl.int32)) + rows[:, None] * (K_PAD // 8) + k0 // 8 + words
        word = tl.load(ptr, mask=mask, other=0)
        if BITS == 4:
            word = word ^ -0x77777778  # flip each nibble's sign bit: code + 8
            upper = word >> 16
            codes = (
                _code(word, 0, 15, 8), _code(word, 4, 15, 8), _code(word, 8, 15, 8), _code(word, 12, 15, 8),
                _code(upper, 0, 15, 8), _code(upper, 4, 15, 8), _code(upper, 8, 15, 8), _code(upper, 12, 15, 8),
            )
        if BITS == 5:  # column 8 j + i's fifth bit: bit i of high byte j
            upper = word >> 16
            hptr = obj + high_offset + rows[:, None] * (K_PAD // 8) + k0 // 8 + words
            hb = tl.load(hptr, mask=mask, other=0).to(tl.int32) ^ 255  # flip the sign bits: code + 16
            codes = (
                _with_high(word, hb, 0, 4, 1, 16), _with_high(word, hb, 4, 7, 1, 16),
                _with_high(word, hb, 8, 10, 1, 16), _with_high(word, hb, 12, 13, 1, 16),
                _with_high(upper, hb, 0, 0, 1, 16), _with_high(upper, hb, 4, 3, 1, 16),
                _with_high(upper, hb, 8, 6, 1, 16), _with_high(upper, hb, 12, 9, 1, 16),
            )
        if BITS == 6:  # column 8 j + i's top two bits: bits 2 i of the high plane's 16-bit unit j
            upper = word >> 16
            hptr = (obj + high_offset).to(tl.pointer_type(tl.int16)) + rows[:, None] * (K_PAD // 8) + k0 // 8 + words
            hh = tl.load(hptr, mask=mask, other=0).to(tl.int32) ^ 0xAAAA  # flip the sign bits: code + 32
            codes = (
                _with_high(word, hh, 0, 4, 3, 32), _with_high(word, hh, 4, 6, 3, 32),
                _with_high(word, hh, 8, 8, 3, 32), _with_high(word, hh, 12, 10, 3, 32),
                _with_high(upper, hh, 0, -4, 3, 32), _with_high(upper, hh, 4, -2, 3, 32),
                _with_high(upper, hh, 8, 0, 3, 32), _with_high(upper, hh, 12, 2, 3, 32),
            )
    sptr = (obj + scale_offset).to(tl.pointer_type(tl.float16))
    sptr = sptr + rows[:, None] * (K_PAD // GROUP) + k0 // GROUP + tl.arange(0, BLOCK_K // GROUP)[None, :]
    scales = tl.load(sptr, mask=mask, other=0.0).to(tl.float32)
    return codes, scales


@triton.jit
def scaled_columns(codes, scales, GROUP: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """float32 [BLOCK_N, BLOCK_K]: a tile's code positions interleaved into columns, times their group's scale."""
    per_column = tl.reshape(tl.broadcast_to(scales[:, :, None], [BLOCK_N, BLOCK_K // GROUP, GROUP]), [BLOCK_N, BLOCK_K])
    return interleave_positions(codes, BLOCK_N, BLOCK_K) * per_column


@triton.jit
def dot_code_tile(codes, scales, x, GROUP: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """[BLOCK_N] float32: sum over a tile's columns of W[rows, k] * x[k] from `load_code_tile`'s output
    (or `nvfp4.load_nvfp4_code_tile`'s, GROUP 16) and the tile's x columns in order, [BLOCK_K]
    (`load_columns`). The code positions are interleaved into columns in registers; products are summed
    per scale group and only then scaled. Splitting x into positions instead would cost a shared-memory
    layout conversion per position (docs/performance.md, Kernels)."""
    products = interleave_positions(codes, BLOCK_N, BLOCK_K) * x.to(tl.float32)[None, :]
    per_group = tl.sum(tl.reshape(products, [BLOCK_N, BLOCK_K // GROUP, GROUP]), axis=2)
    return tl.sum(per_group * scales, axis=1)


@triton.jit
def mma_code_tile(codes, scales, x, acc, GROUP: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, IEEE: tl.constexpr):
    """acc [BLOCK_T, BLOCK_N] plus the tile's product with several tokens on tensor cores: `x` are their
    columns in order [BLOCK_T, BLOCK_K] (BLOCK_T >= 16, rows past the tokens zero) in the activation dtype;
    each code times its group's scale (`scaled_columns`) is rounded to that dtype as a dequantized weight, and
    one product of BLOCK_K columns adds them up (IEEE: float32 without TF32 rounding). A product per position (eight of
    BLOCK_K // 8 columns) is slower: each operand passes its own shared-memory layout conversion
    (docs/performance.md, Kernels)."""
    weights = tl.trans(scaled_columns(codes, scales, GROUP, BLOCK_N, BLOCK_K).to(x.dtype))
    if IEEE:
        return tl.dot(x, weights, acc, input_precision="ieee")
    return tl.dot(x, weights, acc)
