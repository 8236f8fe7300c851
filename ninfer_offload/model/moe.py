"""Sparse MoE block: fp32 softmax router with renormalised top-k, routed experts through the expert
store, and the always-on shared expert scaled by sigmoid(shared score)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch

from ninfer_offload.artifact.dims import ModelDims
from ninfer_offload.model.backend import Backend, Input, SharedExpert
from ninfer_offload.model.context import StepContext
from ninfer_offload.model.stacked import StackedLinear, both
from ninfer_offload.model.weights import Weight, WeightReader


class RoutedExperts(Protocol):
    """What the MoE block needs from the expert store."""

    def routed(
        self, backend: Backend, layer: int, x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor,
        shared: SharedExpert | None = None, ctx: StepContext | None = None,
    ) -> torch.Tensor:
        """The routed experts' output [T, H], plus `shared`'s rows when given, in the step `ctx` describes."""


@dataclass
class SparseMoe:
    layer: int  # expert-store layer index
    top_k: int
    gates: StackedLinear  # router, shared-expert score
    shared_in: StackedLinear  # shared expert gate, up
    shared_down: Weight
    experts: RoutedExperts

    @classmethod
    def load(cls, reader: WeightReader, prefix: str, layer: int, config: ModelDims, experts: RoutedExperts) -> "SparseMoe":
        h, s = config.hidden_size, config.shared_intermediate_size
        p = f"{prefix}/moe"
        return cls(
            layer,
            config.top_k,
            gates=StackedLinear.of([reader.matrix(f"{p}/router", (config.num_experts, h)), reader.matrix(f"{p}/shared_score", (1, h))]),
            shared_in=StackedLinear.of([reader.matrix(f"{p}/shared/{name}", (s, h)) for name in ("gate", "up")]),
            shared_down=reader.matrix(f"{p}/shared/down", (h, s)),
            experts=experts,
        )

    def __call__(self, backend: Backend, x: Input, ctx: StepContext) -> torch.Tensor:
        (logits, score), (gate, up) = both(backend, self.gates, self.shared_in, x)
        x = backend.resolve(x)  # the normalised input: computed by the products above where they could
        topk_ids, topk_weights = backend.route(logits, self.top_k, x.dtype)
        shared = SharedExpert(gate, up, self.shared_down, score)
        return self.experts.routed(backend, self.layer, x, topk_ids, topk_weights, shared, ctx)
