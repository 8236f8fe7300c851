"""Routed experts computed on the host: numba kernels that read the stored quantized records.

A routed expert is `y = W_down (silu(W_gate x) * W_up x)` weighted by its router weight and added
into the layer output. The kernels read the record bytes (`ExpertRecordLayout`: gate/up object
[2I, H] then down object [H, I]) directly, group by group; no dequantized copy of a matrix is ever
made. Q4 and Q5 (the official expert formats) take an integer path (activations split into
signed-byte parts, exact int32 dots over 128-lane blocks, see "Q4/Q5: integer dots" below); Q6
and Q8 a float path (codes unpacked in the inner loop into fp32 accumulators), and so does nvfp4
(E2M1 codes and E4M3FN block scales through lookup tables, the scale of each 16-lane block read at
its swizzled offset, the row's sum divided by its tile's FP32 divisor). Rows go two per pass (gate
row i with up row i, down rows h and h + 1) so each activation load feeds both.

One call (one numba dispatch) computes every (token, expert, weight) assignment of a layer; each
projection is split into work items of consecutive rows of one expert, which the threads claim
from an atomic counter in guided chunks (sequential reads, no two threads write one element, and
a thread the host delays holds up only its chunk).

Lane order: a base byte holds two lanes, so the activations are permuted once per call and every
inner loop reads them contiguously (`lane_order`).

`routed_experts_cpu` is the entry point; `reference_routed` is the oracle it must match (codecs
decode + numpy).
"""

from __future__ import annotations

import threading
from dataclasses import dataclass

import numpy as np
import numba
from numba import njit, prange, types
from numba.extending import intrinsic

from ninfer_offload.artifact.codecs import E2M1_VALUES, E4M3FN_VALUES, decode_nvfp4, decode_row_split_values
from ninfer_offload.artifact.formats import BlockScaleGeometry, ObjectGeometry
from ninfer_offload.artifact.records import ExpertRecordLayout
from ninfer_offload.errors import NinferError
from ninfer_offload.kernels.cpu import simd
from ninfer_offload.kernels.cpu.atomics import fetch_add as _fetch_add, load_acquire as _load_acquire

# float32 value of every binary16 word (exact, subnormals included).
F16_TO_F32 = np.arange(65536, dtype=np.uint16).view(np.float16).astype(np.float32)

# Rows per parallel work item: consecutive rows (sequential reads), small enough that one
# expert splits into many items and 15-16 threads stay balanced. ACT_ITEM divides 64, so each
# gate/up item lies inside one 64-lane group of the down projection's input.
ACT_ITEM = 8
OUT_ITEM = 32
# Counters that threads update concurrently sit this many int64 apart (128 bytes: their own cache
# line and its prefetch pair), so updating one never takes another's line from a thread.
COUNTER_STRIDE = 16


# `geometry_vector`'s bits field of an nvfp4 object (no row-split format has 0 bits).
NVFP4_BITS = 0


