"""The host pool's chunks: whole layers in power-of-two chunks, little RAM beyond the records."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from ninfer_offload.planner.memory import PINNED_ALIGN, chunk_layers, pool_bytes
from ninfer_offload.runtime.host_pool import HostPool

FULL_SIZE_LAYER = 256 * 1_812_480  # 256 records of the full-size model's official recipe (464 MB)


@pytest.mark.parametrize(
    "sizes",
    [[FULL_SIZE_LAYER] * 40, [FULL_SIZE_LAYER] * 41, [256 * 1024] * 3, [PINNED_ALIGN], [4096, 1 << 20, 8192, 3 * 4096]],
)
def test_chunks_hold_every_layer_once_in_order_within_a_power_of_two(sizes):
    chunks = chunk_layers(sizes)
    assert [layer for _, layers in chunks for layer in layers] == list(range(len(sizes)))
    for size, layers in chunks:
        assert size & (size - 1) == 0  # the caching host allocator locks exactly this
        assert sum(sizes[i] for i in layers) + PINNED_ALIGN <= size
    assert pool_bytes(sizes, pinned=False) == sum(sizes)


def test_the_full_size_pool_locks_little_more_than_its_records():
    sizes = [FULL_SIZE_LAYER] * 40
    one_per_layer = 40 * (1 << (FULL_SIZE_LAYER + PINNED_ALIGN - 1).bit_length())
    assert one_per_layer > 1.15 * sum(sizes)
    assert pool_bytes(sizes, pinned=True) < 1.02 * sum(sizes)
    assert chunk_layers(sizes)[0][0] < chunk_layers(sizes)[-1][0]  # the first layers' chunks are the small ones


def test_layers_of_a_pool_are_disjoint_views_that_keep_their_bytes():
    sizes = [3 * 4096, 4096, 5 * 4096, 2 * 4096]
    pool = HostPool(sizes, pinned=False, remedy="")
    views = [pool.layer(i) for i in range(len(sizes))]
    for i, view in enumerate(views):
        assert view.shape == (sizes[i],)
        view.fill_(i + 1)
    for i, view in enumerate(views):
        assert torch.equal(view, torch.full_like(view, i + 1))
    spans = sorted((v.data_ptr(), v.data_ptr() + v.numel()) for v in views)
    assert all(end <= start for (_, end), (start, _) in zip(spans, spans[1:]))
    assert np.shares_memory(pool.layer(1).numpy(), views[1].numpy())  # asked again: the same memory
