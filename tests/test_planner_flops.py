"""The forward's arithmetic (`planner.flops`) against the transformers model's own weights: every matrix a
token multiplies, routed experts at their top-k share."""

from __future__ import annotations

import pytest

from ninfer_offload.artifact.dims import ModelDims
from ninfer_offload.planner.flops import attention_flops, forward_products, product_flops


def test_product_flops_count_every_weight_a_token_multiplies(tiny_hf_model):
    config = tiny_hf_model.config
    share = config.num_experts_per_tok / config.num_experts
    weights = 0.0
    for name, parameter in tiny_hf_model.named_parameters():
        if name.startswith(("model.embed_tokens", "lm_head")) or parameter.dim() < 2 or "conv1d" in name:
            continue
        weights += parameter.numel() * (share if ".experts." in name else 1.0)
    dims = ModelDims.from_text_config(config.to_dict())
    assert product_flops(forward_products(dims), 3) == pytest.approx(2 * 3 * weights)


def test_attention_flops_are_causal():
    """A chunk after cached tokens costs what the same tokens cost at the end of one longer prefill."""
    dims = ModelDims(
        hidden_size=64, vocab_size=512, num_layers=2, layer_types=("linear_attention", "full_attention"), rms_norm_eps=1e-6,
        max_position_embeddings=4096, num_attention_heads=4, num_kv_heads=2, head_dim=32, rope_theta=1e4, partial_rotary_factor=0.25,
        linear_num_key_heads=2, linear_key_head_dim=16, linear_num_value_heads=4, linear_value_head_dim=24, linear_conv_kernel=4,
        num_experts=8, top_k=2, moe_intermediate_size=32, shared_intermediate_size=48,
    )
    whole = attention_flops(dims, 96)
    assert attention_flops(dims, 64) + attention_flops(dims, 32, start=64) == pytest.approx(whole)
    assert attention_flops(dims, 1, start=95) == pytest.approx(4 * 4 * 32 * 96)  # one token over 96 positions
