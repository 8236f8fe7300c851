"""nvfp4 test objects: E2M1 codes, E4M3FN block-scale bytes and FP32 divisors packed into a
`block_scale_k16_m128x4_v1` object exactly as docs/format.md §6.3 lays it out."""

from __future__ import annotations

import numpy as np

from ninfer_offload.artifact.formats import BlockScaleGeometry


def pack_nvfp4(codes: np.ndarray, scales: np.ndarray, divisors: np.ndarray) -> np.ndarray:
    """Object bytes from codes [n, k] (0..15), natural-order scale bytes [n, k / 16] and divisors [D]."""
    n, k = codes.shape
    geometry = BlockScaleGeometry(n, k, len(divisors))
    out = np.zeros(geometry.encoded_size, dtype=np.uint8)
    codes = codes.astype(np.uint8)
    out[: geometry.code_bytes] = (codes[:, 0::2] | (codes[:, 1::2] << 4)).reshape(-1)
    swizzled = scales.astype(np.uint8).reshape(n // 128, 4, 32, k // 64, 4).transpose(0, 3, 2, 1, 4)
    out[geometry.scale_offset : geometry.divisor_offset] = swizzled.reshape(-1)
    out[geometry.divisor_offset :] = np.asarray(divisors, dtype="<f4").view(np.uint8)
    return out


def random_nvfp4(rng: np.random.Generator, n: int, k: int, divisors: int = 1) -> np.ndarray:
    """A valid object whose values are about 1/sqrt(k): every code, normal scales 0.25..2 with some
    subnormal ones, distinct divisors."""
    codes = rng.integers(0, 16, size=(n, k))
    scales = rng.integers(0x28, 0x41, size=(n, k // 16))
    scales[rng.random(scales.shape) < 0.05] = rng.integers(1, 8)  # subnormal scales: m * 2^-9 (tiny values)
    return pack_nvfp4(codes, scales, rng.uniform(1.0, 4.0, size=divisors) * np.sqrt(k))
