"""Weights by logical binding name (docs/format.md §8.4), placed on the compute device.

Row-split quantized bindings stay in their stored bytes (`QuantizedMatrix`, decoded per call),
nvfp4 ones in their stored codes and scales (`Nvfp4Matrix`, one divisor per 128-row tile);
contiguous bf16/fp32 bindings become torch tensors in the compute dtype (fp32 where the model
math needs it: GDN A_log / dt_bias).
"""

from __future__ import annotations

import numpy as np
import torch

from ninfer_offload.artifact.codecs import materialize_rows
from ninfer_offload.artifact.errors import ArtifactError
from ninfer_offload.artifact.formats import BLOCK_SCALE, NVFP4, ROW_SPLIT, grouped_format
from ninfer_offload.artifact.verify import require_valid
from ninfer_offload.model.nvfp4 import Nvfp4Matrix
from ninfer_offload.model.quant import QuantizedMatrix

Weight = torch.Tensor | QuantizedMatrix | Nvfp4Matrix


def _to_tensor(array: np.ndarray, device: torch.device) -> torch.Tensor:
    """A torch copy of a (possibly read-only, memory-mapped) uint8 array on `device`: one host copy, into
    pinned memory on CUDA (the caching host allocator reuses it once the asynchronous upload is done)."""
    staging = torch.empty(array.shape, dtype=torch.uint8, pin_memory=device.type == "cuda")
    staging.numpy()[...] = array
    return staging.to(device, non_blocking=True)


class WeightReader:
    """Reads bindings of one artifact onto one device in one compute dtype, checking their shapes."""

    def __init__(self, artifact, device: torch.device, dtype: torch.dtype):
        self.artifact = artifact
        self.device = device
        self.dtype = dtype

    def has(self, name: str) -> bool:
        return name in self.artifact.bindings

    def _object_of(self, name: str):
        if name not in self.artifact.bindings:
            raise ArtifactError(f"{self.artifact.path.name} has no binding {name!r} (required by the text model)")
        return self.artifact.object(self.artifact.bindings[name].parts[0].object)

    def matrix(self, name: str, shape: tuple[int, int]) -> Weight:
        """A projection or embedding matrix [n, k]: quantized stays encoded, dense becomes `dtype`."""
        obj = self._object_of(name)
        if obj.layout not in (ROW_SPLIT, BLOCK_SCALE):
            return self.dense(name, shape)
        object_id, r0, r1 = self.artifact.rows(name)
        n, k = obj.shape
        if (r1 - r0, k) != tuple(shape):
            raise ArtifactError(f"binding {name!r} has shape {[r1 - r0, k]}, expected {list(shape)}")
        payload = self.artifact.payload(object_id)
        if obj.layout == ROW_SPLIT:
            data = payload if (r0, r1) == (0, n) else materialize_rows(payload, obj.format, n, k, r0, r1 - r0)
            return QuantizedMatrix(grouped_format(obj.format), r1 - r0, k, _to_tensor(data, self.device))
        require_valid(self.artifact, obj, name)
        try:
            data = materialize_rows(payload, NVFP4, n, k, r0, r1 - r0)
        except ArtifactError as err:
            raise ArtifactError(f"binding {name!r}: {err}") from None
        return Nvfp4Matrix(r1 - r0, k, _to_tensor(data, self.device))

    def dense(self, name: str, shape: tuple[int, ...], dtype: torch.dtype | None = None) -> torch.Tensor:
        """Logical values of a binding, reshaped to `shape`, in `dtype` (default: the compute dtype)."""
        self._object_of(name)
        values = self.artifact.tensor(name)
        if values.numel() != int(np.prod(shape)):
            raise ArtifactError(f"binding {name!r} has shape {list(values.shape)}, expected {list(shape)}")
        return values.reshape(shape).to(device=self.device, dtype=dtype or self.dtype)
