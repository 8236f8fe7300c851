"""VRAM that is not weights: KV cache, GDN state, prefill workspace, expert staging slots.

All sizes follow from the text config (MODEL.md) and the plan options; the formulas are the
accounting the runtime allocates against.
"""

from __future__ import annotations

from dataclasses import dataclass

from ninfer_offload.errors import NinferError
from ninfer_offload.planner.options import PlanOptions

FP32, BF16 = 4, 2
INT8_SCALE_BYTES = 2  # int8 KV keeps one fp16 scale per (token, KV head) for K and for V


@dataclass(frozen=True)
class ModelShape:
    """The dimensions the memory and cost formulas need, read from a text component config."""

    hidden: int
    vocab: int
    attention_layers: int
    linear_layers: int
    kv_heads: int
    head_dim: int
    query_heads: int
    gdn_key_heads: int
    gdn_key_dim: int
    gdn_value_heads: int
    gdn_value_dim: int
    conv_kernel: int
    num_experts: int
    top_k: int
    expert_width: int

    @classmethod
    def from_config(cls, config: dict) -> "ModelShape":
        try:
            types = config["layer_types"]
            hidden = config["hidden_size"]
            heads = config.get("num_attention_heads", 1)
            return cls(
                hidden=hidden,
                vocab=config["vocab_size"],
                attention_layers=sum(t == "full_attention" for t in types),
                linear_layers=sum(t == "linear_attention" for t in types),
                kv_heads=config.get("num_key_value_heads", heads),
                head_dim=config.get("head_dim", hidden // heads),
                query_heads=heads,
                gdn_key_heads=config.get("linear_num_key_heads", 0),
                gdn_key_dim=config.get("linear_key_head_dim", 0),
                gdn_value_heads=config.get("linear_num_value_heads", 0),
                gdn_value_dim=config.get("linear_value_head_dim", 0),
                conv_kernel=config.get("linear_conv_kernel_dim", 4),
                num_experts=config.get("num_experts", 0),
                top_k=config.get("num_experts_per_tok", 0),
                expert_width=config.get("moe_intermediate_size", 0),
            )
        except (KeyError, TypeError) as err:
            raise NinferError(f"text config lacks {err}; cannot plan this artifact") from None

    @property
    def conv_channels(self) -> int:
        return 2 * self.gdn_key_heads * self.gdn_key_dim + self.gdn_value_heads * self.gdn_value_dim


def kv_layer_bytes_per_token(shape: ModelShape, options: PlanOptions) -> int:
    """K and V bytes of one token in one full-attention layer."""
    per_layer = 2 * shape.kv_heads * shape.head_dim * options.kv_bytes_per_element
    if options.kv_dtype == "int8":
        per_layer += 2 * shape.kv_heads * INT8_SCALE_BYTES
    return per_layer


def kv_bytes_per_token(shape: ModelShape, options: PlanOptions) -> int:
    """KV bytes of one token of one sequence: every full-attention layer, plus MTP's own layer."""
    layers = shape.attention_layers + (1 if options.speculating else 0)
    return layers * kv_layer_bytes_per_token(shape, options)


def gdn_state_bytes(shape: ModelShape) -> int:
    """Recurrent state (fp32 [V heads, V dim, K dim]) plus conv window (bf16) of one sequence."""
    recurrent = shape.gdn_value_heads * shape.gdn_value_dim * shape.gdn_key_dim * FP32
    conv = shape.conv_kernel * shape.conv_channels * BF16
    return shape.linear_layers * (recurrent + conv)


def gdn_state_copies(options: PlanOptions) -> int:
    """States kept per sequence: the live one plus a snapshot per drafted position."""
    return 1 + options.draft_count


def workspace_bytes(shape: ModelShape, options: PlanOptions) -> int:
    """Prefill activations of one chunk plus the logits of one decode step (bf16 activations).

    Per prefill token: residual, normed input, mixer output and MoE output (4 x hidden), the widest
    mixer projection (GDN q|k|v|z or attention q|gate|k|v), the routed experts' gate/up output and
    activation (2 x top_k x 2I) and the shared expert's. Logits: fp32 for every sequence and every
    verified position.
    """
    gdn_width = 2 * shape.gdn_key_heads * shape.gdn_key_dim + 2 * shape.gdn_value_heads * shape.gdn_value_dim
    attention_width = 2 * shape.query_heads * shape.head_dim + 2 * shape.kv_heads * shape.head_dim
    per_token = BF16 * (4 * shape.hidden + max(gdn_width, attention_width) + 2 * shape.top_k * 2 * shape.expert_width + 2 * shape.expert_width)
    logits = FP32 * shape.vocab * options.concurrency * (1 + options.draft_count)
    return options.prefill_chunk * per_token + logits


def staging_slots(shape: ModelShape, options: PlanOptions) -> int:
    """Device slots for streamed experts: two layers in flight (current + prefetch), each with every
    expert that one step's tokens can pick."""
    tokens_per_step = options.concurrency * (1 + options.draft_count)
    return 2 * min(shape.num_experts, shape.top_k * tokens_per_step)