def geometry_vector(geo: ObjectGeometry, object_offset: int) -> np.ndarray:
    """The int64 description of one quantized object inside a record that the kernels take:
    [bits (NVFP4_BITS for nvfp4), groups per row, base bytes per group, high bytes per group, high
    plane offset, scale plane offset, object offset in the record, rows, divisor offset (nvfp4)]."""
    if isinstance(geo, BlockScaleGeometry):
        fields = [NVFP4_BITS, geo.k // 16, 8, 0, 0, geo.scale_offset, object_offset, geo.n, geo.divisor_offset]
    else:
        f = geo.fmt
        fields = [f.bits, geo.groups_per_row, f.base_bytes, f.high_bytes, geo.high_offset, geo.scale_offset, object_offset, geo.n, 0]
    return np.array(fields, dtype=np.int64)


def lane_permutation(group: int, k_pad: int) -> np.ndarray:
    """Index array p with permuted[p[i]] = natural[i], per 128-lane block.

    Q4/Q5/Q6 (two 64-lane groups per block): [even lanes of group 0 | even lanes of group 1 | odd
    lanes of group 0 | odd lanes of group 1], so base byte j of the block (low nibble, high
    nibble) feeds positions j and 64 + j. Q8 (one byte per lane): natural order.
    """
    i = np.arange(k_pad, dtype=np.int64)
    if group == 32:
        return i
    block, within = i - i % 128, i % 128
    return block + 64 * (within % 2) + 32 * (within // 64) + (within % 64) // 2


# ----------------------------------------------------------------------------- numba kernels


# Each row-dot decodes one stored row group by group and dots it with x (permuted lane order) in
# fp32. numba widens int32 arithmetic to int64, which stops LLVM from vectorising the unpacking,
# so codes are built with 32-bit intrinsics (shifts, one bitwise select).
_I32 = np.int32
_F32 = np.float32


@intrinsic
def _merge(typingctx, low, high, low_mask, high_mask):
    """(low & low_mask) | (high & high_mask) in int32 (one bitwise select)."""
    sig = types.int32(types.int32, types.int32, types.int32, types.int32)

    def codegen(context, builder, signature, args):
        low, high, low_mask, high_mask = args
        return builder.or_(builder.and_(low, low_mask), builder.and_(high, high_mask))

    return sig, codegen


@intrinsic
def _shl(typingctx, value, amount):
    """value << amount in int32 (bits shifted out are dropped)."""
    sig = types.int32(types.int32, types.int32)
    return sig, lambda context, builder, signature, args: builder.shl(args[0], args[1])


@intrinsic
def _sar(typingctx, value, amount):
    """value >> amount in int32, sign-extending."""
    sig = types.int32(types.int32, types.int32)
    return sig, lambda context, builder, signature, args: builder.ashr(args[0], args[1])


# Codes are built at the top of an int32 (sign bit = the code's sign bit), so no sign extension is
# needed: float(word) is code * 2**(32 - bits) exactly. The activations are prepared multiplied by
# the inverse power of two (`lane_order`: exact), so the inner loops pay no extra multiply.
_Q6_NIBBLE, _Q6_HIGH = _I32(0x3C000000), _I32(-0x40000000)  # nibble at bits 26-29, high bits at 30-31


@njit(nogil=True, cache=True, fastmath=True, inline="always")
def _row_dot_q6(u8, u32, u16, lut, base_at, high_at, scale_at, gpr, x, tok):
    acc = _F32(0.0)
    low_top, high_top, two = _I32(26), _I32(22), _I32(2)
    for blk in range(gpr // 2):
        q = u8[base_at + 64 * blk : base_at + 64 * blk + 64]
        s0, s1 = lut[u16[scale_at + 2 * blk]], lut[u16[scale_at + 2 * blk + 1]]
        h = u32[high_at + 8 * blk : high_at + 8 * blk + 8]  # bits 4-5 of 16 lanes per word
        d = _F32(0.0)
        for half in range(2):  # one group each: keeps the word choice to four
            w0, w1, w2, w3 = _I32(h[4 * half]), _I32(h[4 * half + 1]), _I32(h[4 * half + 2]), _I32(h[4 * half + 3])
            s = s0 if half == 0 else s1
            for j in range(32):
                b = _I32(q[32 * half + j])
                w = w0 if j < 8 else (w1 if j < 16 else (w2 if j < 24 else w3))
                to_top = _I32(30 - (4 * j) & 31)  # moves the lane's two high bits to bits 30-31
                lo = _merge(_shl(b, low_top), _shl(w, to_top), _Q6_NIBBLE, _Q6_HIGH)
                hi = _merge(_shl(b, high_top), _shl(w, to_top - two), _Q6_NIBBLE, _Q6_HIGH)
                d += s * (_F32(lo) * x[tok, 128 * blk + 32 * half + j] + _F32(hi) * x[tok, 128 * blk + 64 + 32 * half + j])
        acc += d
    return acc


@njit(nogil=True, cache=True, fastmath=True, inline="always")
def _row_dot_q8(i8, u16, lut, base_at, scale_at, gpr, x, tok):
    acc = _F32(0.0)
    for blk in range(gpr // 4):  # 128 lanes = 4 groups of 32 bytes
        q = i8[base_at + 128 * blk : base_at + 128 * blk + 128]  # the code is the signed byte
        sc = u16[scale_at + 4 * blk : scale_at + 4 * blk + 4]
        s0, s1, s2, s3 = lut[sc[0]], lut[sc[1]], lut[sc[2]], lut[sc[3]]
        d = _F32(0.0)
        for j in range(128):
            s = s0 if j < 32 else (s1 if j < 64 else (s2 if j < 96 else s3))
            d += s * (_F32(q[j]) * x[tok, 128 * blk + j])
        acc += d
    return acc


@njit(nogil=True, cache=True, fastmath=True, inline="always")
def _row_dot(u8, i8, u32, u16, lut, geo, record_at, row, x, tok):
    """dot(row `row` of the Q6 or Q8 object described by geo inside the record at record_at, x[tok])."""
    gpr = geo[1]
    at = record_at + geo[6]
    base_at = at + row * gpr * geo[2]
    scale_at = (at + geo[5]) // 2 + row * gpr
    if geo[0] == 8:
        return _row_dot_q8(i8, u16, lut, base_at, scale_at, gpr, x, tok)
    return _row_dot_q6(u8, u32, u16, lut, base_at, (at + geo[4] + row * gpr * geo[3]) // 4, scale_at, gpr, x, tok)


@njit(nogil=True, cache=True, fastmath=True, inline="always")
def _row_dot_nvfp4(u8, f32, e2m1, e4m3, geo, record_at, row, x, tok):
    """dot(row `row` of the nvfp4 object described by geo inside the record at record_at, x[tok]):
    per 16-lane block its codes (natural lane order, low nibble first) times its scale, which sits
    at the block's swizzled offset (docs/format.md §6.3); the sum divided by the row tile's divisor."""
    at = record_at + geo[6]
    k_tiles = geo[1] // 4
    inner = row % 128
    base_at = at + row * geo[1] * 8
    scale_at = at + geo[5] + (row // 128) * k_tiles * 512 + (inner % 32) * 16 + (inner // 32) * 4
    acc = _F32(0.0)
    for tile in range(k_tiles):
        for lane in range(4):  # the tile's four 16-lane blocks: scale bytes side by side
            q = base_at + 32 * tile + 8 * lane
            col = 64 * tile + 16 * lane
            d = _F32(0.0)
            for j in range(8):
                b = u8[q + j]
                d += e2m1[b & 15] * x[tok, col + 2 * j] + e2m1[b >> 4] * x[tok, col + 2 * j + 1]
            acc += e4m3[u8[scale_at + 512 * tile + lane]] * d
    return acc / f32[(at + geo[8]) // 4 + row // 128]


# ----------------------------------------------------------------------------- Q4/Q5: integer dots

# Q4 and Q5 groups take an integer path. The activations are split, per 64-lane group, into
# signed-byte parts, x = unit * (p0 * 2**7 + p1) (two parts, |error| <= max|x| * 2**-15) or
# x = unit * (p0 * 2**14 + p1 * 2**7 + p2) (three parts, <= max|x| * 2**-22, below float32
# rounding of the sums). A block of two groups (128 lanes, 64 base bytes) is dotted in int32 with
# the codes as unsigned bytes code + zero point (`simd.dot_u8s8`: AVX-512 VNNI where present),
# exactly; per int32 lane the zero point comes off through the precomputed zero point times the
# represented sum of the lane's activations (`zero_sums`), then each group's lanes are scaled by
# its code scale times its activation unit. Lanes are in the 128-lane block order of
# `lane_permutation`, so the low nibbles of a block's base bytes are its even lanes.
INTEGER_PATH_BITS = (4, 5)
# The integer loops prefetch the codes this many bytes ahead of the block they read (the next
# gate/up row, four down rows ahead): a single core's hardware prefetchers do not keep these short
# row streams fed; 1 KB ahead was the best distance tried (docs/performance.md, CPU expert path).
PREFETCH_BYTES = 1024
_PART_STEPS = 128.0  # 2**7 between parts
EXACT_PARTS, SIXTEEN_BIT_PARTS = 3, 2  # for float32 activations, for bf16/fp16 ones


@njit(nogil=True, cache=True, inline="always")
def _integer_path(geo):
    """Whether the object described by geo takes the integer path."""
    return geo[0] in INTEGER_PATH_BITS


@njit(nogil=True, cache=True, inline="always")
def _zero_point(geo):
    return 8 if geo[0] == 4 else 16


@njit(nogil=True, cache=True)
def _split_group(values, parts, units, zero_sums, row, g, zero_point):
    """Split group g of values[row] (float32, block order) into parts[row, 0..P) (int8). Per int32
    lane of the group's half of its block: units[row] (the value of one step of the combined
    integer) and zero_sums[row] (zero_point times the combined integers of the lane's 8
    activations). Arguments are whole arrays and a row (no views: see `_routed_kernel`)."""
    nparts = parts.shape[1]
    at = 128 * (g // 2) + 32 * (g % 2)  # even lanes at at + j, odd lanes at at + 64 + j (j < 32)
    lanes = 16 * (g // 2) + 8 * (g % 2)
    top = 0.0
    for j in range(32):
        top = max(top, abs(np.float64(values[row, at + j])), abs(np.float64(values[row, at + 64 + j])))
    if top == 0.0 or not np.isfinite(top):
        for j in range(32):
            for p in range(nparts):
                parts[row, p, at + j], parts[row, p, at + 64 + j] = 0, 0
        for i in range(8):
            units[row, lanes + i] = 0.0 if top == 0.0 else np.nan
            zero_sums[row, lanes + i] = 0
        return
    unit = top / 127.0 / _PART_STEPS ** (nparts - 1)
    inverse = 127.0 / top
    for i in range(8):
        combined = 0
        for j in range(8):
            pos = at + 4 * i + j if j < 4 else at + 64 + 4 * i + j - 4
            r = np.float64(values[row, pos]) * inverse
            value = 0
            for p in range(nparts):
                q = np.rint(r)
                parts[row, p, pos] = q
                value = value * 128 + np.int64(q)
                r = (r - q) * _PART_STEPS
            combined += value
        zero_sums[row, lanes + i] = zero_point * combined
        units[row, lanes + i] = unit


# `_rows_dot_integer` is built once per (format, parts) combination, so each compiles to its own
# straight loop. Parts are read at flat element offsets of the [rows, parts, width] array.


@njit(nogil=True, cache=True, inline="always")
def _q4_block(u8, base_at, high_at):
    return simd.q4_block(u8, base_at)


@njit(nogil=True, cache=True, inline="always")
def _q5_block(u8, base_at, high_at):
    return simd.q5_block(u8, base_at, high_at)


@njit(nogil=True, cache=True, inline="always")
def _two_part_ints(low, high, parts, at, stride):
    """Combined int32 dot of a block's codes (low, high) with two activation parts (part p of the
    block at flat offset at + p * stride)."""
    d = simd.dot_u8s8(simd.dot_u8s8(simd.int_zeros(), low, simd.load_bytes(parts, at)), high, simd.load_bytes(parts, at + 64))
    at += stride
    return simd.dot_u8s8(simd.dot_u8s8(simd.shift_left(d, 7), low, simd.load_bytes(parts, at)), high, simd.load_bytes(parts, at + 64))


@njit(nogil=True, cache=True, inline="always")
def _three_part_ints(low, high, parts, at, stride):
    """`_two_part_ints` with a third part."""
    d = _two_part_ints(low, high, parts, at, stride)
    at += 2 * stride
    return simd.dot_u8s8(simd.dot_u8s8(simd.shift_left(d, 7), low, simd.load_bytes(parts, at)), high, simd.load_bytes(parts, at + 64))


def _rows_dot_integer(block_codes, block_ints):
    """The row-pair dot of a Q4 or Q5 object (`block_codes`) with x given as parts (`block_ints`)."""

    @njit(nogil=True, cache=True, fastmath=True, inline="always")
    def rows_dot(u8, u16, lut, geo, record_at, row_a, row_b, parts, units, zero_sums, tok):
        """(dot(row row_a, x[tok]), dot(row row_b, x[tok])): one pass over the blocks, the
        activation parts loaded once for both rows."""
        gpr = geo[1]
        at = record_at + geo[6]
        base_a, base_b = at + row_a * gpr * geo[2], at + row_b * gpr * geo[2]
        scale_a, scale_b = (at + geo[5]) // 2 + row_a * gpr, (at + geo[5]) // 2 + row_b * gpr
        high_a, high_b = at + geo[4] + row_a * gpr * geo[3], at + geo[4] + row_b * gpr * geo[3]
        width = parts.shape[2]
        parts_at, lanes_at = tok * parts.shape[1] * width, tok * units.shape[1]
        acc_a, acc_b = simd.float_zeros(), simd.float_zeros()
        for blk in range(gpr // 2):
            simd.prefetch(u8, base_a + 64 * blk + PREFETCH_BYTES)
            simd.prefetch(u8, base_b + 64 * blk + PREFETCH_BYTES)
            low_a, odd_a = block_codes(u8, base_a + 64 * blk, high_a + 16 * blk)
            low_b, odd_b = block_codes(u8, base_b + 64 * blk, high_b + 16 * blk)
            zero = simd.load_ints(zero_sums, lanes_at + 16 * blk)
            unit = simd.load_floats(units, lanes_at + 16 * blk)
            d_a = simd.sub_ints(block_ints(low_a, odd_a, parts, parts_at + 128 * blk, width), zero)
            d_b = simd.sub_ints(block_ints(low_b, odd_b, parts, parts_at + 128 * blk, width), zero)
            sa, sb = np.uintp(scale_a + 2 * blk), np.uintp(scale_b + 2 * blk)  # unsigned: no wraparound checks
            acc_a = simd.add_block_scaled(acc_a, d_a, lut[u16[sa]], lut[u16[sa + np.uintp(1)]], unit)
            acc_b = simd.add_block_scaled(acc_b, d_b, lut[u16[sb]], lut[u16[sb + np.uintp(1)]], unit)
        return simd.total(acc_a), simd.total(acc_b)

    return rows_dot


_q4_two, _q4_three = _rows_dot_integer(_q4_block, _two_part_ints), _rows_dot_integer(_q4_block, _three_part_ints)
_q5_two, _q5_three = _rows_dot_integer(_q5_block, _two_part_ints), _rows_dot_integer(_q5_block, _three_part_ints)


@njit(nogil=True, cache=True, fastmath=True, inline="always")
def _rows_dot(u8, i8, u32, u16, f32, lut, fp4, fp8, geo, record_at, row_a, row_b, x, parts, units, zero_sums, tok):
    """(dot(row row_a, x[tok]), dot(row row_b, x[tok])): Q4/Q5 through the integer path (x as
    parts, the variant for the format and the number of parts), Q6/Q8 and nvfp4 through the float
    path (x permuted and pre-scaled; nvfp4: natural order)."""
    if geo[0] == NVFP4_BITS:
        return (
            _row_dot_nvfp4(u8, f32, fp4, fp8, geo, record_at, row_a, x, tok),
            _row_dot_nvfp4(u8, f32, fp4, fp8, geo, record_at, row_b, x, tok),
        )
    if geo[0] == 4:
        if parts.shape[1] == 2:
            return _q4_two(u8, u16, lut, geo, record_at, row_a, row_b, parts, units, zero_sums, tok)
        return _q4_three(u8, u16, lut, geo, record_at, row_a, row_b, parts, units, zero_sums, tok)
    if geo[0] == 5:
        if parts.shape[1] == 2:
            return _q5_two(u8, u16, lut, geo, record_at, row_a, row_b, parts, units, zero_sums, tok)
        return _q5_three(u8, u16, lut, geo, record_at, row_a, row_b, parts, units, zero_sums, tok)
    return _row_dot(u8, i8, u32, u16, lut, geo, record_at, row_a, x, tok), _row_dot(u8, i8, u32, u16, lut, geo, record_at, row_b, x, tok)


@njit(nogil=True, cache=True)
def _zeros_serial(n, dtype):
    """np.zeros without a parallel region (inside a parallel function np.zeros is one)."""
    out = np.empty(n, dtype=dtype)
    for i in range(n):
        out[i] = 0
    return out


@njit(nogil=True, cache=True, inline="always")
def _chunk(remaining, workers):
    """Guided scheduling: a worker claims half its fair share of what is left (at least one item),
    so the first chunks are long sequential streams and the last ones balance the finish."""
    return max(1, remaining // (2 * workers))


@njit(parallel=True, nogil=True, cache=True, fastmath=True)
def _routed_kernel(
    records, lut, fp4, fp8, geometry, gate_up_perm, gate_up_scale, down_perm, down_scale, record_offsets, record_bytes, ids, weights,
    selected, x, out, nparts, workers,
):
    """out[t] += sum over selected (t, j) of weights[t, j] * expert_{ids[t, j]}(x[t]); False when a
    selected expert has no record inside `records` (nothing is computed then). `workers`: the
    number of numba threads (one counter-draining loop each). lut, fp4, fp8: the float32 values of
    every FP16 word, E2M1 code and E4M3FN byte.

    Serial set-up: assignments grouped by expert (CSR, experts ascending), activations permuted
    and pre-scaled into the gate/up object's lane order. Then both projections run over work items
    of consecutive rows of one expert (every scratch element has one writer): all gate/up items,
    then all down items, which the worker threads claim in guided chunks from an atomic counter
    (long sequential streams first, then smaller chunks, so a thread that the host delays holds up
    one item, not a fixed share). One parallel region: a down item waits only until its expert's
    gate/up items are done (a per-expert atomic count), not for the whole layer. The weighted sum
    into out is a short serial loop.

    Inside the parallel region the per-token buffers are passed whole with a row index, never as
    views: each view takes and drops a reference on its buffer with an atomic add, and all threads
    share those counters.
    """
    t, k = ids.shape
    num = record_offsets.shape[0]
    counts = _zeros_serial(num, np.int64)
    for i in range(t):
        for j in range(k):
            if selected[i, j]:
                e = ids[i, j]
                if e < 0 or e >= num or record_offsets[e] < 0 or record_offsets[e] + record_bytes > records.shape[0]:
                    return False
                counts[e] += 1
    slots = 0
    for e in range(num):
        slots += counts[e] > 0
    record_at = np.empty(slots, dtype=np.int64)
    starts = np.empty(slots + 1, dtype=np.int64)
    fill = np.empty(num, dtype=np.int64)
    s = 0
    pos = 0
    for e in range(num):
        if counts[e] > 0:
            record_at[s] = record_offsets[e]
            starts[s] = pos
            fill[e] = pos
            pos += counts[e]
            s += 1
    starts[slots] = pos
    tokens = np.empty(pos, dtype=np.int64)
    wts = np.empty(pos, dtype=np.float32)
    for i in range(t):
        for j in range(k):
            if selected[i, j]:
                e = ids[i, j]
                tokens[fill[e]] = i
                wts[fill[e]] = weights[i, j]
                fill[e] += 1
    gate_up, down = geometry[0], geometry[1]
    inter, hidden = gate_up[7] // 2, down[7]
    gu_width, dn_width = gate_up_scale.shape[0], down_scale.shape[0]
    xp = _zeros_serial(t * gu_width, np.float32).reshape(t, gu_width)
    for i in range(t):
        for lane in range(x.shape[1]):
            xp[i, gate_up_perm[lane]] = x[i, lane] * gate_up_scale[gate_up_perm[lane]]
    gu_integer, dn_integer = _integer_path(gate_up), _integer_path(down)
    gu_groups, dn_groups = gu_width // 64 if gu_integer else 0, dn_width // 64 if dn_integer else 0
    x_parts = np.empty((t, nparts, gu_groups * 64), dtype=np.int8)  # every group is split below
    x_units, x_sums = np.empty((t, gu_groups * 8), dtype=np.float32), np.empty((t, gu_groups * 8), dtype=np.int32)
    for i in range(t):
        for g in range(gu_groups):
            _split_group(xp, x_parts, x_units, x_sums, i, g, _zero_point(gate_up))
    act = _zeros_serial(pos * dn_width, np.float32).reshape(pos, dn_width)
    # each group with rows is split once its items are done; groups wholly past the intermediate
    # size (padding, zero scales) have no items and are split here (to zeros: 0 * garbage is NaN)
    act_parts = np.empty((pos, nparts, dn_groups * 64), dtype=np.int8)
    act_units, act_sums = np.empty((pos, dn_groups * 8), dtype=np.float32), np.empty((pos, dn_groups * 8), dtype=np.int32)
    for a in range(pos):
        for g in range((inter + 63) // 64, dn_groups):
            _split_group(act, act_parts, act_units, act_sums, a, g, _zero_point(down))
    partial = np.empty((pos, hidden), dtype=np.float32)
    n = records.shape[0]
    u8, i8, u32, u16 = records, records.view(np.int8), records[: n - n % 4].view(np.uint32), records[: n - n % 2].view(np.uint16)
    f32 = records[: n - n % 4].view(np.float32)

    items = (inter + ACT_ITEM - 1) // ACT_ITEM
    blocks = (hidden + OUT_ITEM - 1) // OUT_ITEM
    first_down = slots * items
    total = first_down + slots * blocks
    # counter 0: next work item; 1 + s: gate/up items of slot s done; 1 + slots + s * dn_groups + g:
    # items done of slot s's intermediate group g (its last item splits the group into parts);
    # counter c lives at sync[c * COUNTER_STRIDE]
    sync = _zeros_serial((1 + slots + slots * dn_groups) * COUNTER_STRIDE, np.int64)
    for _ in prange(workers):
        size = _chunk(total, workers)
        first = _fetch_add(sync, 0, size)
        while first < total:
            for item in range(first, min(first + size, total)):
                if item < first_down:
                    s, r0 = item // items, (item % items) * ACT_ITEM
                    for i in range(r0, min(r0 + ACT_ITEM, inter)):
                        for a in range(starts[s], starts[s + 1]):
                            tok = tokens[a]
                            gate, up = _rows_dot(
                                u8, i8, u32, u16, f32, lut, fp4, fp8, gate_up, record_at[s], i, inter + i, xp, x_parts, x_units, x_sums, tok
                            )
                            act[a, down_perm[i]] = gate / (_F32(1.0) + np.exp(-gate)) * up * down_scale[down_perm[i]]
                    if dn_integer:
                        g = r0 // 64
                        group_items = (min(64 * g + 64, inter) - 64 * g + ACT_ITEM - 1) // ACT_ITEM
                        if _fetch_add(sync, (1 + slots + s * dn_groups + g) * COUNTER_STRIDE, 1) == group_items - 1:
                            for a in range(starts[s], starts[s + 1]):
                                _split_group(act, act_parts, act_units, act_sums, a, g, _zero_point(down))
                    _fetch_add(sync, (1 + s) * COUNTER_STRIDE, 1)
                else:
                    s, h0 = (item - first_down) // blocks, ((item - first_down) % blocks) * OUT_ITEM
                    while _load_acquire(sync, (1 + s) * COUNTER_STRIDE) < items:  # wait for this expert's activations
                        pass
                    for h in range(h0, min(h0 + OUT_ITEM, hidden), 2):  # row pairs (the last one alone when odd)
                        h1 = min(h + 1, hidden - 1)
                        for a in range(starts[s], starts[s + 1]):
                            partial[a, h], partial[a, h1] = _rows_dot(
                                u8, i8, u32, u16, f32, lut, fp4, fp8, down, record_at[s], h, h1, act, act_parts, act_units, act_sums, a
                            )
            size = _chunk(total - first - size, workers)
            first = _fetch_add(sync, 0, size)

    for a in range(pos):  # serial: a few thousand adds cost less than another parallel region
        row = out[tokens[a]]
        for h in range(hidden):
            row[h] += wts[a] * partial[a, h]
    return True


# ----------------------------------------------------------------------------- host-side entry


def lane_order(geo: ObjectGeometry) -> tuple[np.ndarray, np.ndarray]:
    """(permutation, per-permuted-lane scale) of the activations an object's rows are dotted with:
    the 128-lane block order (`lane_permutation`); no scale on the integer path (Q4/Q5), on the
    float path the exact power of two that turns the kernels' top-of-word codes back into codes
    (Q6 codes sit at the top of the word, Q8 bytes are the codes). nvfp4: natural order, no scale."""
    if isinstance(geo, BlockScaleGeometry):
        return np.arange(geo.k, dtype=np.int64), np.ones(geo.k, dtype=np.float32)
    bits = geo.fmt.bits
    scale = 2.0 ** -(32 - bits) if bits == 6 else 1.0
    return lane_permutation(geo.fmt.group, geo.k_pad), np.full(geo.k_pad, scale, dtype=np.float32)


@dataclass(frozen=True)
class RecordKernelPlan:
    """Per-layout constants the kernel needs (built once per record layout)."""

    layout: ExpertRecordLayout
    geometry: np.ndarray  # [2, 9]: gate/up, down (`geometry_vector`)
    gate_up_perm: np.ndarray  # natural hidden lane -> permuted position
    gate_up_scale: np.ndarray  # per permuted position (`lane_order`)
    down_perm: np.ndarray  # natural intermediate lane -> permuted position
    down_scale: np.ndarray

    @classmethod
    def create(cls, layout: ExpertRecordLayout) -> "RecordKernelPlan":
        gu, dn = layout.gate_up, layout.down
        if gu.n != 2 * dn.k or gu.k != dn.n:
            raise NinferError(f"expert record shapes gate/up {[gu.n, gu.k]} and down {[dn.n, dn.k]} do not agree")
        return cls(
            layout,
            np.stack([geometry_vector(gu, layout.gate_up_offset), geometry_vector(dn, layout.down_offset)]),
            *lane_order(gu),
            *lane_order(dn),
        )


def routed_experts_cpu(
    plan: RecordKernelPlan,
    records: np.ndarray,
    record_offsets: np.ndarray,
    x: np.ndarray,
    topk_ids: np.ndarray,
    topk_weights: np.ndarray,
    selected: np.ndarray | None = None,
    activation_parts: int = EXACT_PARTS,
    out: np.ndarray | None = None,
) -> np.ndarray:
    """Sum over assignments of weight * expert(x[token]) -> [T, H] float32 (numba kernels), added
    into `out` (contiguous float32 [T, H]) when given.

    records: uint8 buffer holding the records; record_offsets[e]: byte offset of expert e's record
    in it. selected: optional bool mask [T, k] of the assignments to compute (others skipped).
    activation_parts: signed-byte parts per activation on the Q4/Q5 integer path: EXACT_PARTS
    (float32 activations: error below float32 rounding) or SIXTEEN_BIT_PARTS (activations that
    come from a bf16/fp16 engine: error <= 2**-15 of the group's largest activation, below the
    rounding those activations already carry).
    """
    if activation_parts not in (SIXTEEN_BIT_PARTS, EXACT_PARTS):
        raise NinferError(f"activation_parts must be {SIXTEEN_BIT_PARTS} or {EXACT_PARTS}, not {activation_parts}")
    x = np.ascontiguousarray(x, dtype=np.float32)
    if x.shape[1] != plan.layout.gate_up.k:
        raise NinferError(f"activations have width {x.shape[1]}, the expert records expect {plan.layout.gate_up.k}")
    ids = np.ascontiguousarray(topk_ids, dtype=np.int64)
    mask = np.ones(ids.shape, dtype=np.bool_) if selected is None else np.ascontiguousarray(selected, dtype=np.bool_)
    if out is None:
        out = np.zeros(x.shape, dtype=np.float32)
    elif out.shape != x.shape or out.dtype != np.float32 or not out.flags.c_contiguous:
        raise NinferError(f"out must be contiguous float32 {list(x.shape)}")
    ok = _routed_kernel(
        np.ascontiguousarray(records).reshape(-1).view(np.uint8), F16_TO_F32, E2M1_VALUES, E4M3FN_VALUES, plan.geometry,
        plan.gate_up_perm, plan.gate_up_scale, plan.down_perm, plan.down_scale, np.ascontiguousarray(record_offsets, dtype=np.int64),
        plan.layout.nbytes, ids, np.ascontiguousarray(topk_weights, dtype=np.float32), mask, x, out, activation_parts,
        numba.get_num_threads(),
    )
    if not ok:
        raise NinferError("a routed expert selected for CPU compute has no host record")
    return out


_warm_lock = threading.Lock()
_warm = False


def warm_up() -> None:
    """Compile (or load from numba's cache) the kernel and start numba's thread pool, once per process."""
    global _warm
    with _warm_lock:
        if _warm:
            return
        layout = ExpertRecordLayout.create("q4_g64_fp16", "q5_g64_fp16", 128, 64)
        ones = np.ones((1, 1), dtype=np.float32)
        routed_experts_cpu(
            RecordKernelPlan.create(layout), np.zeros(layout.nbytes, np.uint8), np.zeros(1, np.int64), np.ones((1, 128), np.float32),
            np.zeros((1, 1), np.int64), ones,
        )
        _warm = True


# ----------------------------------------------------------------------------- reference op


def _decode(data: np.ndarray, geo: ObjectGeometry) -> np.ndarray:
    if isinstance(geo, BlockScaleGeometry):
        return decode_nvfp4(data, geo.n, geo.k, geo.divisors)
    return decode_row_split_values(data, geo.format, geo.n, geo.k)


def reference_expert(layout: ExpertRecordLayout, record: np.ndarray, x: np.ndarray) -> np.ndarray:
    """One expert on tokens x [T, H] -> [T, H]: decode the record with the codecs, then numpy fp32."""
    gu, dn = layout.gate_up, layout.down
    w_gu = _decode(record[: gu.encoded_size], gu)
    w_dn = _decode(record[layout.down_offset : layout.down_offset + dn.encoded_size], dn)
    h = np.asarray(x, dtype=np.float32) @ w_gu.T
    gate, up = h[:, : dn.k], h[:, dn.k :]
    return ((gate / (1.0 + np.exp(-gate))) * up) @ w_dn.T


def reference_routed(
    layout: ExpertRecordLayout, records: np.ndarray, record_offsets: np.ndarray, x: np.ndarray,
    topk_ids: np.ndarray, topk_weights: np.ndarray,
) -> np.ndarray:
    """The oracle of `routed_experts_cpu`: out[t] = sum_j w[t, j] * expert_{ids[t, j]}(x[t])."""
    x = np.asarray(x, dtype=np.float32)
    out = np.zeros_like(x)
    for t in range(x.shape[0]):
        for e, w in zip(topk_ids[t], topk_weights[t]):
            at = int(record_offsets[int(e)])
            out[t] += np.float32(w) * reference_expert(layout, records[at : at + layout.nbytes], x[t : t + 1])[0]
    return out
