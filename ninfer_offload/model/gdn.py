"""Gated DeltaNet mixer (the linear-attention layers): conv window + gated delta rule, FP32 state.

The rule runs chunked for a prefill chunk of more than RECURRENT_PREFILL_TOKENS tokens, in recurrent
form (token by token, the decode kernel) otherwise."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ninfer_offload.artifact.dims import ModelDims
from ninfer_offload.model.backend import Backend, DepthwiseConv, Input
from ninfer_offload.model.context import StepContext
from ninfer_offload.model.stacked import StackedLinear, both
from ninfer_offload.model.state_pool import StatePool
from ninfer_offload.model.weights import Weight, WeightReader

# A prefill chunk of up to this many tokens runs the delta rule in recurrent form (the decode
# kernel: one launch per layer, by slot) rather than chunked: a short prompt's prefill is bound by
# host work, and flash-linear-attention's chunked rule took 1.2-1.9 ms of host time per call on the
# H200 host (profiled 4K prefills), ~40-55 ms over a prompt's 30 GDN layers.
RECURRENT_PREFILL_TOKENS = 64


@dataclass
class GatedDeltaNet:
    key: int  # state key of this layer
    config: ModelDims
    projections: StackedLinear  # query, key and value (one output: the convolution's input), z
    gates: StackedLinear  # a, b
    a_log: torch.Tensor  # fp32 [Hv]
    dt_bias: torch.Tensor  # fp32 [Hv]
    convolution: torch.Tensor  # [W, C] tap-major
    norm: torch.Tensor  # [Dv]
    output: Weight

    @classmethod
    def load(cls, reader: WeightReader, prefix: str, key: int, config: ModelDims) -> "GatedDeltaNet":
        h = config.hidden_size
        qk, v = config.linear_key_size, config.linear_value_size
        heads = config.linear_num_value_heads
        p = f"{prefix}/gdn"
        return cls(
            key,
            config,
            projections=StackedLinear.of(
                [reader.matrix(f"{p}/{name}", (rows, h)) for name, rows in (("query", qk), ("key", qk), ("value", v), ("z", v))],
                groups=(3, 1),
            ),
            gates=StackedLinear.of([reader.matrix(f"{p}/{name}", (heads, h)) for name in ("a_projection", "b_projection")]),
            a_log=reader.dense(f"{p}/a_log", (heads,), torch.float32),
            dt_bias=reader.dense(f"{p}/dt_bias", (heads,), torch.float32),
            convolution=reader.dense(f"{p}/convolution", (config.linear_conv_kernel, config.conv_channels)),
            norm=reader.dense(f"{p}/norm", (config.linear_value_head_dim,)),
            output=reader.matrix(f"{p}/output", (h, v)),
        )

    def __call__(self, backend: Backend, x: Input, ctx: StepContext, state: StatePool) -> torch.Tensor:
        c = self.config
        t = ctx.positions.shape[0]
        nk, dk = c.linear_num_key_heads, c.linear_key_head_dim
        nv, dv = c.linear_num_value_heads, c.linear_value_head_dim
        conv = DepthwiseConv(state.conv[self.key], self.convolution, ctx, state.conv_snapshots.get(self.key), c.conv_channels)
        (mixed, z), (a, b) = both(backend, self.projections, self.gates, x, conv)  # q|k|v after the conv
        z = z.reshape(t, nv, dv)
        q, k, v = mixed.split([nk * dk, nk * dk, nv * dv], dim=-1)
        q, k, v = q.reshape(t, nk, dk), k.reshape(t, nk, dk), v.reshape(t, nv, dv)
        if ctx.chunked and t > RECURRENT_PREFILL_TOKENS:
            (slot,), _ = ctx.host_view()
            g, beta = backend.gdn_gating(a, b, self.a_log, self.dt_bias)
            out = backend.gdn_prefill(q, k, v, g, beta, state.recurrent[self.key][slot])
        else:
            out = backend.gdn_decode(
                q, k, v, a, b, self.a_log, self.dt_bias, state.recurrent[self.key], ctx, state.recurrent_snapshots.get(self.key)
            )
        return backend.gated_norm_linear(out, z, self.norm, c.rms_norm_eps, self.output)
