"""The text model's dimensions, read from an artifact's `components.text.config` (docs/format.md §8.2).

One type for every layer: the model and the loader size their tensors by it, the planner's memory
and cost formulas count by it, and the converter builds it from the component config it writes.
Fields take the config's key names, shortened where the key is long: `num_layers`
(`num_hidden_layers`), `num_kv_heads` (`num_key_value_heads`), `linear_conv_kernel`
(`linear_conv_kernel_dim`), `top_k` (`num_experts_per_tok`), `shared_intermediate_size`
(`shared_expert_intermediate_size`), and `rope_theta`, `partial_rotary_factor` from `rope_parameters`.
"""

from __future__ import annotations

from dataclasses import dataclass

from ninfer_offload.errors import NinferError

SUPPORTED_ARCHITECTURES = ("Qwen3_5MoeForCausalLM", "Qwen3_5MoeForConditionalGeneration")
FULL_ATTENTION = "full_attention"
LINEAR_ATTENTION = "linear_attention"


@dataclass(frozen=True)
class ModelDims:
    """Dimensions of a Qwen3.5/3.6 hybrid MoE text model of any size."""

    hidden_size: int
    vocab_size: int
    num_layers: int
    layer_types: tuple[str, ...]
    rms_norm_eps: float
    max_position_embeddings: int
    # gated attention
    num_attention_heads: int
    num_kv_heads: int
    head_dim: int
    rope_theta: float
    partial_rotary_factor: float
    # Gated DeltaNet
    linear_num_key_heads: int
    linear_key_head_dim: int
    linear_num_value_heads: int
    linear_value_head_dim: int
    linear_conv_kernel: int
    # MoE
    num_experts: int
    top_k: int
    moe_intermediate_size: int
    shared_intermediate_size: int

    def is_attention(self, layer: int) -> bool:
        return self.layer_types[layer] == FULL_ATTENTION

    @property
    def num_attention_layers(self) -> int:
        return sum(kind == FULL_ATTENTION for kind in self.layer_types)

    @property
    def num_gdn_layers(self) -> int:
        return sum(kind == LINEAR_ATTENTION for kind in self.layer_types)

    @property
    def rotary_dim(self) -> int:
        return int(self.head_dim * self.partial_rotary_factor)

    @property
    def linear_key_size(self) -> int:
        """Width of the GDN query (and of the key): key heads x key head dim."""
        return self.linear_num_key_heads * self.linear_key_head_dim

    @property
    def linear_value_size(self) -> int:
        return self.linear_num_value_heads * self.linear_value_head_dim

    @property
    def conv_channels(self) -> int:
        """Channels of the GDN convolution: q, k and v."""
        return 2 * self.linear_key_size + self.linear_value_size

    @classmethod
    def from_text_config(cls, config: dict) -> "ModelDims":
        """Validate and read a text component config; NinferError names what is missing or unsupported."""
        archs = config.get("architectures") or []
        if not any(a in SUPPORTED_ARCHITECTURES for a in archs):
            raise NinferError(
                f"unsupported architecture {archs!r}: this engine implements {', '.join(SUPPORTED_ARCHITECTURES)}"
            )

        def need(key: str, source: dict = config):
            if key not in source:
                raise NinferError(f"text config lacks {key!r}; re-convert the checkpoint with `ninfer convert`")
            return source[key]

        rope = need("rope_parameters")
        layer_types = tuple(need("layer_types"))
        num_layers = int(need("num_hidden_layers"))
        if len(layer_types) != num_layers or any(t not in (FULL_ATTENTION, LINEAR_ATTENTION) for t in layer_types):
            raise NinferError(
                f"layer_types must list {num_layers} entries of {FULL_ATTENTION!r}/{LINEAR_ATTENTION!r}, got {list(layer_types)}"
            )
        result = cls(
            hidden_size=int(need("hidden_size")),
            vocab_size=int(need("vocab_size")),
            num_layers=num_layers,
            layer_types=layer_types,
            rms_norm_eps=float(need("rms_norm_eps")),
            max_position_embeddings=int(need("max_position_embeddings")),
            num_attention_heads=int(need("num_attention_heads")),
            num_kv_heads=int(need("num_key_value_heads")),
            head_dim=int(need("head_dim")),
            rope_theta=float(need("rope_theta", rope)),
            partial_rotary_factor=float(need("partial_rotary_factor", rope)),
            linear_num_key_heads=int(need("linear_num_key_heads")),
            linear_key_head_dim=int(need("linear_key_head_dim")),
            linear_num_value_heads=int(need("linear_num_value_heads")),
            linear_value_head_dim=int(need("linear_value_head_dim")),
            linear_conv_kernel=int(need("linear_conv_kernel_dim")),
            num_experts=int(need("num_experts")),
            top_k=int(need("num_experts_per_tok")),
            moe_intermediate_size=int(need("moe_intermediate_size")),
            shared_intermediate_size=int(need("shared_expert_intermediate_size")),
        )
        if result.num_attention_heads % result.num_kv_heads or result.linear_num_value_heads % result.linear_num_key_heads:
            raise NinferError("head counts must divide: attention heads by KV heads, GDN value heads by key heads")
        if not 0 < result.top_k <= result.num_experts:
            raise NinferError(f"num_experts_per_tok {result.top_k} must be in 1..{result.num_experts}")
        return result
