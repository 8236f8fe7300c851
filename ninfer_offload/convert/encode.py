"""Encode one parent object from its checkpoint sources: §9 transforms, then its storage format.

Sources are read one at a time and written into the parent's encoded buffer at their row offset,
so the memory held while encoding a parent is its encoded size, one source tensor, and a bounded
row chunk (row-split objects are encoded chunk by chunk and their planes copied into place).
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import torch

from ninfer_offload.artifact.codecs import encode_contiguous, encode_row_split
from ninfer_offload.artifact.errors import ArtifactError
from ninfer_offload.artifact.formats import CONTIGUOUS, DIRECT_FORMATS, ROW_SPLIT, RowSplitGeometry, encoded_size, grouped_format
from ninfer_offload.convert.layout import FLATTEN, GATE_HALF, QUERY_HALF, TAPS_MAJOR, Parent, Source
from ninfer_offload.errors import NinferError

# Source elements converted to float32 at once when quantizing (bounds the temporaries).
CHUNK_ELEMENTS = 1 << 22


def storage_layout(fmt: str) -> str:
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
        return tensor.reshape(source.rows, -1)
    return tensor


def _bf16_words(values: torch.Tensor) -> np.ndarray:
    """Little-endian bf16 bytes: stored bf16 words verbatim, wider floats rounded to nearest even."""
    if values.dtype == torch.bfloat16:
        return values.contiguous().view(torch.int16).numpy().view(np.uint8).reshape(-1)
    return encode_contiguous(values.to(torch.float32).numpy(), "bf16")


def _fp32_words(values: torch.Tensor) -> np.ndarray:
    """float32 bytes; bf16/fp16 widen exactly (a bf16 word lands in the high half, low bits zero)."""
    return np.ascontiguousarray(values.to(torch.float32).numpy(), dtype="<f4").view(np.uint8).reshape(-1)


def encode_parent(parent: Parent, read: Callable[[Source], torch.Tensor]) -> np.ndarray:
    """The encoded bytes of `parent` (exactly `encoded_size`), reading each source through `read`."""
    fmt = parent.format
    layout = storage_layout(fmt)
    out = np.zeros(encoded_size(layout, fmt, parent.shape), dtype=np.uint8)
    row = 0
    if layout == CONTIGUOUS:
        word = DIRECT_FORMATS[fmt]
        per_row = parent.row_elements * word
        for source in parent.sources:
            values = transform(read(source), source)
            data = _bf16_words(values) if fmt == "bf16" else _fp32_words(values)
            out[row * per_row : row * per_row + data.size] = data
            row += source.rows
        return out
    geometry = RowSplitGeometry(grouped_format(fmt), parent.shape[0], parent.shape[1])
    for source in parent.sources:
        values = transform(read(source), source)
        step = max(1, CHUNK_ELEMENTS // parent.shape[1])
        for r0 in range(0, source.rows, step):
            chunk = values[r0 : r0 + step].to(torch.float32).numpy()
            try:
                encoded = encode_row_split(chunk, fmt)
            except ArtifactError as err:
                raise NinferError(f"tensor {source.tensor!r}: {err}") from None
            count = chunk.shape[0]
            local = RowSplitGeometry(geometry.fmt, count, geometry.k)
            for (dst, length), (src, _) in zip(geometry.row_spans(row + r0, count), local.row_spans(0, count)):
                out[dst : dst + length] = encoded[src : src + length]
        row += source.rows
    return out
