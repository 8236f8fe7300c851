"""Triton building block: decode a tile of a `row_split_k128_v1` object in registers.

Every quantized kernel (dense linear, routed MoE) reads row-split weights through `load_weight_tile`
(by way of `kernels/tiles.py`), which takes the object's base address and its plane offsets
(docs/format.md §6.2) and returns the dequantized values `fp32(scale) * code` of rows `rows`,
columns `[k0, k0 + BLOCK_K)`. Nothing is dequantized in memory. `BLOCK_K` is a multiple of 128, so a tile never crosses a row's padded end
and padding lanes (code 0, scale 0) need no mask.
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def load_weight_tile(
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
    """Dequantized float32 tile [BLOCK_N, BLOCK_K] of the object."""
    mask = row_mask[:, None]
    if BITS == 8:
        ptr = obj + rows[:, None] * K_PAD + k0 + tl.arange(0, BLOCK_K)[None, :]
        codes = tl.load(ptr.to(tl.pointer_type(tl.int8)), mask=mask, other=0).to(tl.int32)
    else:
        ptr = obj + rows[:, None] * (K_PAD // 2) + k0 // 2 + tl.arange(0, BLOCK_K // 2)[None, :]
        packed = tl.load(ptr, mask=mask, other=0).to(tl.int32)
        u = tl.reshape(tl.join(packed & 15, packed >> 4), [BLOCK_N, BLOCK_K])
        if BITS == 5:
            hptr = obj + high_offset + rows[:, None] * (K_PAD // 8) + k0 // 8 + tl.arange(0, BLOCK_K // 8)[None, :]
            hb = tl.load(hptr, mask=mask, other=0).to(tl.int32)
            bits = (hb[:, :, None] >> tl.arange(0, 8)[None, None, :]) & 1
            u = u | (tl.reshape(bits, [BLOCK_N, BLOCK_K]) << 4)
        if BITS == 6:
            hptr = obj + high_offset + rows[:, None] * (K_PAD // 4) + k0 // 4 + tl.arange(0, BLOCK_K // 4)[None, :]
            hb = tl.load(hptr, mask=mask, other=0).to(tl.int32)
            bits = (hb[:, :, None] >> (2 * tl.arange(0, 4))[None, None, :]) & 3
            u = u | (tl.reshape(bits, [BLOCK_N, BLOCK_K]) << 4)
        half: tl.constexpr = 1 << (BITS - 1)
        codes = tl.where(u >= half, u - 2 * half, u)
    sptr = (obj + scale_offset).to(tl.pointer_type(tl.float16))
    sptr = sptr + rows[:, None] * (K_PAD // GROUP) + k0 // GROUP + tl.arange(0, BLOCK_K // GROUP)[None, :]
    scales = tl.load(sptr, mask=mask, other=0.0).to(tl.float32)
    scales = tl.reshape(tl.broadcast_to(scales[:, :, None], [BLOCK_N, BLOCK_K // GROUP, GROUP]), [BLOCK_N, BLOCK_K])
    return codes.to(tl.float32) * scales
