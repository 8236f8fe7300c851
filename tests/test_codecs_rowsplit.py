"""Row-split and contiguous codecs: worked byte examples of docs/format.md §6.2, round trips, row views, encoder rules."""

import numpy as np
import pytest

from ninfer_offload.artifact.codecs import (
    decode_contiguous,
    decode_row_split,
    decode_row_split_values,
    encode_codes,
    encode_contiguous,
    encode_row_split,
    materialize_rows,
    quantize_groups,
)
from ninfer_offload.artifact.errors import ArtifactError
from ninfer_offload.artifact.formats import GROUPED_FORMATS, RowSplitGeometry, encoded_size, grouped_format

FORMATS = sorted(GROUPED_FORMATS)
WIDTHS = [1, 63, 64, 100, 128, 130, 257, 384]


# ----------------------------------------------------------------------------- worked examples (§6.2)


def test_q5_worked_row_is_byte_exact():
    x = ((np.arange(64) - 32) / 16).astype(np.float32)[None, :]
    obj = encode_row_split(x, "q5_g64_fp16")
    expected = np.zeros(516, dtype=np.uint8)
    expected[:32] = np.frombuffer(bytes.fromhex("112233445566778898a9bacbdcedfe0f00112233445566778898a9bacbdcedfe"), np.uint8)
    expected[256:264] = np.frombuffer(bytes.fromhex("ffffff7f00000000"), np.uint8)
    expected[512:516] = np.frombuffer(bytes.fromhex("44300000"), np.uint8)
    assert obj.size == 516
    assert obj.tobytes() == expected.tobytes()
    codes, scales = decode_row_split(obj, "q5_g64_fp16", 1, 64)
    assert scales.view(np.uint16)[0, 0] == 0x3044
    assert codes[0, 0] == -15 and codes[0, 63] == 15 and codes[0, 15] == -8 and codes[0, 16] == -8
    assert decode_row_split_values(obj, "q5_g64_fp16", 1, 64)[0, 0] == np.float32(-1.99951171875)


def test_q4_q8_q6_packing_checks():
    q4 = np.zeros((1, 64), np.float32)
    q4[0, :4] = [0.5, -1.0, 0.25, 0.0]
    obj = encode_row_split(q4, "q4_g64_fp16")
    geo = RowSplitGeometry(grouped_format("q4_g64_fp16"), 1, 64)
    assert obj[:2].tobytes() == b"\x94\x02"
    assert obj[geo.scale_offset : geo.scale_offset + 2].view("<u2")[0] == 0x3092

    q8 = np.zeros((1, 32), np.float32)
    q8[0, :3] = [1.0, -0.5, 0.003]
    obj = encode_row_split(q8, "q8_g32_fp16")
    geo = RowSplitGeometry(grouped_format("q8_g32_fp16"), 1, 32)
    assert obj[:3].tobytes() == b"\x7f\xc0\x00"
    assert obj[geo.scale_offset : geo.scale_offset + 2].view("<u2")[0] == 0x2008

    codes = np.zeros((1, 64), np.int8)
    codes[0, :4] = [-32, 31, -1, 17]
    obj = encode_codes(codes, np.ones((1, 1), np.float16), "q6_g64_fp16")
    geo = RowSplitGeometry(grouped_format("q6_g64_fp16"), 1, 64)
    assert obj[:2].tobytes() == b"\xf0\x1f"
    assert obj[geo.high_offset] == 0x76


@pytest.mark.parametrize(
    "fmt,shape,size",
    [
        ("q5_g64_fp16", [2, 130], 528),
        ("q4_g64_fp16", [7168, 5120], 19_496_960),
        ("q5_g64_fp16", [7168, 5120], 24_084_480),
        ("q4_g64_fp16", [262144, 2048], 285_212_672),
        ("q5_g64_fp16", [524288, 512], 176_160_768),
        ("q6_g64_fp16", [524288, 512], 209_715_200),
        ("q5_g64_fp16", [1152, 4304], 3_290_112),
        ("q8_g32_fp16", [12288, 2048], 26_738_688),
        ("q8_g32_fp16", [248320, 2048], 540_344_320),
        ("q6_g64_fp16", [248320, 2048], 397_312_000),
    ],
)
def test_worked_sizes(fmt, shape, size):
    assert encoded_size("row_split_k128_v1", fmt, shape) == size


def test_other_layout_sizes():
    assert encoded_size("block_scale_k16_m128x4_v1", "nvfp4", [14336, 5120]) == 41_287_684
    assert encoded_size("row_scale_v1", "fp8_e4m3fn_row_bf16", [14336, 5120]) == 73_428_992
    assert encoded_size("contiguous_le_v1", "fp32", []) == 4
    assert encoded_size("contiguous_le_v1", "bf16", [64, 2048]) == 262_144
    with pytest.raises(ArtifactError, match="not supported"):
        encoded_size("row_split_k128_v1", "bf16", [4, 4])
    with pytest.raises(ArtifactError, match="unknown layout"):
        encoded_size("tiles_v9", "bf16", [4, 4])


