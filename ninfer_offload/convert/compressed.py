"""Compressed-tensors NVFP4 checkpoints (format `nvfp4-pack-quantized`): the quantization config and
the stored planes of each quantized Linear (docs/format.md §9.1).

A quantized Linear `X` holds `X.weight_packed` (uint8 [N, K/2], two E2M1 codes per byte, the even
column in the low nibble), `X.weight_scale` (float8_e4m3fn [N, K/16], one scale per 16 columns,
row-major) and `X.weight_global_scale` (float32, one value), and decodes as
`code * scale / global_scale`; W4A4 checkpoints add `X.input_global_scale`, an activation scale this
engine does not use (every product keeps 16-bit activations). The converter sees such a Linear as
one logical tensor `X.weight` [N, K].
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ninfer_offload.errors import NinferError

NVFP4_FORMAT = "nvfp4-pack-quantized"
PACKED, SCALE, GLOBAL_SCALE, INPUT_SCALE = "weight_packed", "weight_scale", "weight_global_scale", "input_global_scale"
PLANES = (PACKED, SCALE, GLOBAL_SCALE, INPUT_SCALE)
# safetensors dtype of each plane the converter reads.
PLANE_DTYPES = {PACKED: "U8", SCALE: "F8_E4M3", GLOBAL_SCALE: "F32"}
# What NVFP4 weights and (W4A4) activations look like in a quantization config group.
_NVFP4_ARGS = {"num_bits": 4, "type": "float", "strategy": "tensor_group", "group_size": 16}


@dataclass(frozen=True)
class Nvfp4Matrix:
    """The stored planes of one NVFP4 matrix [N, K]: codes as they are, scales in natural order."""

    codes: np.ndarray  # uint8 [N, K/2]
    scales: np.ndarray  # uint8 E4M3FN bytes [N, K/16]
    divisor: np.float32


def _describe(args: object) -> str:
    if not isinstance(args, dict):
        return "none"
    return ", ".join(f"{key} {args.get(key)!r}" for key in (*_NVFP4_ARGS, "symmetric"))


def _is_nvfp4(args: object, weights: bool) -> bool:
    return isinstance(args, dict) and all(args.get(k) == v for k, v in _NVFP4_ARGS.items()) and (
        not weights or args.get("symmetric") is True
    )


def is_compressed_nvfp4(config: dict) -> bool:
    """True when config.json declares a compressed-tensors NVFP4 W4A16 or W4A4 checkpoint, False when it
    declares no quantization; a NinferError for any other quantization."""
    quant = config.get("quantization_config")
    if quant is None:
        return False
    where = "config.json: quantization_config"
    if not isinstance(quant, dict) or quant.get("quant_method") != "compressed-tensors":
        method = quant.get("quant_method") if isinstance(quant, dict) else quant
        raise NinferError(f"{where} quant_method {method!r} is not supported; only compressed-tensors NVFP4 checkpoints are read")
    groups = quant.get("config_groups")
    if not isinstance(groups, dict) or not groups:
        raise NinferError(f"{where} has no config_groups")
    for name, group in groups.items():
        group = group if isinstance(group, dict) else {}
        fmt = group.get("format") or quant.get("format")
        if fmt != NVFP4_FORMAT:
            raise NinferError(f"{where} group {name!r} has format {fmt!r}; only NVFP4 W4A16/W4A4 ({NVFP4_FORMAT}) is converted")
        if not _is_nvfp4(group.get("weights"), weights=True):
            raise NinferError(
                f"{where} group {name!r} weights are ({_describe(group.get('weights'))}); only NVFP4 W4A16/W4A4 is converted"
            )
        activations = group.get("input_activations")
        if activations is not None and not _is_nvfp4(activations, weights=False):
            raise NinferError(
                f"{where} group {name!r} input activations are ({_describe(activations)}); only NVFP4 W4A16/W4A4 is converted"
            )
    return True


def linear_prefixes(names: set[str]) -> set[str]:
    """`X.` of every quantized Linear `X` (one with `X.weight_packed`)."""
    suffix = f".{PACKED}"
    return {name[: -len(PACKED)] for name in names if name.endswith(suffix)}


def check_matrix(prefix: str, matrix: Nvfp4Matrix) -> Nvfp4Matrix:
    """The matrix if its divisor is finite and > 0 and its scales are sign-0 and not NaN; else a NinferError naming the tensor."""
    if not (np.isfinite(matrix.divisor) and matrix.divisor > 0):
        raise NinferError(f"tensor '{prefix}{GLOBAL_SCALE}' is {float(matrix.divisor)!r}; an NVFP4 global scale must be finite and > 0")
    is_nan = (matrix.scales & 0x7F) == 0x7F
    nan = int(np.count_nonzero(is_nan))
    negative = int(np.count_nonzero((matrix.scales >= 0x80) & ~is_nan))
    if nan or negative:
        raise NinferError(f"tensor '{prefix}{SCALE}' has {nan} NaN and {negative} negative block scales; NVFP4 scales are >= 0")
    return matrix


def dequantize(matrix: Nvfp4Matrix) -> np.ndarray:
    """float32 [N, K] values `code * scale / divisor` (the same arithmetic as `codecs.decode_nvfp4`)."""
    from ninfer_offload.artifact.codecs import E2M1_VALUES, E4M3FN_VALUES

    n = matrix.codes.shape[0]
    values = np.empty((n, 2 * matrix.codes.shape[1]), dtype=np.float32)
    values[:, 0::2] = E2M1_VALUES[matrix.codes & 0x0F]
    values[:, 1::2] = E2M1_VALUES[matrix.codes >> 4]
    values.reshape(n, -1, 16)[:] *= E4M3FN_VALUES[matrix.scales][:, :, None]
    values /= matrix.divisor
    return values
