"""Products that read the same input: their weights stacked by rows at load, one product, outputs split.

A decode step is bound by how many weight bytes each launch reads and how many launches there
are; the layers read the same normalised input with several matrices (GDN q/k/v/z and a/b,
attention q/k/v/gate, the shared expert's gate/up, the router and the shared-expert score), so
each such set becomes one matrix and one launch. Quantized parts are stacked plane by plane
(row-split planes are row-major, so the stacked object is exactly the object of the stacked
matrix); parts of different formats stay separate products. Two stacked products of one input
(`both`) run as one `linear_pair`, which the Triton backend launches as one kernel.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ninfer_offload.artifact.formats import RowSplitGeometry
from ninfer_offload.model.backend import Backend, DepthwiseConv, Input
from ninfer_offload.model.quant import QuantizedMatrix
from ninfer_offload.model.weights import Weight


def _planes(geometry: RowSplitGeometry) -> tuple[tuple[int, int], ...]:
    """(offset, bytes) of the base, high and scale planes."""
    return ((0, geometry.base_bytes), (geometry.high_offset, geometry.high_bytes), (geometry.scale_offset, geometry.scale_bytes))


def stack_quantized(parts: list[QuantizedMatrix]) -> QuantizedMatrix:
    """One row-split matrix holding the rows of `parts` in order (same format and width)."""
    fmt, k, n = parts[0].fmt, parts[0].k, sum(p.n for p in parts)
    geometry = RowSplitGeometry(fmt, n, k)
    data = torch.zeros(geometry.encoded_size, dtype=torch.uint8, device=parts[0].device)
    row = 0
    for part in parts:
        for (dst, dst_bytes), (src, src_bytes) in zip(_planes(geometry), _planes(part.geometry)):
            if src_bytes:
                at = dst + row * (dst_bytes // n)
                data[at : at + src_bytes] = part.data[src : src + src_bytes]
        row += part.n
    return QuantizedMatrix(fmt, n, k, data)


def _stackable(parts: list[Weight]) -> bool:
    first = parts[0]
    if isinstance(first, QuantizedMatrix):
        return all(isinstance(p, QuantizedMatrix) and p.fmt == first.fmt and p.k == first.k for p in parts)
    return all(isinstance(p, torch.Tensor) and p.dtype == first.dtype and p.shape[1:] == first.shape[1:] for p in parts)


@dataclass
class StackedLinear:
    """x @ [W_1; W_2; ...]^T split back into its outputs, as one product where the formats allow.

    Each output is the product of one part, or of several consecutive parts side by side
    (`groups`), as the layer consumes them (GDN convolves q, k and v as one tensor)."""

    weights: tuple[Weight, ...]  # one stacked matrix, or the parts when they cannot be stacked
    sizes: tuple[int, ...]  # output columns of each part
    groups: tuple[int, ...]  # parts per output, in order

    @classmethod
    def of(cls, parts: list[Weight], groups: tuple[int, ...] | None = None) -> "StackedLinear":
        sizes = tuple(int(p.shape[0]) for p in parts)
        groups = groups or (1,) * len(parts)
        if sum(groups) != len(parts):
            raise ValueError(f"output groups {groups} do not cover {len(parts)} parts")
        if len(parts) == 1 or not _stackable(parts):
            return cls(tuple(parts), sizes, groups)
        if isinstance(parts[0], QuantizedMatrix):
            return cls((stack_quantized(parts),), sizes, groups)
        return cls((torch.cat(parts, dim=0),), sizes, groups)

    def __call__(self, backend: Backend, x: Input) -> tuple[torch.Tensor, ...]:
        if len(self.weights) == 1:
            return self._split(backend.linear(x, self.weights[0]))
        bounds = self._bounds()
        outputs = [backend.linear(x, w) for w in self.weights]
        return tuple(outputs[a] if b - a == 1 else torch.cat(outputs[a:b], dim=-1) for a, b in zip(bounds, bounds[1:]))

    def _bounds(self) -> list[int]:
        return [sum(self.groups[:i]) for i in range(len(self.groups) + 1)]

    def _split(self, y: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """The outputs of the one stacked product y, as views."""
        bounds = self._bounds()
        return y.split([sum(self.sizes[a:b]) for a, b in zip(bounds, bounds[1:])], dim=-1)


def both(
    backend: Backend, first: StackedLinear, second: StackedLinear, x: Input, conv: DepthwiseConv | None = None
) -> tuple[tuple[torch.Tensor, ...], ...]:
    """(first's outputs, second's outputs) of one input: one `linear_pair` where each is one stacked
    matrix (e.g. quantized projections and dense gates, which cannot share a matrix), else each alone.
    `conv` runs over first's first output (GDN's q/k/v before the delta rule), in the product where
    the backend can."""
    if len(first.weights) == 1 and len(second.weights) == 1:
        y1, y2 = backend.linear_pair(x, first.weights[0], second.weights[0], conv)
        return first._split(y1), second._split(y2)
    outputs = first(backend, x)
    if conv is not None:
        outputs = (conv.apply(backend, outputs[0].contiguous()), *outputs[1:])
    return outputs, second(backend, x)
