"""NVFP4 (block_scale_k16_m128x4_v1) and FP8 row (row_scale_v1) decoding, and reading them through an artifact."""

import numpy as np
import pytest

import ninfer_offload
from ninfer_offload.artifact.codecs import E2M1_VALUES, E4M3FN_VALUES, decode_fp8_rows, decode_nvfp4, encode_contiguous
from ninfer_offload.artifact.errors import ArtifactError
from ninfer_offload.artifact.formats import encoded_size
from ninfer_offload.artifact.writer import ArtifactWriter

NVFP4 = ("nvfp4", "block_scale_k16_m128x4_v1")
FP8 = ("fp8_e4m3fn_row_bf16", "row_scale_v1")


def test_element_tables():
    assert E4M3FN_VALUES[0x7E] == 448 and E4M3FN_VALUES[0x01] == 2.0**-9 and E4M3FN_VALUES[0x38] == 1.0
    assert E4M3FN_VALUES[0xB8] == -1.0 and E4M3FN_VALUES[0x08] == 2.0**-6
    assert np.isnan(E4M3FN_VALUES[0x7F]) and np.isnan(E4M3FN_VALUES[0xFF]) and np.isfinite(E4M3FN_VALUES[0x7E])
    assert E2M1_VALUES[0x7] == 6 and E2M1_VALUES[0xF] == -6 and np.signbit(E2M1_VALUES[0x8])


def _nvfp4_object(n, k, divisors=1):
    return np.zeros(encoded_size(NVFP4[1], NVFP4[0], [n, k], divisors), np.uint8)


def test_nvfp4_scale_swizzle_worked_example():
    n, k = 128, 64
    obj = _nvfp4_object(n, k)
    codes_bytes = n * k // 2
    obj[(37 * k + 48) // 2] = 0x02  # element (37, 48): low nibble, E2M1 1.0
    obj[(37 * k + 51) // 2] = 0x70  # element (37, 51): high nibble, E2M1 6.0
    scale_offset = codes_bytes  # 4096, already 256-aligned
    obj[scale_offset + 87] = 0x40  # the block scale of (n=37, group 3) lives at byte 87: E4M3 2.0
    obj[-4:] = np.frombuffer(np.float32(4.0).tobytes(), np.uint8)
    values = decode_nvfp4(obj, n, k)
    expected = np.zeros((n, k), np.float32)
    expected[37, 48], expected[37, 51] = 1.0 * 2.0 / 4.0, 6.0 * 2.0 / 4.0
    assert np.array_equal(values, expected)


def test_nvfp4_matches_natural_order_reference():
    rng = np.random.default_rng(0)
    n, k = 256, 128
    codes = rng.integers(0, 16, size=(n, k))
    scales = rng.integers(0, 0x7F, size=(n, k // 16)).astype(np.uint8)  # sign-0, non-NaN
    obj = _nvfp4_object(n, k, divisors=2)
    obj[: n * k // 2] = (codes[:, 0::2] | (codes[:, 1::2] << 4)).reshape(-1)
    for row in range(n):  # the documented byte-offset formula, element by element
        for g in range(k // 16):
            tile, inner = divmod(row, 128)
            offset = (tile * (k // 64) + g // 4) * 512 + (inner % 32) * 16 + (inner // 32) * 4 + g % 4
            obj[n * k // 2 + offset] = scales[row, g]
    obj[-8:] = np.frombuffer(np.array([2.0, 0.5], np.float32).tobytes(), np.uint8)
    expected = E2M1_VALUES[codes] * np.repeat(E4M3FN_VALUES[scales], 16, axis=1)
    expected[:128] /= 2.0
    expected[128:] /= 0.5
    assert np.array_equal(decode_nvfp4(obj, n, k, divisors=2), expected)


def test_fp8_rows():
    n, k = 3, 5
    obj = np.zeros(encoded_size(FP8[1], FP8[0], [n, k]), np.uint8)
    obj[: n * k] = [0x38, 0xB8, 0x7E, 0x01, 0x00] * 3
    obj[256 : 256 + 2 * n] = encode_contiguous(np.array([1.0, -2.0, 0.5], np.float32), "bf16")
    values = decode_fp8_rows(obj, n, k)
    row = np.array([1.0, -1.0, 448.0, 2.0**-9, 0.0], np.float32)
    assert np.array_equal(values, np.stack([row, -2 * row, 0.5 * row]))


def test_wrong_lengths():
    with pytest.raises(ArtifactError, match="nvfp4 object"):
        decode_nvfp4(np.zeros(10, np.uint8), 128, 64)
    with pytest.raises(ArtifactError, match="fp8 row object"):
        decode_fp8_rows(np.zeros(10, np.uint8), 3, 5)


def test_artifact_reads_nvfp4_and_fp8_bindings(tmp_path):
    n, k = 128, 64
    nv = _nvfp4_object(n, k)
    nv[n * k // 2 : n * k // 2 + n * k // 16] = 0x38  # every block scale 1.0
    nv[: n * k // 2] = 0x22  # every element 1.0
    nv[-4:] = np.frombuffer(np.float32(1.0).tobytes(), np.uint8)
    fp8 = np.zeros(encoded_size(FP8[1], FP8[0], [4, 8]), np.uint8)
    fp8[:32] = 0x38
    fp8[256:264] = encode_contiguous(np.arange(1, 5, dtype=np.float32), "bf16")
    w = ArtifactWriter(tmp_path / "a.ninfer")
    w.add_component("text", {})
    w.add_tensor("nv", [n, k], *NVFP4, lambda: nv)
    w.add_tensor("f8", [4, 8], *FP8, lambda: fp8)
    w.bind_parts("nv/rows", [("nv", 2 * k, 4 * k)])
    w.bind_parts("f8/rows", [("f8", 8, 24)])
    with ninfer_offload.open_artifact(w.write()) as art:
        assert art.tensor("nv/rows").shape == (2, k) and bool((art.tensor("nv/rows") == 1.0).all())
        assert art.tensor("f8/rows").tolist() == [[2.0] * 8, [3.0] * 8]
