"""Gated full attention (every 4th layer of Qwen3.6 and the MTP layer) with partial rotary embedding."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ninfer_offload.artifact.dims import ModelDims
from ninfer_offload.model.backend import Backend, Input
from ninfer_offload.model.context import StepContext
from ninfer_offload.model.state_pool import StatePool
from ninfer_offload.model.stacked import StackedLinear
from ninfer_offload.model.weights import Weight, WeightReader


class Rotary:
    """Half-split (rotate_half) rotary embedding on the first `dim` dims of each head."""

    def __init__(self, dim: int, theta: float, device: torch.device):
        self.dim = dim
        self.inv_freq = (1.0 / (theta ** (torch.arange(0, dim, 2, dtype=torch.float) / dim))).to(device)

    def __call__(self, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """x [T, heads, D] rotated at `positions` [T]."""
        freqs = positions.float()[:, None] * self.inv_freq  # [T, dim/2]
        angles = torch.cat([freqs, freqs], dim=-1)[:, None, :]
        cos, sin = angles.cos().to(x.dtype), angles.sin().to(x.dtype)
        rot, rest = x[..., : self.dim], x[..., self.dim :]
        first, second = rot.chunk(2, dim=-1)
        rotated = torch.cat([-second, first], dim=-1)
        return torch.cat([rot * cos + rotated * sin, rest], dim=-1)


@dataclass
class GatedAttention:
    """q/k offset-RMSNormed per head, rotary, causal GQA over the KV cache, output gated by sigmoid(gate)."""

    key: int  # state key of this layer
    config: ModelDims
    rotary: Rotary
    projections: StackedLinear  # query, key, value, gate
    output: Weight
    query_norm: torch.Tensor
    key_norm: torch.Tensor

    @classmethod
    def load(cls, reader: WeightReader, prefix: str, key: int, config: ModelDims, rotary: Rotary) -> "GatedAttention":
        h, d = config.hidden_size, config.head_dim
        q, kv = config.num_attention_heads * d, config.num_kv_heads * d
        return cls(
            key,
            config,
            rotary,
            projections=StackedLinear.of(
                [
                    reader.matrix(f"{prefix}/attention/{name}", (rows, h))
                    for name, rows in (("query", q), ("key", kv), ("value", kv), ("gate", q))
                ]
            ),
            output=reader.matrix(f"{prefix}/attention/output", (h, q)),
            query_norm=reader.dense(f"{prefix}/attention/query_norm", (d,)),
            key_norm=reader.dense(f"{prefix}/attention/key_norm", (d,)),
        )

    def __call__(self, backend: Backend, x: Input, ctx: StepContext, state: StatePool) -> torch.Tensor:
        """Write the tokens' keys and values to their KV rows, attend, gate and project."""
        c = self.config
        t = ctx.positions.shape[0]
        q, k, v, gate = self.projections(backend, x)
        k_pool, v_pool = state.kv[self.key]
        q = backend.attention_inputs(
            q.reshape(t, c.num_attention_heads, c.head_dim), k.reshape(t, c.num_kv_heads, c.head_dim),
            v.reshape(t, c.num_kv_heads, c.head_dim), self.query_norm, self.key_norm, c.rms_norm_eps, self.rotary,
            ctx.positions, k_pool, v_pool, ctx.kv_rows,
        )
        if ctx.chunked:
            (slot,), (start,) = ctx.host_view()
            out = backend.attention_prefill(q, *state.kv_of(self.key, slot), start)
        else:
            out = backend.attention_decode(q, k_pool, v_pool, ctx, state.capacity, state.attention_rows)
        return backend.gated_linear(out.reshape(t, -1), gate, self.output)
