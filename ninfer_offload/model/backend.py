"""The ops the layers call: the `Backend` protocol, and `ReferenceBackend`, its plain PyTorch
implementation that every faster backend is tested against.

The Triton backend in `ninfer_offload.kernels` implements the same protocol. Shapes: N token rows
of a step, H hidden size. Stateful ops update their state tensors in place, so preallocated state
buffers never move; the decode ops read the step context (`model.context.StepContext`).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

import torch
import torch.nn.functional as F

from ninfer_offload.model.context import StepContext
from ninfer_offload.model.experts import ExpertBank, record_weights
from ninfer_offload.model.weights import Weight

# Expert assignments decoded at once by `routed_experts` (bounds the temporary weight copies).
_ASSIGNMENT_CHUNK = 16
# Tokens per chunk of the chunked delta rule.
_GDN_CHUNK = 64


@dataclass
class ResidualNorm:
    """A layer's input before it is computed: (1 + weight) * rmsnorm(x + delta), the residual add and
    the offset norm of `Backend.add_rmsnorm`. The layer hands it to its first products so that a
    backend may compute it inside them (the Triton matrix-vector kernels normalise their own input
    tiles); whichever op computes it sets `total` (x + delta, the residual stream) and `normed`, and
    `Backend.resolve` computes them where no op did."""

    x: torch.Tensor
    delta: torch.Tensor
    weight: torch.Tensor
    eps: float
    total: torch.Tensor | None = None
    normed: torch.Tensor | None = None

    @property
    def tokens(self) -> int:
        return self.x.shape[0]


Input = torch.Tensor | ResidualNorm  # what the products of a layer's input accept


@dataclass(frozen=True)
class DepthwiseConv:
    """GDN's causal depthwise conv (`Backend.conv_update` of `states`, `weight`, `ctx`, `kept`) over the
    first `channels` columns of a product's output: a backend may compute it in that product
    (`Backend.linear_pair`); `apply` is the op on its own, in place on those columns."""

    states: torch.Tensor
    weight: torch.Tensor
    ctx: StepContext
    kept: torch.Tensor | None
    channels: int

    @property
    def one_token_per_sequence(self) -> bool:
        """A step of one token per sequence that keeps no per-token windows: what a product's epilogue can run."""
        return self.ctx.tokens_per_sequence == 1 and not self.ctx.keep_states

    def apply(self, backend: "Backend", y: torch.Tensor) -> torch.Tensor:
        first = y[..., : self.channels]
        backend.conv_update(first, self.states, self.weight, self.ctx, self.kept, out=first)  # in place: no copy launch
        return y


@dataclass(frozen=True)
class SharedExpert:
    """The MoE block's shared expert after its gate/up product: sigmoid(score) * SwiGLU(gate, up) @ down^T
    (gate, up [T, S]; score [T, 1]), to be added to the routed output. A backend may compute it with the
    routed experts (`Backend.routed_experts`); `added_to` is the op on its own."""

    gate: torch.Tensor
    up: torch.Tensor
    down: Weight
    score: torch.Tensor

    def added_to(self, backend: "Backend", routed: torch.Tensor) -> torch.Tensor:
        return backend.shared_expert(self.gate, self.up, self.down, routed, self.score)


