"""The arithmetic of a forward over T tokens, from the model's dimensions: the products each token goes
through (dense ones for every token, a routed expert's for its share of the tokens) and causal attention.

    products = forward_products(dims)
    flops = product_flops(products, tokens) + attention_flops(dims, tokens, start)

A product's FLOPs are 2 x rows x columns per token it multiplies. Not counted: the gated delta rule's
recurrence (a few percent of a prefill's), norms, rotary, the router's top-k and the output head, which
a prefill applies to the last token only.
"""

from __future__ import annotations

from dataclasses import dataclass

from ninfer_offload.artifact.dims import ModelDims


@dataclass(frozen=True)
class Product:
    """`rows` x `cols` weights multiplied in `layers` layers of a forward, in `experts` instances per layer that
    each multiply `token_share` of the forward's tokens (dense products: one instance, every token)."""

    name: str
    rows: int
    cols: int
    layers: int
    experts: int = 1
    token_share: float = 1.0

    def flops(self, tokens: int) -> float:
        return 2.0 * self.rows * self.cols * self.layers * self.experts * self.token_share * tokens


def forward_products(dims: ModelDims) -> list[Product]:
    """The products of one forward of the text model (no output head), grouped by shape."""
    h, gdn, attention = dims.hidden_size, dims.num_gdn_layers, dims.num_attention_layers
    heads_width, kv_width = dims.num_attention_heads * dims.head_dim, dims.num_kv_heads * dims.head_dim
    moe_layers, shared = dims.num_layers, dims.shared_intermediate_size
    return [
        Product("gdn q/k/v/z", 2 * dims.linear_key_size + 2 * dims.linear_value_size, h, gdn),
        Product("gdn a/b", 2 * dims.linear_num_value_heads, h, gdn),
        Product("gdn output", h, dims.linear_value_size, gdn),
        Product("attention q/gate", 2 * heads_width, h, attention),
        Product("attention k/v", 2 * kv_width, h, attention),
        Product("attention output", h, heads_width, attention),
        Product("router and shared-expert gate", dims.num_experts + 1, h, moe_layers),
        Product("shared expert gate/up", 2 * shared, h, moe_layers),
        Product("shared expert down", h, shared, moe_layers),
        Product("routed gate/up", 2 * dims.moe_intermediate_size, h, moe_layers, dims.num_experts, dims.top_k / dims.num_experts),
        Product("routed down", h, dims.moe_intermediate_size, moe_layers, dims.num_experts, dims.top_k / dims.num_experts),
    ]


def product_flops(products: list[Product], tokens: int) -> float:
    return sum(p.flops(tokens) for p in products)


def attention_flops(dims: ModelDims, tokens: int, start: int = 0) -> float:
    """Causal attention of `tokens` new tokens after `start` cached ones: token i attends to start + i + 1
    positions, 2 x head_dim FLOPs each for the scores and as many for the values, in every head of every
    attention layer."""
    positions = tokens * start + tokens * (tokens + 1) / 2
    return 4.0 * dims.num_attention_layers * dims.num_attention_heads * dims.head_dim * positions
