"""`TritonBackend`: the reference backend's ops, with Triton kernels where they pay.

Same method signatures as `ReferenceBackend` (the engine picks the backend by device). Ops that
are already a single library call keep it (dense products of more than a few tokens: cuBLAS;
attention prefill: SDPA); the GDN chunked prefill uses flash-linear-attention's kernels on CUDA when that package is
installed (the `gpu` extra), else the reference's chunked form; lossless (bf16/fp32) expert
records use the reference path.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from ninfer_offload.artifact.records import ExpertRecordLayout
from ninfer_offload.errors import NinferError
from ninfer_offload.kernels import attention, gdn, moe, norm, quant_linear, rotary, router, shared_expert
from ninfer_offload.kernels.dense_linear import dense_linear
from ninfer_offload.kernels.quant_linear import gated_linear, gated_norm_linear, quantized_linear
from ninfer_offload.model.backend import DepthwiseConv, Input, ReferenceBackend, ResidualNorm, SharedExpert, Weight
from ninfer_offload.model.context import StepContext
from ninfer_offload.model.experts import ExpertBank


# bf16 tensor-core products (tl.dot on bf16) need Ampere (sm_80) or newer; sm_90 and sm_120 are the targets.
MIN_CAPABILITY = (8, 0)


def _fusable(x: Input, n: int) -> bool:
    """Whether the matrix-vector kernel of an n-row product can compute this layer input itself: a
    `ResidualNorm` not yet computed, of rows that kernel takes (`quant_linear.on_matrix_vector`), with
    contiguous columns."""
    return (
        isinstance(x, ResidualNorm) and x.normed is None and quant_linear.on_matrix_vector(n, x.tokens)
        and x.x.dim() == 2 and x.x.stride(1) == 1 and x.delta.stride(1) == 1 and x.delta.shape == x.x.shape
    )


class TritonBackend(ReferenceBackend):
    """GPU fast path (also runs under TRITON_INTERPRET=1 on CPU tensors, for tests)."""

    capturable = True  # its decode ops read the step context from device tensors only

    def __init__(self) -> None:
        if torch.cuda.is_available():
            major, minor = torch.cuda.get_device_capability()
            if major < MIN_CAPABILITY[0]:
                raise NinferError(
                    f"{torch.cuda.get_device_name()} (compute capability {major}.{minor}) is not supported by the triton "
                    f"backend, which needs {MIN_CAPABILITY[0]}.{MIN_CAPABILITY[1]} or newer (bf16 tensor cores); "
                    "use --device cpu or backend='reference'"
                )
        self._fla = gdn.fla_import()  # imported beside the load that follows

    @property
    def fla(self) -> bool:
        """Whether flash-linear-attention's gated delta rule kernels are there (waits for their import)."""
        return self._fla.result()

    def linear(self, x: Input, w: Weight) -> torch.Tensor:
        if not isinstance(w, torch.Tensor) and _fusable(x, w.n):  # the product normalises its own input
            y, x.total, x.normed = quant_linear.residual_norm_gemv(x.x, x.delta, x.weight, x.eps, w.data, w.geometry)
            return y
        x = self.resolve(x)
        lead = x.shape[:-1]
        if isinstance(w, torch.Tensor):
            return dense_linear(x.reshape(-1, x.shape[-1]), w).reshape(*lead, w.shape[0])
        out = quantized_linear(x.reshape(-1, x.shape[-1]), w.data, w.geometry)
        return out.reshape(*lead, w.n)

    def linear_pair(
        self, x: Input, first: Weight, second: Weight, conv: DepthwiseConv | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        dense_second = isinstance(second, torch.Tensor)
        quantized, dense = (first, second) if dense_second else (second, first)
        tokens = x.tokens if isinstance(x, ResidualNorm) else x.reshape(-1, x.shape[-1]).shape[0]
        if isinstance(quantized, torch.Tensor) or not isinstance(dense, torch.Tensor):
            return super().linear_pair(x, first, second, conv)
        tiled = not quant_linear.on_matrix_vector(quantized.n, tokens)
        if tiled and not (quant_linear.PAIR_IN_TILED and tokens <= quant_linear.FUSED_MAX_TOKENS):
            return super().linear_pair(x, first, second, conv)
        # the conv in the epilogue for a single token: several sequences' windows are a per-token chain there, which
        # made batch steps slower (docs/performance.md, Decode step settings)
        folded = conv is not None and gdn.CONV_IN_PRODUCT and dense_second and conv.one_token_per_sequence and tokens == 1
        epilogue = (conv.states, conv.weight, conv.ctx.slots, conv.ctx.valid, conv.channels) if folded else None
        if _fusable(x, quantized.n):  # both products read the normalised input the kernel computes
            yq, yd, x.total, x.normed = quant_linear.paired_gemv(
                x.x, quantized.data, quantized.geometry, dense, residual=(x.delta, x.weight, x.eps), conv=epilogue
            )
        else:
            x = self.resolve(x)
            flat = x.reshape(-1, x.shape[-1]).contiguous()
            if tiled:  # a batched step's small products: the dense rows as more row blocks of the tiled launch
                yq, yd = quant_linear.paired_tiled(flat, quantized.data, quantized.geometry, dense)
            else:
                yq, yd = quant_linear.paired_gemv(flat, quantized.data, quantized.geometry, dense, conv=epilogue)
            yq, yd = yq.reshape(*x.shape[:-1], quantized.n), yd.reshape(*x.shape[:-1], dense.shape[0])
        first_out, second_out = (yq, yd) if dense_second else (yd, yq)
        return (first_out if conv is None or folded else conv.apply(self, first_out)), second_out

    def gated_linear(self, x: torch.Tensor, gate: torch.Tensor, w: Weight) -> torch.Tensor:
        if isinstance(w, torch.Tensor):
            return super().gated_linear(x, gate, w)
        return gated_linear(x, gate, w.data, w.geometry)

    def gated_norm_linear(self, x: torch.Tensor, z: torch.Tensor, norm_w: torch.Tensor, eps: float, w: Weight) -> torch.Tensor:
        if isinstance(w, torch.Tensor):
            return super().gated_norm_linear(x, z, norm_w, eps, w)
        return gated_norm_linear(x, z, norm_w, eps, w.data, w.geometry)

    def rmsnorm(self, x: torch.Tensor, w: torch.Tensor, eps: float, offset: bool) -> torch.Tensor:
        return norm.rmsnorm(x, w, eps, offset)

    def gated_rmsnorm(self, x: torch.Tensor, w: torch.Tensor, eps: float, z: torch.Tensor) -> torch.Tensor:
        return norm.gated_rmsnorm(x, w, eps, z)

    def add_rmsnorm(
        self, x: torch.Tensor, delta: torch.Tensor, w: torch.Tensor, eps: float, offset: bool
    ) -> tuple[torch.Tensor, torch.Tensor]:
        return norm.add_rmsnorm(x, delta, w, eps, offset)

    def qk_norm_rotary(self, x: torch.Tensor, w: torch.Tensor, eps: float, rotary_embedding, positions: torch.Tensor) -> torch.Tensor:
        return rotary.qk_norm_rotary(x, w, eps, rotary_embedding.inv_freq, rotary_embedding.dim, positions)

    def attention_inputs(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, q_norm: torch.Tensor, k_norm: torch.Tensor, eps: float,
        rotary_embedding, positions: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor, kv_rows: torch.Tensor,
    ) -> torch.Tensor:
        if k_pool.dtype != q.dtype:  # an fp8 cache: converted as torch converts (the reference's writes)
            return super().attention_inputs(q, k, v, q_norm, k_norm, eps, rotary_embedding, positions, k_pool, v_pool, kv_rows)
        return rotary.attention_inputs(
            q, k, v, q_norm, k_norm, eps, rotary_embedding.inv_freq, rotary_embedding.dim, positions, k_pool, v_pool, kv_rows
        )

    def shared_expert(
        self, gate: torch.Tensor, up: torch.Tensor, down: Weight, routed: torch.Tensor, score: torch.Tensor
    ) -> torch.Tensor:
        return shared_expert.shared_expert(gate, up, down, routed, score)

    def route(self, logits: torch.Tensor, top_k: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        return router.softmax_topk(logits, top_k, dtype)

    def routed_experts(
        self, x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor, experts: ExpertBank, shared: SharedExpert | None = None
    ) -> torch.Tensor:
        if not isinstance(experts.layout, ExpertRecordLayout):
            return super().routed_experts(x, topk_ids, topk_weights, experts, shared)
        return moe.routed_experts(
            x, topk_ids, topk_weights, experts.arena, experts.offsets, experts.layout, host_records=experts.host is not None, shared=shared,
            uses=experts.uses, shared_uses=experts.shared_uses,
        )

    def routed_experts_split(
        self, x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor, experts: ExpertBank, later: torch.Tensor,
        wait: Callable[[], None],
    ) -> torch.Tensor:
        if not isinstance(experts.layout, ExpertRecordLayout):
            return super().routed_experts_split(x, topk_ids, topk_weights, experts, later, wait)
        return moe.routed_experts_split(
            x, topk_ids, topk_weights, experts.arena, experts.offsets, experts.layout, later, wait, host_records=experts.host is not None
        )

    def conv_update(
        self, x: torch.Tensor, conv_states: torch.Tensor, weight: torch.Tensor, ctx: StepContext, kept: torch.Tensor | None,
        out: torch.Tensor | None = None,
    ) -> torch.Tensor:
        return gdn.conv_update(
            x, conv_states, weight, ctx.slots, ctx.valid, ctx.tokens_per_sequence, kept if ctx.keep_states else None, out
        )

    def gdn_gating(
        self, a: torch.Tensor, b: torch.Tensor, a_log: torch.Tensor, dt_bias: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        return gdn.gdn_gating(a, b, a_log, dt_bias)

    def gdn_decode(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, a: torch.Tensor, b: torch.Tensor, a_log: torch.Tensor,
        dt_bias: torch.Tensor, states: torch.Tensor, ctx: StepContext, kept: torch.Tensor | None,
    ) -> torch.Tensor:
        return gdn.gdn_decode(
            q, k, v, a, b, a_log, dt_bias, states, ctx.slots, ctx.valid, ctx.tokens_per_sequence, kept if ctx.keep_states else None
        )

    def gdn_prefill(self, q, k, v, g, beta, state) -> torch.Tensor:
        # fla computes its in-chunk products in TF32 for float32 inputs (a 1e-3 relative drift: docs/performance.md,
        # Kernels); float32 engines keep the exact chunked path.
        if self.fla and q.is_cuda and q.dtype != torch.float32:
            return gdn.gdn_prefill(q, k, v, g, beta, state)
        return super().gdn_prefill(q, k, v, g, beta, state)

    def attention_prefill(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, start: int) -> torch.Tensor:
        return attention.attention_prefill(q, k_cache, v_cache, start)

    def attention_decode(
        self, q: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor, ctx: StepContext, capacity: int, budget_rows: int = 0
    ) -> torch.Tensor:
        return attention.attention_decode(q, k_pool, v_pool, ctx.slots, ctx.lengths, ctx.tokens_per_sequence, capacity, budget_rows)
