"""The text model: embedding, hybrid decoder layers (Gated DeltaNet or gated attention, then sparse
MoE), final norm and output head; and the MTP draft module that shares its embedding and head."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ninfer_offload.artifact.dims import FULL_ATTENTION, ModelDims
from ninfer_offload.model.attention import GatedAttention, Rotary
from ninfer_offload.model.backend import Backend, ResidualNorm
from ninfer_offload.model.context import StepContext
from ninfer_offload.model.gdn import GatedDeltaNet
from ninfer_offload.model.moe import RoutedExperts, SparseMoe
from ninfer_offload.model.state_pool import StatePool
from ninfer_offload.model.weights import Weight, WeightReader

MTP_PREFIX = "mtp/layers/0"


@dataclass
class DecoderLayer:
    """x = x + mixer(offset_rmsnorm(x)); x = x + moe(offset_rmsnorm(x)).

    The residual stream is carried as (x, pending delta) so that each residual add is one op with the
    norm after it, the last one with the next layer's or the final norm. The mixer and the MoE block
    receive their input as a `ResidualNorm` (the add and the norm not yet computed), so that their
    first products may compute it (`Backend.resolve`). The first layer has no pending delta (None):
    its input norm is a plain `backend.rmsnorm`.
    """

    input_norm: torch.Tensor
    post_attention_norm: torch.Tensor
    mixer: GatedAttention | GatedDeltaNet
    moe: SparseMoe
    eps: float

    @classmethod
    def load(
        cls, reader: WeightReader, prefix: str, key: int, kind: str, config: ModelDims, rotary: Rotary, experts: RoutedExperts
    ) -> "DecoderLayer":
        h = config.hidden_size
        if kind == FULL_ATTENTION:
            mixer = GatedAttention.load(reader, prefix, key, config, rotary)
        else:
            mixer = GatedDeltaNet.load(reader, prefix, key, config)
        return cls(
            input_norm=reader.dense(f"{prefix}/input_norm", (h,)),
            post_attention_norm=reader.dense(f"{prefix}/post_attention_norm", (h,)),
            mixer=mixer,
            moe=SparseMoe.load(reader, prefix, key, config, experts),
            eps=config.rms_norm_eps,
        )

    def __call__(
        self, backend, x: torch.Tensor, delta: torch.Tensor | None, ctx: StepContext, state: StatePool
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(x + delta, this layer's output delta)."""
        if delta is None:
            mixed = self.mixer(backend, backend.rmsnorm(x, self.input_norm, self.eps, offset=True), ctx, state)
        else:
            mixer_input = ResidualNorm(x, delta, self.input_norm, self.eps)
            mixed = self.mixer(backend, mixer_input, ctx, state)
            backend.resolve(mixer_input)
            x = mixer_input.total
        moe_input = ResidualNorm(x, mixed, self.post_attention_norm, self.eps)
        out = self.moe(backend, moe_input, ctx)
        backend.resolve(moe_input)
        return moe_input.total, out


@dataclass
class TextModel:
    config: ModelDims
    embedding: Weight
    layers: list[DecoderLayer]
    final_norm: torch.Tensor
    head: Weight
    dtype: torch.dtype

    def embed(self, backend: Backend, token_ids: torch.Tensor) -> torch.Tensor:
        return backend.embedding(token_ids, self.embedding, self.dtype)

    def hidden(self, backend: Backend, token_ids: torch.Tensor, ctx: StepContext, state: StatePool) -> torch.Tensor:
        """Final-normed hidden states [T, H] of the step's rows; advances the state of its sequences."""
        return self.hidden_chunks(backend, [token_ids], [ctx], state)[0]

    def hidden_chunks(
        self, backend: Backend, token_ids: list[torch.Tensor], ctxs: list[StepContext], state: StatePool
    ) -> list[torch.Tensor]:
        """`hidden` of consecutive prompt chunks of one sequence, layer by layer: each layer runs over every chunk,
        in order, before the next layer does (a layer sees the same inputs as chunk by chunk, so the results are
        the same), which lets the expert store stage a layer's host experts once for all of them."""
        xs, deltas = [self.embed(backend, ids) for ids in token_ids], [None] * len(token_ids)
        for layer in self.layers:
            for i, ctx in enumerate(ctxs):
                xs[i], deltas[i] = layer(backend, xs[i], deltas[i], ctx, state)
        eps = self.config.rms_norm_eps
        return [backend.add_rmsnorm(x, delta, self.final_norm, eps, offset=True)[1] for x, delta in zip(xs, deltas)]

    def logits(self, backend: Backend, hidden: torch.Tensor) -> torch.Tensor:
        """Output-head logits [T, vocab] in float32."""
        return backend.linear(hidden, self.head).float()


@dataclass
class MtpModule:
    """One full-attention MoE layer drafting token t+2 from the target's hidden h_t and token t+1.

    u = fc([offset_rmsnorm(embed(x_{t+1})), offset_rmsnorm(h_t)]); y = offset_rmsnorm(layer(u));
    logits = head(y). Position t is the position of h_t; `y` is fed back for further drafts.
    """

    input_projection: Weight
    embedding_norm: torch.Tensor
    hidden_norm: torch.Tensor
    final_norm: torch.Tensor
    layer: DecoderLayer
    eps: float

    @classmethod
    def load(cls, reader: WeightReader, key: int, config: ModelDims, rotary: Rotary, experts: RoutedExperts) -> "MtpModule":
        h = config.hidden_size
        return cls(
            input_projection=reader.matrix("mtp/input_projection", (h, 2 * h)),
            embedding_norm=reader.dense("mtp/embedding_norm", (h,)),
            hidden_norm=reader.dense("mtp/hidden_norm", (h,)),
            final_norm=reader.dense("mtp/final_norm", (h,)),
            layer=DecoderLayer.load(reader, MTP_PREFIX, key, FULL_ATTENTION, config, rotary, experts),
            eps=config.rms_norm_eps,
        )

    def __call__(
        self, backend, text: TextModel, hidden: torch.Tensor, next_ids: torch.Tensor, ctx: StepContext, state: StatePool
    ) -> torch.Tensor:
        """MTP hidden states [T, H] for target hidden `hidden` [T, H] and next tokens `next_ids` [T]."""
        embedded = backend.rmsnorm(text.embed(backend, next_ids), self.embedding_norm, self.eps, offset=True)
        stem = torch.cat([embedded, backend.rmsnorm(hidden, self.hidden_norm, self.eps, offset=True)], dim=-1)
        x = backend.linear(stem, self.input_projection)
        x, delta = self.layer(backend, x, None, ctx, state)
        return backend.add_rmsnorm(x, delta, self.final_norm, self.eps, offset=True)[1]
