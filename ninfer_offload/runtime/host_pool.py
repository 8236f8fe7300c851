"""The host pool of offloaded expert records: each layer's records inside a few chunks of
consecutive layers, page-locked on CUDA.

torch's caching host allocator rounds every pinned buffer up to a power of two: one buffer per layer
(464 MB for the full-size model, locked as 512 MiB) takes 16 % more RAM than the records. Chunks of
a power of two that hold runs of whole layers take about 1 % more (`planner.memory.chunk_layers`, which the
plan counts by too). A chunk is
allocated when one of its layers is first asked for (by the loader's packing threads, so page-locking
overlaps reading the file); the smaller chunks hold the first layers, so the first packing threads
start soonest.
"""

from __future__ import annotations

import threading

import torch

from ninfer_offload.planner.memory import PINNED_ALIGN, chunk_layers
from ninfer_offload.runtime.memory_check import host_tensor


class HostPool:
    """Host memory for every layer's records, handed out per layer (`layer`), thread-safe."""

    def __init__(self, sizes: list[int], pinned: bool, remedy: str):
        self.sizes = sizes
        self.pinned = pinned
        self.remedy = remedy  # the option that avoids pinning, for the error when pinning is refused
        self.chunks = chunk_layers(sizes)
        self._chunk_of = {layer: c for c, (_, layers) in enumerate(self.chunks) for layer in layers}
        self._buffers: list[torch.Tensor | None] = [None] * len(self.chunks)
        self._locks = [threading.Lock() for _ in self.chunks]

    def layer(self, layer: int) -> torch.Tensor:
        """uint8 [sizes[layer]]: `layer`'s records, inside its chunk (allocated now if it is the chunk's first)."""
        c = self._chunk_of[layer]
        size, layers = self.chunks[c]
        with self._locks[c]:
            if self._buffers[c] is None:
                self._buffers[c] = host_tensor((size - PINNED_ALIGN,), torch.uint8, self.pinned, "expert records", self.remedy)
        start = sum(self.sizes[layers.start : layer])
        return self._buffers[c][start : start + self.sizes[layer]]
