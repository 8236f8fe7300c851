"""`ModelDims`: the text model's dimensions read from a text component config, and the one-line
errors for configs this engine cannot run."""

from __future__ import annotations

import pytest

from ninfer_offload.artifact.contract import TEXT_CONFIG
from ninfer_offload.artifact.dims import ModelDims
from ninfer_offload.errors import NinferError


def test_the_35b_dimensions():
    dims = ModelDims.from_text_config(TEXT_CONFIG)
    assert (dims.hidden_size, dims.num_layers, dims.num_experts, dims.top_k) == (2048, 40, 256, 8)
    assert (dims.num_attention_layers, dims.num_gdn_layers) == (10, 30)
    assert [i for i in range(dims.num_layers) if dims.is_attention(i)] == list(range(3, 40, 4))
    assert (dims.linear_key_size, dims.linear_value_size, dims.conv_channels) == (2048, 4096, 8192)
    assert dims.rotary_dim == 64 and dims.num_kv_heads == 2 and dims.linear_conv_kernel == 4


def _without(key: str) -> dict:
    return {k: v for k, v in TEXT_CONFIG.items() if k != key}


@pytest.mark.parametrize(
    "config, message",
    [
        ({**TEXT_CONFIG, "architectures": ["LlamaForCausalLM"]}, r"unsupported architecture \['LlamaForCausalLM'\]"),
        (_without("architectures"), r"unsupported architecture \[\]"),
        (_without("moe_intermediate_size"), "text config lacks 'moe_intermediate_size'; re-convert"),
        ({**TEXT_CONFIG, "rope_parameters": {"rope_theta": 1e7}}, "text config lacks 'partial_rotary_factor'"),
        ({**TEXT_CONFIG, "layer_types": TEXT_CONFIG["layer_types"][:-1]}, "layer_types must list 40 entries"),
        ({**TEXT_CONFIG, "num_key_value_heads": 3}, "head counts must divide"),
        ({**TEXT_CONFIG, "num_experts_per_tok": 257}, r"num_experts_per_tok 257 must be in 1\.\.256"),
    ],
)
def test_unsupported_configs_fail_with_one_line(config, message):
    with pytest.raises(NinferError, match=message) as err:
        ModelDims.from_text_config(config)
    assert "\n" not in str(err.value)