class Backend(Protocol):
    """What the layers need from a compute backend; `ReferenceBackend` documents each op's math."""

    capturable: bool  # whether its decode ops read only device tensors (a CUDA graph can record them)

    def resolve(self, x: Input) -> torch.Tensor: ...
    def linear(self, x: Input, w: Weight) -> torch.Tensor: ...
    def linear_pair(
        self, x: Input, first: Weight, second: Weight, conv: DepthwiseConv | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]: ...
    def gated_linear(self, x: torch.Tensor, gate: torch.Tensor, w: Weight) -> torch.Tensor: ...
    def gated_norm_linear(self, x: torch.Tensor, z: torch.Tensor, norm_w: torch.Tensor, eps: float, w: Weight) -> torch.Tensor: ...
    def embedding(self, ids: torch.Tensor, table: Weight, dtype: torch.dtype) -> torch.Tensor: ...
    def rmsnorm(self, x: torch.Tensor, w: torch.Tensor, eps: float, offset: bool) -> torch.Tensor: ...
    def add_rmsnorm(
        self, x: torch.Tensor, delta: torch.Tensor, w: torch.Tensor, eps: float, offset: bool
    ) -> tuple[torch.Tensor, torch.Tensor]: ...
    def attention_inputs(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, q_norm: torch.Tensor, k_norm: torch.Tensor, eps: float,
        rotary, positions: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor, kv_rows: torch.Tensor,
    ) -> torch.Tensor: ...
    def shared_expert(
        self, gate: torch.Tensor, up: torch.Tensor, down: Weight, routed: torch.Tensor, score: torch.Tensor
    ) -> torch.Tensor: ...
    def route(self, logits: torch.Tensor, top_k: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]: ...
    def routed_experts(
        self, x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor, experts: ExpertBank, shared: SharedExpert | None = None
    ) -> torch.Tensor: ...
    def routed_experts_split(
        self, x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor, experts: ExpertBank, later: torch.Tensor,
        wait: Callable[[], None],
    ) -> torch.Tensor: ...
    def conv_update(
        self, x: torch.Tensor, conv_states: torch.Tensor, weight: torch.Tensor, ctx: StepContext, kept: torch.Tensor | None,
        out: torch.Tensor | None = None,
    ) -> torch.Tensor: ...
    def gdn_gating(
        self, a: torch.Tensor, b: torch.Tensor, a_log: torch.Tensor, dt_bias: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]: ...
    def gdn_prefill(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor, state: torch.Tensor
    ) -> torch.Tensor: ...
    def gdn_decode(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, a: torch.Tensor, b: torch.Tensor, a_log: torch.Tensor,
        dt_bias: torch.Tensor, states: torch.Tensor, ctx: StepContext, kept: torch.Tensor | None,
    ) -> torch.Tensor: ...
    def attention_prefill(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, start: int) -> torch.Tensor: ...
    def attention_decode(
        self, q: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor, ctx: StepContext, capacity: int, budget_rows: int = 0
    ) -> torch.Tensor: ...


