"""Numeric codecs: decode stored words to codes/scales/float32, and the canonical encoder.

Row-split objects (docs/format.md §6.2) decode to int8 codes [N, K] and float16 scales
[N, ceil(K/G)]; the canonical encoder MAXABS_F16_RECIP_RNE_V1 (§7) is bit-exact, and so is the
NVFP4 encoder of §7.1 (`quantize_nvfp4`, with the m128x4 scale order of §6.3); nvfp4 objects
decode to float32 values. Everything is
vectorised numpy and works in row chunks so memory stays bounded for full-size banks.
"""

from __future__ import annotations

import numpy as np

from ninfer_offload.artifact.errors import ArtifactError
from ninfer_offload.artifact.formats import (
    DIRECT_FORMATS,
    NVFP4,
    NVFP4_TILE_ROWS,
    BlockScaleGeometry,
    GroupedFormat,
    RowSplitGeometry,
    elements,
    grouped_format,
)

# Rows processed at once by the row-split codecs (bounds temporary memory to a few hundred MB).
_CHUNK_ELEMENTS = 1 << 24


def _row_chunks(geometry: RowSplitGeometry):
    rows = max(1, _CHUNK_ELEMENTS // max(1, geometry.k_pad))
    for r0 in range(0, geometry.n, rows):
        yield r0, min(geometry.n, r0 + rows)


def _as_bytes(buf) -> np.ndarray:
    return np.frombuffer(buf, dtype=np.uint8) if not isinstance(buf, np.ndarray) else buf.view(np.uint8).reshape(-1)


# ----------------------------------------------------------------------------- contiguous


def decode_contiguous(buf, fmt: str, shape: tuple[int, ...]) -> np.ndarray:
    """Decode a `contiguous_le_v1` object to float32 (bf16, fp32) or int32 values."""
    data = _as_bytes(buf)
    count = elements(shape)
    if data.size != count * DIRECT_FORMATS[fmt]:
        raise ArtifactError(f"{fmt} object of shape {list(shape)} needs {count * DIRECT_FORMATS[fmt]} bytes, got {data.size}")
    if fmt == "bf16":
        words = data.view("<u2").astype(np.uint32) << 16
        return words.view(np.float32).reshape(shape)
    if fmt == "fp32":
        return data.view("<f4").astype(np.float32).reshape(shape)
    return data.view("<i4").astype(np.int32).reshape(shape)


def encode_contiguous(values: np.ndarray, fmt: str) -> np.ndarray:
    """Encode values as `contiguous_le_v1` words (bf16 rounds to nearest even)."""
    if fmt == "bf16":
        if values.dtype == np.uint16:  # already bf16 words
            return values.astype("<u2").view(np.uint8).reshape(-1)
        x = np.ascontiguousarray(values, dtype=np.float32).reshape(-1)
        bits = x.view(np.uint32)
        nan = np.isnan(x)
        rounded = ((bits.astype(np.uint64) + 0x7FFF + ((bits >> 16) & 1)) >> 16).astype(np.uint16)
        rounded[nan] = ((bits[nan] >> 16) | 0x0040).astype(np.uint16)
        return rounded.astype("<u2").view(np.uint8)
    if fmt == "fp32":
        return np.ascontiguousarray(values, dtype="<f4").view(np.uint8).reshape(-1)
    if fmt == "int32":
        return np.ascontiguousarray(values, dtype="<i4").view(np.uint8).reshape(-1)
    raise ArtifactError(f"unknown contiguous format {fmt!r}")


# ----------------------------------------------------------------------------- row split


def _lane_tables(bits: int) -> tuple[np.ndarray, np.ndarray | None, np.ndarray]:
    """Lookup tables of a 4/5/6-bit format: base byte -> two lanes, high byte -> lanes' high bits, u -> signed code."""
    byte = np.arange(256)
    nibbles = ((byte & 0x0F) | ((byte >> 4) << 8)).astype(np.uint16)  # low lane in the low byte
    extra = bits - 4
    high = None
    if extra:
        lanes = 8 // extra
        table = np.zeros((256, lanes), dtype=np.uint8)
        for lane in range(lanes):
            table[:, lane] = ((byte >> (lane * extra)) & ((1 << extra) - 1)) << 4
        high = table.view(np.uint64 if lanes == 8 else np.uint32).reshape(256)
    half = 1 << (bits - 1)
    sign = ((np.arange(1 << bits) ^ half) - half).astype(np.int8)
    return nibbles, high, sign


_TABLES = {bits: _lane_tables(bits) for bits in (4, 5, 6)}
# Q4 needs no high plane: one table maps a base byte straight to its two signed codes.
_Q4_PAIRS = _TABLES[4][2][_TABLES[4][0].view(np.uint8)].view(np.uint16)


def unpack_codes(
    fmt: GroupedFormat, base: np.ndarray, high: np.ndarray | None, rows: int, gpr: int, out: np.ndarray | None = None
) -> np.ndarray:
    """Codes int8 [rows, gpr*G] from base (and high) plane bytes of `rows` rows (table lookups, no per-lane math).

    `out`, if given, is a C-contiguous int8 array of that shape to write into.
    """
    g = fmt.group
    shape = (rows, gpr * g)
    if out is None:
        out = np.empty(shape, dtype=np.int8)
    if fmt.bits == 8:
        out.reshape(-1)[:] = base.view(np.int8)
    elif fmt.bits == 4:
        np.take(_Q4_PAIRS, base, mode="clip", out=out.reshape(-1).view(np.uint16))
    else:
        nibbles, high_table, sign = _TABLES[fmt.bits]
        u = np.take(nibbles, base, mode="clip").view(np.uint8)
        u |= np.take(high_table, high, mode="clip").view(np.uint8)
        np.take(sign, u, mode="clip", out=out.reshape(-1))
    return out.reshape(shape)


def decode_row_split(buf, fmt_name: str, n: int, k: int) -> tuple[np.ndarray, np.ndarray]:
    """Decode a `row_split_k128_v1` object to (codes int8 [n, k], scales float16 [n, ceil(k/G)])."""
    fmt = grouped_format(fmt_name)
    geo = RowSplitGeometry(fmt, n, k)
    data = _as_bytes(buf)
    if data.size != geo.encoded_size:
        raise ArtifactError(f"{fmt_name} object [{n}, {k}] needs {geo.encoded_size} bytes, got {data.size}")
    gpr = geo.groups_per_row
    codes = np.empty((n, k), dtype=np.int8)
    scales_all = data[geo.scale_offset : geo.scale_offset + geo.scale_bytes].view("<f2").reshape(n, gpr)
    for r0, r1 in _row_chunks(geo):
        rows = r1 - r0
        base = data[r0 * gpr * fmt.base_bytes : r1 * gpr * fmt.base_bytes]
        high = None
        if fmt.high_bytes:
            start = geo.high_offset + r0 * gpr * fmt.high_bytes
            high = data[start : start + rows * gpr * fmt.high_bytes]
        if k == geo.k_pad:
            unpack_codes(fmt, base, high, rows, gpr, out=codes[r0:r1])
        else:
            codes[r0:r1] = unpack_codes(fmt, base, high, rows, gpr)[:, :k]
    scales = scales_all[:, : geo.logical_groups_per_row].astype(np.float16)
    return codes, scales


def dequantize(codes: np.ndarray, scales: np.ndarray, group: int) -> np.ndarray:
    """float32 values [n, k] = fp32(scale of the lane's group) * code."""
    n, k = codes.shape
    out = np.empty((n, k), dtype=np.float32)
    rows = max(1, _CHUNK_ELEMENTS // max(1, k))
    for r0 in range(0, n, rows):
        s = scales[r0 : r0 + rows].astype(np.float32)
        if k % group == 0:  # broadcast one scale over its group: a single pass
            c = codes[r0 : r0 + rows].reshape(-1, k // group, group)
            np.multiply(c, s[:, :, None], out=out[r0 : r0 + rows].reshape(c.shape), dtype=np.float32)
        else:
            s = np.repeat(s, group, axis=1)[:, :k]
            np.multiply(codes[r0 : r0 + rows], s, out=out[r0 : r0 + rows], dtype=np.float32)
    return out


def decode_row_split_values(buf, fmt_name: str, n: int, k: int) -> np.ndarray:
    """Decode a `row_split_k128_v1` object straight to float32 values [n, k]."""
    codes, scales = decode_row_split(buf, fmt_name, n, k)
    return dequantize(codes, scales, grouped_format(fmt_name).group)


def quantize_groups(x: np.ndarray, fmt: GroupedFormat) -> tuple[np.ndarray, np.ndarray]:
    """MAXABS_F16_RECIP_RNE_V1 on padded groups: x float32 [..., G] -> (codes int8 [..., G], scale words uint16 [...])."""
    if not np.all(np.isfinite(x)):
        raise ArtifactError("cannot encode non-finite values")
    amax = np.max(np.abs(x), axis=-1)
    raw = (amax.astype(np.float64) / fmt.qmax).astype(np.float32)
    with np.errstate(over="ignore"):
        s16 = raw.astype(np.float16)
    if np.any(np.isinf(s16)):
        raise ArtifactError("group scale overflows float16")
    nonzero = amax > 0
    s16[(s16 == 0) & nonzero] = np.float16(2.0**-24)  # underflow rescue
    s16[~nonzero] = np.float16(0.0)
    with np.errstate(divide="ignore"):
        inv = (1.0 / s16.astype(np.float64)).astype(np.float32)
    inv[~nonzero] = 0.0
    prod = x * inv[..., None]  # float32 * float32, correctly rounded
    codes = np.clip(np.rint(prod), fmt.qmin, fmt.qmax).astype(np.int8)
    return codes, s16.view(np.uint16)


def _pack_codes(fmt: GroupedFormat, codes: np.ndarray) -> tuple[np.ndarray, np.ndarray | None]:
    """Base (and high) plane bytes for codes int8 [rows, gpr, G]."""
    if fmt.bits == 8:
        return codes.view(np.uint8).reshape(-1), None
    u = codes.view(np.uint8) & ((1 << fmt.bits) - 1)
    base = (u[..., 0::2] & 0x0F) | ((u[..., 1::2] & 0x0F) << 4)
    if fmt.bits == 4:
        return base.reshape(-1), None
    extra = fmt.bits - 4
    bits = np.stack([(u >> (4 + t)) & 1 for t in range(extra)], axis=-1)  # [rows, gpr, G, extra]
    rows, gpr = codes.shape[:2]
    high = np.packbits(bits.reshape(rows, gpr, -1), axis=-1, bitorder="little")
    return base.reshape(-1), high.reshape(-1)


def encode_row_split(values: np.ndarray, fmt_name: str) -> np.ndarray:
    """Encode float32 values [n, k] as a `row_split_k128_v1` object (bit-exact canonical encoder)."""
    fmt = grouped_format(fmt_name)
    if values.ndim != 2:
        raise ArtifactError(f"row-split encoding needs a rank-2 array, got shape {list(values.shape)}")
    n, k = values.shape
    geo = RowSplitGeometry(fmt, n, k)
    gpr = geo.groups_per_row
    out = np.zeros(geo.encoded_size, dtype=np.uint8)
    scale_plane = out[geo.scale_offset :].view("<u2")
    for r0, r1 in _row_chunks(geo):
        rows = r1 - r0
        x = np.zeros((rows, geo.k_pad), dtype=np.float32)
        x[:, :k] = values[r0:r1]
        codes, scales = quantize_groups(x.reshape(rows, gpr, fmt.group), fmt)
        base, high = _pack_codes(fmt, codes)
        out[r0 * gpr * fmt.base_bytes : r1 * gpr * fmt.base_bytes] = base
        if high is not None:
            start = geo.high_offset + r0 * gpr * fmt.high_bytes
            out[start : start + high.size] = high
        scale_plane[r0 * gpr : r1 * gpr] = scales.reshape(-1)
    return out


def encode_codes(codes: np.ndarray, scales: np.ndarray, fmt_name: str) -> np.ndarray:
    """Pack given codes int8 [n, k] and float16 scales [n, ceil(k/G)] as a row-split object."""
    fmt = grouped_format(fmt_name)
    n, k = codes.shape
    geo = RowSplitGeometry(fmt, n, k)
    gpr = geo.groups_per_row
    padded = np.zeros((n, geo.k_pad), dtype=np.int8)
    padded[:, :k] = codes
    words = np.zeros((n, gpr), dtype=np.uint16)
    words[:, : geo.logical_groups_per_row] = np.asarray(scales, dtype=np.float16).view(np.uint16)
    out = np.zeros(geo.encoded_size, dtype=np.uint8)
    base, high = _pack_codes(fmt, padded.reshape(n, gpr, fmt.group))
    out[: base.size] = base
    if high is not None:
        out[geo.high_offset : geo.high_offset + high.size] = high
    out[geo.scale_offset :].view("<u2")[:] = words.reshape(-1)
    return out


def materialize_rows(buf, fmt_name: str, n: int, k: int, r0: int, count: int) -> np.ndarray:
    """Copy rows [r0, r0+count) of a row-split or nvfp4 object into a standalone valid object (no repacking).

    Row-split: the three plane spans (docs/format.md §6.2 row views). nvfp4: whole 128-row tiles
    only (their codes and swizzled scales are contiguous runs), and the result carries one divisor
    per row tile, each the one the parent applies to that tile (`runtime_geometry`).
    """
    data = _as_bytes(buf)
    if fmt_name == NVFP4:
        src = BlockScaleGeometry(n, k, _nvfp4_divisor_count(data, n, k))
        dst = BlockScaleGeometry(count, k, count // NVFP4_TILE_ROWS)
    else:
        src, dst = RowSplitGeometry(grouped_format(fmt_name), n, k), RowSplitGeometry(grouped_format(fmt_name), count, k)
    out = np.zeros(dst.encoded_size, dtype=np.uint8)
    for (offset, length), start in zip(src.row_spans(r0, count), dst.plane_offsets):
        out[start : start + length] = data[offset : offset + length]
    if fmt_name == NVFP4:
        tiles = range(r0 // NVFP4_TILE_ROWS, (r0 + count) // NVFP4_TILE_ROWS)
        out[dst.divisor_offset :] = nvfp4_tile_divisors(data, n, k)[tiles.start : tiles.stop].view(np.uint8)
    return out


# ----------------------------------------------------------------------------- nvfp4 and fp8 rows


def _e4m3fn_table() -> np.ndarray:
    """float32 value of every E4M3FN byte (bias 7, no infinities, 0x7F/0xFF NaN)."""
    byte = np.arange(256)
    sign = np.where(byte & 0x80, -1.0, 1.0)
    exp, man = (byte >> 3) & 0x0F, byte & 0x07
    mag = np.where(exp == 0, man * 2.0**-9, (1 + man / 8) * 2.0 ** (exp - 7.0))
    mag[(exp == 15) & (man == 7)] = np.nan
    return (sign * mag).astype(np.float32)


E4M3FN_VALUES = _e4m3fn_table()
E2M1_VALUES = np.array([0, 0.5, 1, 1.5, 2, 3, 4, 6, -0.0, -0.5, -1, -1.5, -2, -3, -4, -6], dtype=np.float32)


# Largest E2M1 magnitude and largest finite E4M3FN value.
E2M1_MAX, E4M3FN_MAX = 6.0, 448.0
# The 127 non-negative finite E4M3FN values in byte order (bytes 0x00 ... 0x7E ascend with the value).
_E4M3FN_POSITIVE = E4M3FN_VALUES[:0x7F]
# Midpoints between neighbouring E2M1 magnitudes 0, 0.5, 1, 1.5, 2, 3, 4, 6, and which magnitude a
# tie goes to: the neighbour with an even code (round half to even).
_E2M1_MIDPOINTS = np.array([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0], dtype=np.float32)
_E2M1_TIES = np.append(_E2M1_MIDPOINTS, np.inf).astype(np.float32)  # the midpoint above each magnitude index


def unswizzle_scales(plane: np.ndarray, n: int, k: int) -> np.ndarray:
    """Natural [n, k/16] scale bytes from a swizzled m128x4 scale plane (docs/format.md §6.3)."""
    return plane.reshape(n // 128, k // 64, 32, 4, 4).transpose(0, 3, 2, 1, 4).reshape(n, k // 16)


def swizzle_scales(natural: np.ndarray) -> np.ndarray:
    """The m128x4 scale plane (flat bytes) of natural scale bytes [n, k/16], n % 128 == 0, k % 64 == 0."""
    n, groups = natural.shape
    return np.ascontiguousarray(natural.reshape(n // 128, 4, 32, groups // 4, 4).transpose(0, 3, 2, 1, 4)).reshape(-1)


def round_e4m3fn(values: np.ndarray) -> np.ndarray:
    """E4M3FN bytes of non-negative finite float32 values, rounded to nearest even, saturating at 448."""
    v = np.minimum(np.asarray(values, dtype=np.float64), E4M3FN_MAX)
    _, exponent = np.frexp(v)  # v = m * 2**exponent, m in [0.5, 1)
    quantum = np.exp2(np.maximum(exponent - 1, -6) - 3.0)  # spacing of the 3-bit mantissa (subnormals: 2**-9)
    rounded = np.minimum(np.rint(v / quantum) * quantum, E4M3FN_MAX)
    return np.searchsorted(_E4M3FN_POSITIVE, rounded.astype(np.float32)).astype(np.uint8)


def round_e2m1(values: np.ndarray) -> np.ndarray:
    """E2M1 codes (sign in bit 3) of float32 values: nearest magnitude, ties to the even code, clamped to 6."""
    size = np.abs(values)
    magnitude = np.zeros(size.shape, dtype=np.uint8)
    for midpoint in _E2M1_MIDPOINTS:  # the number of midpoints below: a tie lands on the lower magnitude
        magnitude += size > midpoint
    magnitude += (size == _E2M1_TIES[magnitude]) & (magnitude % 2 == 1)
    return magnitude | (np.signbit(values).astype(np.uint8) << 3)


def quantize_nvfp4(values: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.float32]:
    """NVFP4-encode one matrix (docs/format.md §7.1): (packed codes [n, k/2], natural E4M3FN scale bytes [n, k/16], divisor)."""
    x = np.ascontiguousarray(values, dtype=np.float32)
    n, k = x.shape
    if k % 16:
        raise ArtifactError(f"nvfp4 needs K % 16 == 0, got {[n, k]}")
    if not np.all(np.isfinite(x)):
        raise ArtifactError("cannot encode non-finite values")
    blocks = x.reshape(n, k // 16, 16)
    block_amax = np.max(np.abs(blocks), axis=-1)
    amax = np.float32(block_amax.max(initial=0.0))
    with np.errstate(over="ignore"):
        divisor = np.float32(E4M3FN_MAX * E2M1_MAX / np.float64(amax)) if amax > 0 else np.float32(1.0)
    if not np.isfinite(divisor):
        raise ArtifactError(f"matrix maximum {float(amax)!r} is too small for a float32 nvfp4 divisor")
    scales = round_e4m3fn((block_amax * divisor) / np.float32(E2M1_MAX))
    scale_values = E4M3FN_VALUES[scales][..., None]
    with np.errstate(divide="ignore", invalid="ignore", over="ignore"):
        ratio = np.where(scale_values > 0, (blocks * divisor) / scale_values, np.float32(0.0))
    codes = round_e2m1(ratio).reshape(n, k)
    return codes[:, 0::2] | (codes[:, 1::2] << 4), scales, divisor
def _nvfp4_divisor_count(data: np.ndarray, n: int, k: int) -> int:
    """How many divisor words an nvfp4 object [n, k] of data.size bytes carries (ArtifactError if none fits)."""
    geometry = BlockScaleGeometry(n, k)
    count, rest = divmod(data.size - geometry.divisor_offset, 4)
    if count <= 0 or rest or geometry.row_tiles % count:
        raise ArtifactError(f"nvfp4 object [{n}, {k}] cannot be {data.size} bytes long")
    return count


def nvfp4_tile_divisors(buf, n: int, k: int) -> np.ndarray:
    """float32 [n / 128]: the divisor each 128-row tile of an nvfp4 object [n, k] is decoded with (the
    object's divisor count follows from its length)."""
    data = _as_bytes(buf)
    geometry = BlockScaleGeometry(n, k, _nvfp4_divisor_count(data, n, k))
    words = data[geometry.divisor_offset :].view("<f4").astype(np.float32)
    return words[geometry.tile_divisor_index()]


def decode_nvfp4(buf, n: int, k: int, divisors: int = 1) -> np.ndarray:
    """Decode a `block_scale_k16_m128x4_v1` nvfp4 object to float32 [n, k] (docs/format.md §6.3)."""
    data = _as_bytes(buf)
    geo = BlockScaleGeometry(n, k, divisors)
    if data.size != geo.encoded_size:
        raise ArtifactError(f"nvfp4 object [{n}, {k}] needs {geo.encoded_size} bytes, got {data.size}")
    packed = data[: geo.code_bytes]
    values = np.empty((n, k), dtype=np.float32)
    flat = values.reshape(-1)
    flat[0::2] = E2M1_VALUES[packed & 0x0F]
    flat[1::2] = E2M1_VALUES[packed >> 4]
    natural = unswizzle_scales(data[geo.scale_offset : geo.divisor_offset], n, k)
    values.reshape(n, k // 16, 16)[:] *= E4M3FN_VALUES[natural][:, :, None]
    divisor = data[geo.divisor_offset :].view("<f4")
    values /= np.repeat(divisor, geo.rows_per_divisor)[:, None]
    return values


def decode_fp8_rows(buf, n: int, k: int) -> np.ndarray:
    """Decode a `row_scale_v1` fp8_e4m3fn_row_bf16 object to float32 [n, k] (docs/format.md §6.4)."""
    data = _as_bytes(buf)
    scale_offset = -(-(n * k) // 256) * 256
    if data.size != scale_offset + 2 * n:
        raise ArtifactError(f"fp8 row object [{n}, {k}] needs {scale_offset + 2 * n} bytes, got {data.size}")
    scales = decode_contiguous(data[scale_offset:], "bf16", (n, 1))
    return E4M3FN_VALUES[data[: n * k]].reshape(n, k) * scales
