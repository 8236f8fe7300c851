"""Products that read the same input: their weights stacked by rows at load, one product, outputs split.

A decode step is bound by how many weight bytes each launch reads and how many launches there are;
the layers read the same normalised input with several matrices (GDN q/k/v/z and a/b, attention
q/k/v/gate, the shared expert's gate/up, the router and the shared-expert score), so each such set
becomes one matrix and one launch. Quantized parts are stacked plane by plane (row-split planes are
row-major, so the stacked object is exactly the object of the stacked matrix; nvfp4 objects in
runtime form are whole 128-row tiles, each plane tile-major, so the stacked object is the parts'
planes one after another); parts of different formats stay separate products. Two stacked products
of one input (`both`) run as one `linear_pair`, which the Triton backend launches as one kernel.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch

from ninfer_offload.artifact.formats import NVFP4, BlockScaleGeometry, ObjectGeometry, RowSplitGeometry, runtime_geometry
from ninfer_offload.model.backend import Backend, DepthwiseConv, Input
from ninfer_offload.model.nvfp4 import Nvfp4Matrix
from ninfer_offload.model.quant import QuantizedMatrix
from ninfer_offload.model.weights import Weight

Encoded = QuantizedMatrix | Nvfp4Matrix


def _planes(geometry: ObjectGeometry) -> tuple[tuple[int, int], ...]:
    """(offset, bytes) of each plane: row-split base, high and scales; nvfp4 codes, scales and divisors."""
    if isinstance(geometry, BlockScaleGeometry):
        return ((0, geometry.code_bytes), (geometry.scale_offset, geometry.scale_bytes), (geometry.divisor_offset, 4 * geometry.divisors))
    return ((0, geometry.base_bytes), (geometry.high_offset, geometry.high_bytes), (geometry.scale_offset, geometry.scale_bytes))


def _geometry(like: Encoded, n: int) -> ObjectGeometry:
    return RowSplitGeometry(like.fmt, n, like.k) if isinstance(like, QuantizedMatrix) else runtime_geometry(NVFP4, n, like.k)


def stack_quantized(parts: list[Encoded]) -> Encoded:
    """One encoded matrix holding the rows of `parts` in order (same format and width): each plane of the
    stacked object is the parts' planes of that kind, one after another."""
    n = sum(p.n for p in parts)
    geometry = _geometry(parts[0], n)
    data = torch.zeros(geometry.encoded_size, dtype=torch.uint8, device=parts[0].device)
    filled = [0] * len(_planes(geometry))
    for part in parts:
        for plane, ((dst, _), (src, src_bytes)) in enumerate(zip(_planes(geometry), _planes(part.geometry))):
            at = dst + filled[plane]
            data[at : at + src_bytes] = part.data[src : src + src_bytes]
            filled[plane] += src_bytes
    return dataclasses.replace(parts[0], n=n, data=data)


def _stackable(parts: list[Weight]) -> bool:
    first = parts[0]
    if isinstance(first, QuantizedMatrix):
        return all(isinstance(p, QuantizedMatrix) and p.fmt == first.fmt and p.k == first.k for p in parts)
    if isinstance(first, Nvfp4Matrix):
        return all(isinstance(p, Nvfp4Matrix) and p.k == first.k for p in parts)
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
        if isinstance(parts[0], QuantizedMatrix | Nvfp4Matrix):
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