def test_expert_row_view_spans_match_worked_example():
    gate_up = RowSplitGeometry(grouped_format("q4_g64_fp16"), 262144, 2048)
    assert gate_up.row_spans(5120, 512) == [(5_242_880, 524_288), (268_763_136, 32_768)]
    assert gate_up.row_spans(5632, 512) == [(5_767_168, 524_288), (268_795_904, 32_768)]
    down = RowSplitGeometry(grouped_format("q5_g64_fp16"), 524288, 512)
    e = 7
    assert down.row_spans(2048 * e, 2048) == [(524288 * e, 524288), (134217728 + 131072 * e, 131072), (167772160 + 32768 * e, 32768)]
    q6 = RowSplitGeometry(grouped_format("q6_g64_fp16"), 524288, 512)
    assert q6.row_spans(2048 * e, 2048)[1:] == [(134217728 + 262144 * e, 262144), (201326592 + 32768 * e, 32768)]


# ----------------------------------------------------------------------------- round trips


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("k", WIDTHS)
def test_codes_and_scales_round_trip(fmt, k):
    f = grouped_format(fmt)
    rng = np.random.default_rng(k)
    n = 3
    groups = -(-k // f.group)
    codes = rng.integers(f.qmin, f.qmax + 1, size=(n, k)).astype(np.int8)
    codes[0, 0], codes[-1, -1] = f.qmin, f.qmax  # both ends of the range, incl. Q5/Q6 high bits
    scales = rng.uniform(0.001, 2.0, size=(n, groups)).astype(np.float16)
    scales[1, 0] = 0  # a zero scale only with all-zero codes
    codes[1, : min(k, f.group)] = 0
    obj = encode_codes(codes, scales, fmt)
    assert obj.size == encoded_size("row_split_k128_v1", fmt, [n, k])
    got_codes, got_scales = decode_row_split(obj, fmt, n, k)
    assert np.array_equal(got_codes, codes)
    assert np.array_equal(got_scales.view(np.uint16), scales.view(np.uint16))


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("k", [64, 100, 130, 257])
def test_encode_decode_values(fmt, k):
    f = grouped_format(fmt)
    rng = np.random.default_rng(1)
    x = (rng.standard_normal((5, k)) * rng.uniform(0.01, 10, size=(5, 1))).astype(np.float32)
    obj = encode_row_split(x, fmt)
    codes, scales = decode_row_split(obj, fmt, 5, k)
    assert encode_codes(codes, scales, fmt).tobytes() == obj.tobytes()  # padding lanes/groups are canonical
    values = decode_row_split_values(obj, fmt, 5, k)
    step = np.repeat(scales.astype(np.float32), f.group, axis=1)[:, :k]
    assert np.all(np.abs(values - x) <= 0.5 * step * (1 + 2**-9))
    assert codes.min() >= f.qmin and codes.max() <= f.qmax


@pytest.mark.parametrize("fmt", FORMATS)
def test_materialized_rows_equal_encoding_those_rows(fmt):
    rng = np.random.default_rng(2)
    x = rng.standard_normal((9, 130)).astype(np.float32)
    obj = encode_row_split(x, fmt)
    for r0, count in [(0, 1), (3, 4), (8, 1), (0, 9)]:
        view = materialize_rows(obj, fmt, 9, 130, r0, count)
        assert view.tobytes() == encode_row_split(x[r0 : r0 + count], fmt).tobytes()
    with pytest.raises(ArtifactError, match="outside"):
        materialize_rows(obj, fmt, 9, 130, 8, 2)


def test_decode_rejects_wrong_length():
    with pytest.raises(ArtifactError, match="needs 528 bytes"):
        decode_row_split(np.zeros(527, np.uint8), "q5_g64_fp16", 2, 130)
    with pytest.raises(ArtifactError, match="unknown grouped format"):
        decode_row_split(np.zeros(528, np.uint8), "q3_g64_fp16", 2, 130)


# ----------------------------------------------------------------------------- encoder rules (§7)


def _group(values, fmt):
    f = grouped_format(fmt)
    x = np.zeros((1, f.group), np.float32)
    x[0, : len(values)] = values
    codes, words = quantize_groups(x, f)
    return codes[0], int(words[0])


def test_ties_round_to_even():
    codes, word = _group([127.0, 0.5, 1.5, 2.5, -0.5, -1.5, -2.5, 3.5], "q8_g32_fp16")
    assert word == 0x3C00  # scale exactly 1.0
    assert codes[:8].tolist() == [127, 0, 2, 2, 0, -2, -2, 4]


def test_underflow_rescue_uses_smallest_subnormal():
    codes, word = _group([7 * 2.0**-25], "q4_g64_fp16")  # amax/7 = 2^-25 rounds (to even) to f16 zero
    assert word == 0x0001
    assert codes[0] == 4  # 3.5 -> 4


def test_all_zero_group_and_negative_zero():
    codes, word = _group([0.0, -0.0], "q6_g64_fp16")
    assert word == 0 and not codes.any()


@pytest.mark.parametrize("fmt,low,high", [("q5_g64_fp16", -16, 15), ("q8_g32_fp16", -127, 127), ("q4_g64_fp16", -8, 7)])
def test_clamp_at_code_range(fmt, low, high):
    qmax = grouped_format(fmt).qmax
    amax = np.float32((qmax * 1.4) // 1 * 2.0**-24)  # scale rounds down to 2^-24, so |x| * inv > qmax
    codes, word = _group([-amax, amax], fmt)
    assert word == 0x0001
    assert codes[:2].tolist() == [low, high]


def test_q8_never_emits_minus_128():
    rng = np.random.default_rng(3)
    x = rng.standard_normal((64, 256)).astype(np.float32)
    x[:, 0] = -np.abs(x).max(axis=1)  # the group extreme is negative
    codes, _ = decode_row_split(encode_row_split(x, "q8_g32_fp16"), "q8_g32_fp16", 64, 256)
    assert codes.min() == -127


def test_non_finite_and_overflow_are_rejected():
    with pytest.raises(ArtifactError, match="non-finite"):
        encode_row_split(np.array([[1.0, np.nan]], np.float32), "q4_g64_fp16")
    with pytest.raises(ArtifactError, match="non-finite"):
        encode_row_split(np.array([[np.inf, 0.0]], np.float32), "q8_g32_fp16")
    with pytest.raises(ArtifactError, match="overflows"):
        encode_row_split(np.array([[1e38, 0.0]], np.float32), "q8_g32_fp16")


def _reference_group(x: np.ndarray, fmt: str) -> tuple[list[int], int]:
    """Scalar restatement of MAXABS_F16_RECIP_RNE_V1 for one group (independent of the vector code)."""
    f = grouped_format(fmt)
    amax = max(abs(float(v)) for v in x)
    if amax == 0:
        return [0] * len(x), 0
    raw = np.float32(amax / f.qmax)
    s16 = np.float16(raw)
    if s16 == 0:
        s16 = np.float16(2.0**-24)
    inv = np.float32(1.0 / float(s16))
    codes = [int(min(max(round(float(np.float32(np.float32(v) * inv))), f.qmin), f.qmax)) for v in x]
    return codes, int(np.array(s16).view(np.uint16))


@pytest.mark.parametrize("fmt", FORMATS)
def test_vector_encoder_matches_scalar_reference(fmt):
    f = grouped_format(fmt)
    rng = np.random.default_rng(4)
    x = rng.standard_normal((40, f.group)) * 10.0 ** rng.integers(-9, 4, size=(40, 1))
    x[::5] = np.round(x[::5] * 2) / 2  # many exact halves
    x = x.astype(np.float32)
    codes, words = quantize_groups(x, f)
    for i in range(len(x)):
        ref_codes, ref_word = _reference_group(x[i], fmt)
        assert codes[i].tolist() == ref_codes and int(words[i]) == ref_word


# ----------------------------------------------------------------------------- contiguous


def test_contiguous_round_trips_bit_exact():
    words = np.array([0x0000, 0x8000, 0x3F80, 0xFF80, 0x7FC1, 0x0001], dtype=np.uint16)  # +0, -0, 1, -inf, NaN, subnormal
    raw = encode_contiguous(words, "bf16")
    values = decode_contiguous(raw, "bf16", (6,))
    assert encode_contiguous(values, "bf16").tobytes() == raw.tobytes()
    fp32 = np.array([0x7FC00123, 0x80000000, 0x00000001, 0x3F800000], dtype=np.uint32).view(np.float32)
    raw = encode_contiguous(fp32, "fp32")
    assert decode_contiguous(raw, "fp32", (2, 2)).view(np.uint32).reshape(-1).tolist() == fp32.view(np.uint32).tolist()
    ints = np.array([-(2**31), -1, 0, 2**31 - 1], dtype=np.int32)
    assert decode_contiguous(encode_contiguous(ints, "int32"), "int32", (4,)).tolist() == ints.tolist()


def test_bf16_rounds_to_nearest_even():
    x = np.array([1 + 2**-8, 1 + 3 * 2**-8, -(1 + 2**-8), 1 + 2**-8 + 2**-20], dtype=np.float32)
    got = decode_contiguous(encode_contiguous(x, "bf16"), "bf16", (4,))
    assert got.tolist() == [1.0, 1 + 2**-6, -1.0, 1 + 2**-7]


def test_contiguous_length_checked():
    with pytest.raises(ArtifactError, match="needs 8 bytes"):
        decode_contiguous(np.zeros(6, np.uint8), "fp32", (2,))
