"""Benchmark routing source: every token row of a step routed by its own sequence's stretch of a routing trace.

A benchmark of served batches on a synthetic artifact cannot use the random router (its picks are far less
concentrated than the real model's), and the single-sequence replay (`ExpertStore.replay_routing`) routes
rows by their place in the forward. Here row r of a step, of state slot s at position p, takes the experts
of trace token (offsets[s] + p) mod the trace's length, for every text layer the trace covers (the MTP
layer keeps the router's picks); the router's weights stay. Each slot starts at its own offset, spread
evenly over the trace, so the sequences of a batch route as different streams of one model, and a slot's
next sequence replays the stretch its last one did, as the same prompt's greedy decode would. The rows'
trace tokens are gathered on the device from the step context's slots and positions, so decode steps stay
capturable as CUDA graphs. Turned on before the first step (`ExpertStore.route_by_trace`), never in normal use.
"""

from __future__ import annotations

import numpy as np
import torch

from ninfer_offload.model.context import StepContext
from ninfer_offload.planner.options import PREFILL_SPAN_CHUNKS
from ninfer_offload.planner.routing import default_routing_stats
from ninfer_offload.planner.trace import routing_trace

TOKENS_PER_SLOT = 2048  # trace tokens between two slots' offsets


class SequenceTraceRouting:
    """`trace` int [tokens, layers, top_k] (`planner.trace.routing_trace`), replayed per sequence: slot s
    starts at offsets[s] (`slots` state slots, the scratch slot included)."""

    def __init__(self, trace: np.ndarray, slots: int, device: torch.device):
        self.tokens, self.layers, _ = trace.shape
        # [layers, tokens, k] int16 (expert ids < 32768, as the trace generator holds them): 12 MB for the full model's
        # 40 layers and 9 slots of TOKENS_PER_SLOT, beside the plan's VRAM
        self.trace = torch.from_numpy(np.ascontiguousarray(trace.transpose(1, 0, 2)).astype(np.int16)).to(device)
        self.offsets = torch.tensor([s * self.tokens // slots for s in range(slots)], dtype=torch.int64, device=device)
        # (step context, its rows' experts [layers, N, k]) gathered at layer 0 of the latest forwards: a prefill span
        # runs each layer over its chunks in turn, so layer 1 of its first chunk comes after layer 0 of the others
        self._steps: list[tuple[StepContext, torch.Tensor]] = []

    @classmethod
    def for_engine(cls, engine, seed: int = 0) -> "SequenceTraceRouting":
        """A calibrated trace for `engine`'s model (its shipped routing counts; uniform routing for other models) of
        TOKENS_PER_SLOT tokens per state slot."""
        config, slots = engine.config, engine.state.sequences + 1
        stats = default_routing_stats(engine.artifact.components["text"].config, config.num_layers, config.num_experts)
        trace = routing_trace(np.array(stats.hits), config.top_k, TOKENS_PER_SLOT * slots, seed)
        return cls(trace, slots, engine.device)

    def trace_tokens(self, ctx: StepContext) -> torch.Tensor:
        """[N] int64: the trace token of each row of the step `ctx` describes."""
        per_sequence = ctx.tokens_per_sequence
        slot_of_row = ctx.slots[:, None].expand(ctx.batch, per_sequence).reshape(-1)
        return torch.remainder(self.offsets[slot_of_row] + ctx.positions, self.tokens)

    def ids(self, layer: int, ctx: StepContext) -> torch.Tensor:
        """[N, top_k] int64: the experts of layer `layer` for each row of the step `ctx` describes. Every layer's are
        gathered at layer 0, which every forward of the target runs first for each of its contexts (so a captured step
        records the gather: the eager run before a capture uses the same context object, which rules out recognising
        the step by it)."""
        if layer == 0:
            self._steps = [*[(c, ids) for c, ids in self._steps if c is not ctx][-(PREFILL_SPAN_CHUNKS - 1) :],
                           (ctx, self.trace[:, self.trace_tokens(ctx)].to(torch.int64))]  # [layers, N, k]
        ids = next((ids for c, ids in reversed(self._steps) if c is ctx), None)
        if ids is None:
            raise RuntimeError(f"trace routing: layer {layer} ran before layer 0 of its step, where the experts are gathered")
        return ids[layer]
