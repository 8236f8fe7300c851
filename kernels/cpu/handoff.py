"""Host side of the device hand-off (`runtime.miss_handoff`): polling the mailbox headers for an open
request and answering it, with acquire / release ordering against the device's writes."""

from __future__ import annotations

from numba import njit

from ninfer_offload.kernels.cpu.atomics import load_acquire, store_release


@njit(nogil=True, cache=True)
def next_request(flags, layers, words, ready, done, sweeps):
    """The first layer whose header (`words` int64 apart in `flags`) has READY != DONE, polling up to
    `sweeps` times over all layers; -1 if none opened meanwhile. Releases the GIL while it polls."""
    for _ in range(sweeps):
        for layer in range(layers):
            if load_acquire(flags, layer * words + ready) != load_acquire(flags, layer * words + done):
                return layer
    return -1


@njit(nogil=True, cache=True)
def answer_request(flags, index, ticket):
    """Set DONE (at `index`) to the request's ticket once every write of the answer is visible."""
    store_release(flags, index, ticket)