def l2norm(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """x / sqrt(sum(x^2) + eps) over the last dim."""
    return x * torch.rsqrt((x * x).sum(-1, keepdim=True) + eps)


class ReferenceBackend:
    """PyTorch reference ops (CPU float32 or CUDA bfloat16)."""

    capturable = False  # its attention and GDN decode ops slice by host-side lengths

    # ------------------------------------------------------------------ dense
    def resolve(self, x: Input) -> torch.Tensor:
        """The tensor of a layer input: x itself, or a `ResidualNorm`'s normed rows (computed by
        `add_rmsnorm` here unless an op already did, which also sets its `total`)."""
        if isinstance(x, torch.Tensor):
            return x
        if x.normed is None:
            x.total, x.normed = self.add_rmsnorm(x.x, x.delta, x.weight, x.eps, offset=True)
        return x.normed

    def linear(self, x: Input, w: Weight) -> torch.Tensor:
        """x [..., K] @ w[N, K]^T -> [..., N]; a quantized w is decoded for this call only."""
        x = self.resolve(x)
        if not isinstance(w, torch.Tensor):
            w = w.dequantize(x.dtype)
        return x @ w.T

    def linear_pair(
        self, x: Input, first: Weight, second: Weight, conv: DepthwiseConv | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(x @ first^T, x @ second^T): two products of one input whose weights cannot be stacked into one
        matrix (different formats: a layer's quantized projections beside its dense control rows); with
        `conv`, the first product's first channels through it."""
        x = self.resolve(x)
        y = self.linear(x, first)
        return (y if conv is None else conv.apply(self, y)), self.linear(x, second)

    def gated_linear(self, x: torch.Tensor, gate: torch.Tensor, w: Weight) -> torch.Tensor:
        """(x * sigmoid(gate)) @ w^T: the attention output gated per element [T, K], then projected."""
        return self.linear(x * torch.sigmoid(gate), w)

    def gated_norm_linear(self, x: torch.Tensor, z: torch.Tensor, norm_w: torch.Tensor, eps: float, w: Weight) -> torch.Tensor:
        """`gated_rmsnorm` of x with gate z (both [T, H, D]) flattened to [T, H * D], then @ w^T: the GDN output."""
        return self.linear(self.gated_rmsnorm(x, norm_w, eps, z).reshape(x.shape[0], -1), w)

    def embedding(self, ids: torch.Tensor, table: Weight, dtype: torch.dtype) -> torch.Tensor:
        """Rows `ids` [T] of the embedding table -> [T, H] in `dtype`."""
        if not isinstance(table, torch.Tensor):
            return table.dequantize_rows(ids, dtype)
        return table[ids].to(dtype)

    def rmsnorm(self, x: torch.Tensor, w: torch.Tensor, eps: float, offset: bool) -> torch.Tensor:
        """RMSNorm over the last dim in fp32: (1 + w) * x / rms if `offset` (zero-centred weights), else w * x / rms."""
        xf = x.float()
        normed = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
        if offset:
            return (normed * (1.0 + w.float())).to(x.dtype)
        return w.to(x.dtype) * normed.to(x.dtype)

    def gated_rmsnorm(self, x: torch.Tensor, w: torch.Tensor, eps: float, z: torch.Tensor) -> torch.Tensor:
        """rmsnorm(x) with weights w (no offset), times silu(z) taken in fp32 and rounded to x's dtype."""
        return self.rmsnorm(x, w, eps, offset=False) * F.silu(z.float()).to(x.dtype)

    def add_rmsnorm(
        self, x: torch.Tensor, delta: torch.Tensor, w: torch.Tensor, eps: float, offset: bool
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The residual add and the norm after it: (x + delta, rmsnorm(x + delta))."""
        x = x + delta
        return x, self.rmsnorm(x, w, eps, offset)

    def qk_norm_rotary(self, x: torch.Tensor, w: torch.Tensor, eps: float, rotary, positions: torch.Tensor) -> torch.Tensor:
        """Per-head offset RMSNorm of q or k x [T, heads, D], then `rotary` (model.attention.Rotary) at `positions` [T]."""
        return rotary(self.rmsnorm(x, w, eps, offset=True), positions)

    def attention_inputs(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, q_norm: torch.Tensor, k_norm: torch.Tensor, eps: float,
        rotary, positions: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor, kv_rows: torch.Tensor,
    ) -> torch.Tensor:
        """q [T, Hq, D] and k [T, Hkv, D] through `qk_norm_rotary`, k and v [T, Hkv, D] written to rows
        `kv_rows` [T] of the KV pools [rows, Hkv, D] (in the pools' dtype); returns q."""
        q = self.qk_norm_rotary(q, q_norm, eps, rotary, positions)
        k = self.qk_norm_rotary(k, k_norm, eps, rotary, positions)
        for pool, rows in ((k_pool, k), (v_pool, v)):  # as bytes: CPU tensors have no fp8 index_copy_
            pool.view(torch.uint8).index_copy_(0, kv_rows, rows.to(pool.dtype).view(torch.uint8))
        return q

    # ------------------------------------------------------------------ MoE
    def shared_expert(
        self, gate: torch.Tensor, up: torch.Tensor, down: Weight, routed: torch.Tensor, score: torch.Tensor
    ) -> torch.Tensor:
        """routed + sigmoid(score) * (silu(gate) * up) @ down^T: the shared expert after its gate/up
        product [T, S] each, scaled by its score [T, 1], added to the routed output [T, H]."""
        return routed + torch.sigmoid(score) * self.linear(F.silu(gate) * up, down)

    def route(self, logits: torch.Tensor, top_k: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """fp32 softmax over expert logits, top-k, renormalised: (ids int64 [T, k], weights [T, k] in `dtype`)."""
        probs = torch.softmax(logits.float(), dim=-1)
        weights, ids = torch.topk(probs, top_k, dim=-1)
        weights = weights / weights.sum(-1, keepdim=True)
        return ids, weights.to(dtype)

    def routed_experts(
        self, x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor, experts: ExpertBank, shared: SharedExpert | None = None
    ) -> torch.Tensor:
        """sum_j w[t, j] * expert_{ids[t, j]}(x[t]) -> [T, H], reading the experts' records through the bank,
        plus `shared`'s rows when given (the MoE block's output).

        Each (token, expert) assignment is computed on its own (no host sync on the routing), so the
        result of a token does not depend on which other tokens share the call.
        """
        experts.count(topk_ids)
        routed = self._routed(x, topk_ids, topk_weights, experts)
        return routed if shared is None else shared.added_to(self, routed)

    def _routed(self, x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor, experts: ExpertBank) -> torch.Tensor:
        t, k = topk_ids.shape
        flat = topk_ids.reshape(-1)
        tokens = torch.arange(t, device=x.device).repeat_interleave(k)
        out = torch.empty(t * k, x.shape[-1], dtype=x.dtype, device=x.device)
        for a0 in range(0, t * k, _ASSIGNMENT_CHUNK):
            a1 = min(t * k, a0 + _ASSIGNMENT_CHUNK)
            gate_up, down = record_weights(experts.records(flat[a0:a1]), experts.layout, x.dtype)
            h = torch.bmm(gate_up, x[tokens[a0:a1]].unsqueeze(-1)).squeeze(-1)
            gate, up = h.chunk(2, dim=-1)
            out[a0:a1] = torch.bmm(down, (F.silu(gate) * up).unsqueeze(-1)).squeeze(-1)
        return (out.view(t, k, -1) * topk_weights.unsqueeze(-1)).sum(1)

    def routed_experts_split(
        self, x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor, experts: ExpertBank, later: torch.Tensor,
        wait: Callable[[], None],
    ) -> torch.Tensor:
        """`routed_experts` for a bank whose `later` experts ([E] bool or 0/1 ints) can be read only after `wait()`
        (their records are being copied into VRAM): a backend may compute the other experts' assignments
        before it waits. Here: `wait()`, then `routed_experts`."""
        wait()
        return self.routed_experts(x, topk_ids, topk_weights, experts)

    # ------------------------------------------------------------------ Gated DeltaNet
    def conv_update(
        self, x: torch.Tensor, conv_states: torch.Tensor, weight: torch.Tensor, ctx: StepContext, kept: torch.Tensor | None,
        out: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """silu(causal depthwise conv) of x [N, C] with taps weight [W, C], per sequence of `ctx`, in `out`
        ([N, C], x itself allowed) when given, else in a new tensor.

        conv_states [slots, W-1, C] holds each slot's previous W-1 inputs and is advanced in place over the
        sequence's `ctx.valid` tokens (the rows after them are padding: computed, not kept); with
        `ctx.keep_states`, the window after each token but the last goes to kept [slots, K, W-1, C].
        """
        taps, t = weight.shape[0], ctx.tokens_per_sequence
        rows = []
        for b, (slot, n) in enumerate(zip(ctx.host_view()[0], ctx.valid.tolist())):
            window = torch.cat([conv_states[slot], x[b * t : (b + 1) * t]], dim=0)  # [W-1+T, C]
            rows.append(F.silu(sum(weight[i].float() * window[i : i + t].float() for i in range(taps))).to(x.dtype))
            if ctx.keep_states:
                for i in range(t - 1):
                    kept[slot, i].copy_(window[i + 1 : i + taps])
            conv_states[slot].copy_(window[n : n + taps - 1])
        result = rows[0] if len(rows) == 1 else torch.cat(rows)
        return result if out is None else out.copy_(result)

    def gdn_gating(
        self, a: torch.Tensor, b: torch.Tensor, a_log: torch.Tensor, dt_bias: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Log decay g = -exp(a_log) * softplus(a + dt_bias) (fp32) and beta = sigmoid(b) (b's dtype), all [T, Hv]."""
        return -a_log.exp() * F.softplus(a.float() + dt_bias), torch.sigmoid(b)

    def _gdn_inputs(self, q, k, v, g, beta):
        """Heads-first fp32 tensors; Q/K heads repeated for their value heads, l2-normalised, q scaled."""
        group = v.shape[1] // q.shape[1]
        q = l2norm(q.float().repeat_interleave(group, dim=1)) * q.shape[-1] ** -0.5
        k = l2norm(k.float().repeat_interleave(group, dim=1))
        return (x.transpose(0, 1) for x in (q, k, v.float(), g.float(), beta.float()))

    def gdn_prefill(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor, state: torch.Tensor
    ) -> torch.Tensor:
        """Gated delta rule over T tokens in chunked form, starting from and updating `state` [Hv, Dk, Dv] (fp32).

        q, k [T, Hk, Dk] (post-conv, not normalised), v [T, Hv, Dv], g [T, Hv] (log decay), beta [T, Hv].
        Returns o [T, Hv, Dv] in v's dtype. Within a chunk with cumulative log decay G, the updates
        U solve the unit lower-triangular system (I + A) U = beta * (V - exp(G) * K S0) with
        A[t, i] = beta_t exp(G_t - G_i) k_t.k_i (i < t).
        """
        q, k, vf, g, beta = self._gdn_inputs(q, k, v, g, beta)  # [Hv, T, .]
        s = state.float()
        outputs = []
        length = vf.shape[1]
        for c0 in range(0, length, _GDN_CHUNK):
            qc, kc, vc = q[:, c0 : c0 + _GDN_CHUNK], k[:, c0 : c0 + _GDN_CHUNK], vf[:, c0 : c0 + _GDN_CHUNK]
            bc, cum = beta[:, c0 : c0 + _GDN_CHUNK], g[:, c0 : c0 + _GDN_CHUNK].cumsum(-1)
            n = cum.shape[1]
            causal = torch.ones(n, n, dtype=torch.bool, device=q.device).tril()
            diff = cum.unsqueeze(-1) - cum.unsqueeze(-2)  # [Hv, n, n]: G_t - G_i
            decay = diff.masked_fill(~causal, float("-inf")).exp()  # i <= t
            strict = decay.masked_fill(torch.eye(n, dtype=torch.bool, device=q.device), 0.0)
            system = bc.unsqueeze(-1) * (kc @ kc.transpose(-1, -2)) * strict
            system = system + torch.eye(n, device=q.device)
            rhs = bc.unsqueeze(-1) * (vc - cum.exp().unsqueeze(-1) * (kc @ s))
            u = torch.linalg.solve_triangular(system, rhs, upper=False, unitriangular=True)
            outputs.append(cum.exp().unsqueeze(-1) * (qc @ s) + ((qc @ kc.transpose(-1, -2)) * decay) @ u)
            tail = (cum[:, -1:] - cum).exp().unsqueeze(-1)  # decay from each token to the chunk end
            s = cum[:, -1].exp()[:, None, None] * s + (kc * tail).transpose(-1, -2) @ u
        state.copy_(s)
        return torch.cat(outputs, dim=1).transpose(0, 1).to(v.dtype, memory_format=torch.contiguous_format)

    def gdn_decode(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, a: torch.Tensor, b: torch.Tensor, a_log: torch.Tensor,
        dt_bias: torch.Tensor, states: torch.Tensor, ctx: StepContext, kept: torch.Tensor | None,
    ) -> torch.Tensor:
        """The same rule in recurrent form, token by token, for every sequence of `ctx` (rows grouped per
        sequence, T each) on its slot of states [slots, Hv, Dk, Dv] (fp32, in place: the state after the
        sequence's `ctx.valid` tokens), gated by the raw a, b [N, Hv] through `gdn_gating`. With
        `ctx.keep_states`, the state after each token but the last goes to kept [slots, K, Hv, Dk, Dv]."""
        g, beta = self.gdn_gating(a, b, a_log, dt_bias)
        t = ctx.tokens_per_sequence
        outputs = []
        for seq, (slot, n) in enumerate(zip(ctx.host_view()[0], ctx.valid.tolist())):
            rows = slice(seq * t, (seq + 1) * t)
            qs, ks, vf, gs, bs = self._gdn_inputs(q[rows], k[rows], v[rows], g[rows], beta[rows])
            s = states[slot].float()
            for i in range(t):
                s = s * gs[:, i].exp()[:, None, None]
                recalled = torch.einsum("hk,hkv->hv", ks[:, i], s)
                update = bs[:, i, None] * (vf[:, i] - recalled)
                s = s + ks[:, i, :, None] * update[:, None, :]
                outputs.append(torch.einsum("hk,hkv->hv", qs[:, i], s))
                if ctx.keep_states and i < t - 1:
                    kept[slot, i].copy_(s)
                if i == n - 1:
                    states[slot].copy_(s)
        return torch.stack(outputs, dim=1).transpose(0, 1).to(v.dtype)

    # ------------------------------------------------------------------ attention
    def attention_prefill(
        self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, start: int
    ) -> torch.Tensor:
        """Causal GQA of q [T, Hq, D] (positions start..start+T-1) over cache rows [0, start+T) of
        k_cache/v_cache [capacity, Hkv, D]; scale D^-1/2, fp32 softmax. Returns [T, Hq, D]."""
        t, heads, dim = q.shape
        keys, values = k_cache[: start + t].to(q.dtype), v_cache[: start + t].to(q.dtype)
        group = heads // keys.shape[1]
        keys = keys.repeat_interleave(group, dim=1).transpose(0, 1)  # [Hq, S, D]
        values = values.repeat_interleave(group, dim=1).transpose(0, 1)
        scores = (q.transpose(0, 1) @ keys.transpose(-1, -2)) * dim**-0.5  # [Hq, T, S]
        positions = torch.arange(start, start + t, device=q.device)
        visible = torch.arange(start + t, device=q.device)[None, :] <= positions[:, None]
        scores = scores.masked_fill(~visible, float("-inf"))
        probs = torch.softmax(scores.float(), dim=-1).to(q.dtype)
        return (probs @ values).transpose(0, 1)

    def attention_decode(
        self, q: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor, ctx: StepContext, capacity: int, budget_rows: int = 0
    ) -> torch.Tensor:
        """Attention of each sequence's T new tokens q [N, Hq, D] (their K/V already written) over its
        slot's rows of the flat pools [slots * capacity + ..., Hkv, D]: token t of a sequence sees the
        rows before it and itself. `budget_rows`: the most rows the engine's steps attend with (sizes a
        kernel's workspace; unused here). Returns [N, Hq, D]."""
        t = ctx.tokens_per_sequence
        out = []
        for b, (slot, start) in enumerate(zip(*ctx.host_view())):
            rows = slice(slot * capacity, (slot + 1) * capacity)
            out.append(self.attention_prefill(q[b * t : (b + 1) * t], k_pool[rows], v_pool[rows], start))
        return out[0] if len(out) == 1 else torch.cat(out)
