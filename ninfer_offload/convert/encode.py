"""Encode one parent object from its checkpoint sources: docs/format.md §9 transforms, then its storage format.

Sources are read in slices of about CHUNK_ELEMENTS elements along their first axis (whole only
for the small transformed ones: attention q_proj halves, conv taps, vectors) and each slice is
encoded straight into the parent's buffer at its row offset (row-split slices are encoded as
standalone objects and their planes copied into place). So encoding a parent holds its encoded
bytes plus a constant-size window, whatever the size of the source tensors.

An nvfp4 parent is encoded member by member, each member one matrix with its own divisor
(§7.1): a member stored as NVFP4 in the checkpoint is copied (codes as they are, scales swizzled),
any other is quantized from its values.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from math import prod
from typing import Protocol

import numpy as np
import torch

from ninfer_offload.artifact.codecs import encode_contiguous, encode_row_split, quantize_nvfp4, swizzle_scales
from ninfer_offload.artifact.errors import ArtifactError
from ninfer_offload.artifact.formats import (
    BLOCK_SCALE,
    CONTIGUOUS,
    DIRECT_FORMATS,
    NVFP4,
    ROW_SPLIT,
    BlockScaleGeometry,
    RowSplitGeometry,
    encoded_size,
    grouped_format,
)
from ninfer_offload.convert.compressed import Nvfp4Matrix
from ninfer_offload.convert.layout import FLATTEN, GATE_HALF, NONE, QUERY_HALF, TAPS_MAJOR, Parent, Source
from ninfer_offload.errors import NinferError

# Source elements read (and converted to float32 when quantizing) at once.
CHUNK_ELEMENTS = 1 << 20

# read(tensor name, start, stop) -> the tensor's slice [start, stop) along its first axis.
Reader = Callable[[str, int, int], torch.Tensor]


class Tensors(Protocol):
    """What encoding reads from a checkpoint (`convert.checkpoint.Checkpoint`)."""

    def read(self, name: str, start: int, stop: int) -> torch.Tensor: ...

    def nvfp4(self, name: str) -> Nvfp4Matrix | None: ...


def storage_layout(fmt: str) -> str:
    if fmt == NVFP4:
        return BLOCK_SCALE
    return CONTIGUOUS if fmt in DIRECT_FORMATS else ROW_SPLIT


def transform(tensor: torch.Tensor, source: Source) -> torch.Tensor:
    """Apply the source's §9 transform; the result is [rows, K] (or [rows] for vectors)."""
    if source.transform in (QUERY_HALF, GATE_HALF):
        heads = source.heads
        per_head = tensor.reshape(heads, 2, tensor.shape[0] // (2 * heads), tensor.shape[1])
        half = per_head[:, 0 if source.transform == QUERY_HALF else 1]
        return half.reshape(-1, tensor.shape[1])
    if source.transform == TAPS_MAJOR:
        return tensor[:, 0, :].t()
    if source.transform == FLATTEN:
        return tensor.reshape(-1, tensor.shape[-1]) if len(source.shape) == 3 else tensor.reshape(tensor.shape[0], -1)
    return tensor


def source_rows(source: Source, read: Reader) -> Iterator[torch.Tensor]:
    """The source's transformed rows in order, in slices of about CHUNK_ELEMENTS elements."""
    lead = source.shape[0]
    if source.transform in (NONE, FLATTEN) and len(source.shape) >= 2:
        step = max(1, CHUNK_ELEMENTS // prod(source.shape[1:]))
    else:
        step = lead
    for start in range(0, lead, step):
        yield transform(read(source.tensor, start, min(lead, start + step)), source)


def _bf16_words(values: torch.Tensor) -> np.ndarray:
    """Little-endian bf16 bytes: stored bf16 words verbatim, wider floats rounded to nearest even."""
    if values.dtype == torch.bfloat16:
        return values.contiguous().view(torch.int16).numpy().view(np.uint8).reshape(-1)
    return encode_contiguous(values.to(torch.float32).numpy(), "bf16")


def _fp32_words(values: torch.Tensor) -> np.ndarray:
    """float32 bytes; bf16/fp16 widen exactly (a bf16 word lands in the high half, low bits zero)."""
    return np.ascontiguousarray(values.to(torch.float32).numpy(), dtype="<f4").view(np.uint8).reshape(-1)


def _member_matrices(parent: Parent, tensors: Tensors) -> Iterator[Nvfp4Matrix]:
    """Each member of an nvfp4 parent as one NVFP4 matrix, in order: copied when stored so, else quantized."""
    rows = parent.members[0].rows
    pending: list[torch.Tensor] = []
    for source in parent.sources:
        stored = tensors.nvfp4(source.tensor)
        if stored is not None:  # a quantized Linear is one whole member (experts, shared expert)
            assert not pending and source.rows == rows, (source, rows)
            yield stored
            continue
        for values in source_rows(source, tensors.read):
            pending.append(values)
            while sum(p.shape[0] for p in pending) >= rows:
                block = torch.cat(pending) if len(pending) > 1 else pending[0]
                pending = [block[rows:]] if block.shape[0] > rows else []
                try:
                    yield Nvfp4Matrix(*quantize_nvfp4(block[:rows].to(torch.float32).numpy()))
                except ArtifactError as err:
                    raise NinferError(f"tensor {source.tensor!r}: {err}") from None


def _encode_nvfp4(parent: Parent, tensors: Tensors) -> np.ndarray:
    geometry = BlockScaleGeometry(*parent.shape, parent.divisors)
    out = np.zeros(geometry.encoded_size, dtype=np.uint8)
    divisors = out[geometry.divisor_offset :].view("<f4")
    rows = geometry.rows_per_divisor
    for index, matrix in enumerate(_member_matrices(parent, tensors)):
        (codes, code_bytes), (scales, scale_bytes) = geometry.row_spans(index * rows, rows)
        out[codes : codes + code_bytes] = matrix.codes.reshape(-1)
        out[scales : scales + scale_bytes] = swizzle_scales(matrix.scales)
        divisors[index] = matrix.divisor
    return out


def encode_parent(parent: Parent, tensors: Tensors) -> np.ndarray:
    """The encoded bytes of `parent` (exactly `encoded_size`), reading each source from `tensors`."""
    fmt = parent.format
    layout = storage_layout(fmt)
    if layout == BLOCK_SCALE:
        return _encode_nvfp4(parent, tensors)
    out = np.zeros(encoded_size(layout, fmt, parent.shape), dtype=np.uint8)
    row = 0
    geometry = RowSplitGeometry(grouped_format(fmt), *parent.shape) if layout == ROW_SPLIT else None
    for source in parent.sources:
        for values in source_rows(source, tensors.read):
            count = values.shape[0]
            if geometry is None:
                data = _bf16_words(values) if fmt == "bf16" else _fp32_words(values)
                start = row * parent.row_elements * DIRECT_FORMATS[fmt]
                out[start : start + data.size] = data
            else:
                try:
                    encoded = encode_row_split(values.to(torch.float32).numpy(), fmt)
                except ArtifactError as err:
                    raise NinferError(f"tensor {source.tensor!r}: {err}") from None
                local = RowSplitGeometry(geometry.fmt, count, geometry.k)
                for (dst, length), (src, _) in zip(geometry.row_spans(row, count), local.row_spans(0, count)):
                    out[dst : dst + length] = encoded[src : src + length]
            row += count
    return out
