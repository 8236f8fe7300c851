"""The host pool of offloaded expert records: each layer's records inside a few chunks of
consecutive layers, page-locked on CUDA.

torch's caching host allocator rounds every pinned buffer up to a power of two: one buffer per layer
(464 MB for the full-size model, locked as 512 MiB) takes 16 % more RAM than the records. Chunks of
a power of two that hold runs of whole layers take about 1 % more (`chunk_layers`). A chunk is
allocated when one of its layers is first asked for (by the loader's packing threads, so page-locking
overlaps reading the file); the smaller chunks hold the first layers, so the first packing threads
start soonest.
"""

from __future__ import annotations

import threading

import torch

from ninfer_offload.runtime.memory_check import PINNED_ALIGN, host_tensor


def chunk_layers(sizes: list[int]) -> list[tuple[int, range]]:
    """(locked bytes, layers) of each chunk for layer pools of `sizes` bytes (multiples of PINNED_ALIGN), in
    layer order: the split into runs of consecutive layers, each in the power of two that holds it and its
    alignment slack, that locks the fewest bytes (of those, the one with the smallest first chunks)."""
    n = len(sizes)
    best: list[tuple[int, list[tuple[int, range]]]] = [(0, [])] * (n + 1)  # from layer i on: (bytes, its chunks)
    for start in range(n - 1, -1, -1):
        options = []
        for end in range(start + 1, n + 1):
            size = 1 << (sum(sizes[start:end]) + PINNED_ALIGN - 1).bit_length()
            total, rest = best[end]
            options.append((size + total, [size, *(s for s, _ in rest)], [(size, range(start, end)), *rest]))
        total, _, chunks = min(options, key=lambda option: option[:2])
        best[start] = (total, chunks)
    return best[0][1]


def pool_bytes(sizes: list[int], pinned: bool) -> int:
    """RAM a pool of layers of `sizes` bytes takes: its chunks when `pinned`, else the records."""
    return sum(size for size, _ in chunk_layers(sizes)) if pinned else sum(sizes)


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
