"""Routing a benchmark's forwards by the calibrated routing trace instead of the synthetic model's random router."""

from __future__ import annotations

import numpy as np
import torch

from ninfer_offload.planner.routing import shipped_routing_stats
from ninfer_offload.planner.trace import routing_trace
from ninfer_offload.runtime.engine import Engine


class TraceRouting:
    """Routes each forward's positions as consecutive tokens of the calibrated routing trace (`tokens` of them,
    `planner.trace.routing_trace`: the shipped per-layer counts, 45 % next-token reuse) through the expert store's
    `replay_routing` benchmark hook; with `trace=False`, the model's own routing. `longest`: the most positions one
    forward routes (the replay buffer's size, fixed by the first call, made here before any step is captured)."""

    def __init__(self, engine: Engine, tokens: int, longest: int, trace: bool = True, seed: int = 0):
        self.engine = engine
        self.trace = None
        if trace:
            hits = np.array(shipped_routing_stats().hits)
            ids = routing_trace(hits, engine.config.top_k, tokens, seed).astype(np.int64)
            self.trace = torch.from_numpy(ids).to(engine.device)  # [tokens, layers, k]
            self.route(0, longest)

    def route(self, position: int, count: int) -> None:
        """The next forward's `count` positions start at sequence position `position` (wrapping around the trace)."""
        if self.trace is None:
            return
        start = position % (self.trace.shape[0] - count + 1)
        routing = self.trace[start : start + count].transpose(0, 1)  # [layers, count, k]
        extra = len(self.engine.store.layouts) - routing.shape[0]  # the MTP layer reuses the last layer's ids
        if extra:
            routing = torch.cat([routing, routing[-extra:]])
        self.engine.store.replay_routing(routing)
