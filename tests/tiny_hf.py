"""Tiny random Qwen3.5/3.6-MoE models in transformers: the oracle for the engine's math.

The checkpoints are the package's (`ninfer_offload.convert.tiny`, what `ninfer tiny` writes):
`save_checkpoint` writes one, `build_tiny_model` loads the same weights into transformers'
`Qwen3_5MoeForCausalLM` (or, for the "conditional" layout, `Qwen3_5MoeForConditionalGeneration`
with a tiny vision tower around the same text weights). The weights are non-degenerate and exactly
representable in bfloat16, so the lossless `bf16` recipe reproduces them bit for bit; the layouts
("fused", "per_expert", "conditional") are described in that module. `hf_state_from_artifact`
rebuilds transformers' tensors from what an artifact stores, for quantized artifacts' oracles.

Import this module (or `tests/conftest.py`, which does) before anything else imports transformers'
qwen3_5_moe modeling code: `oracle_module()` imports it with flash-linear-attention and
causal-conv1d hidden, because on CPU those Triton kernels would receive CPU tensors and fail.
"""

from __future__ import annotations

import importlib
import inspect
import sys
from pathlib import Path

import torch

from ninfer_offload.convert import tiny

_MODELING = "transformers.models.qwen3_5_moe.modeling_qwen3_5_moe"
_FAST_KERNEL_PACKAGES = ("fla", "causal_conv1d")


def oracle_module():
    """transformers' qwen3_5_moe modeling module with the pure-PyTorch GDN and conv paths bound.

    The fast-kernel fallbacks are resolved when the module is first imported, so the packages are
    hidden only during that import (the engine's own process may still use them). Raises if the
    module was already imported with a fast kernel bound.
    """
    if _MODELING not in sys.modules:
        saved = {name: sys.modules.get(name) for name in _FAST_KERNEL_PACKAGES}
        for name in _FAST_KERNEL_PACKAGES:
            sys.modules[name] = None  # makes `import name` raise ImportError
        try:
            importlib.import_module(_MODELING)
        finally:
            for name, module in saved.items():
                if module is None:
                    del sys.modules[name]
                else:
                    sys.modules[name] = module
    module = sys.modules[_MODELING]
    for fn in (module.torch_chunk_gated_delta_rule, module.torch_recurrent_gated_delta_rule, module.causal_conv1d_fn):
        if binds_fast_kernel(fn):
            raise RuntimeError(f"{_MODELING} was imported with a fast kernel bound; import tests/tiny_hf.py first")
    return module


def binds_fast_kernel(fn) -> bool:
    """Whether transformers' fallback wrapper `fn` bound a fast package's kernel instead of its PyTorch function.

    With the `kernels` distribution installed (a dependency of transformers >= 5.25) the wrapper sits inside a
    `Func` module whose `forward` calls it; without it, `fn` is the wrapper itself.
    """
    if not inspect.isfunction(fn):
        fn = type(fn).forward
    names = inspect.getclosurevars(fn).nonlocals
    if "is_new_implementation" in names:
        return bool(names["is_new_implementation"])
    return inspect.isfunction(names.get("func")) and binds_fast_kernel(names["func"])


def cache_keyword(model) -> str:
    """Name of the forward argument that takes the KV/GDN cache: `cache` (5.24) or `past_key_values` (5.17)."""
    return "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"


@torch.no_grad()
def oracle_forward(model, token_ids: list[int] | torch.Tensor, cache=None):
    """One transformers forward over `token_ids` continuing `cache`; returns (logits [T, vocab], cache)."""
    ids = torch.as_tensor(token_ids, dtype=torch.long).reshape(1, -1)
    out = model(input_ids=ids, use_cache=True, **{cache_keyword(model): cache})
    new_cache = out.cache if hasattr(out, "cache") and out.cache is not None else out.past_key_values
    return out.logits[0], new_cache


def build_tiny_model(seed: int = 0, layout: str = "fused", num_layers: int = 6):
    """transformers' float32 model (eval mode) holding the weights of the package's tiny checkpoint.

    `ninfer_offload.convert.tiny` is the one builder: its config and tensors for (`seed`, `layout`)
    go into a `Qwen3_5MoeForCausalLM` ("fused" and "per_expert": the same weights) or, for
    "conditional", a `Qwen3_5MoeForConditionalGeneration` whose text weights are the same.
    """
    modeling = oracle_module()
    config = tiny.tiny_config(layout, num_layers)
    if layout == "conditional":
        from transformers import Qwen3_5MoeConfig

        model = modeling.Qwen3_5MoeForConditionalGeneration(Qwen3_5MoeConfig.from_dict(config))
    else:
        from transformers import Qwen3_5MoeTextConfig

        model = modeling.Qwen3_5MoeForCausalLM(Qwen3_5MoeTextConfig.from_dict(config))
    model.load_state_dict(tiny.checkpoint_tensors(config, "fused", mtp=False, seed=seed), strict=True)  # transformers' banks are fused
    return model.eval()


def text_config_of(model):
    """The text config of a CausalLM or ConditionalGeneration model."""
    return getattr(model.config, "text_config", model.config)


def checkpoint_tensors(layout: str = "fused", seed: int = 0, num_layers: int = 6) -> dict[str, torch.Tensor]:
    """Every tensor (float32, `mtp.*` included) of the checkpoint `save_checkpoint` writes, by Hugging Face name."""
    return tiny.checkpoint_tensors(tiny.tiny_config(layout, num_layers), layout, seed=seed)


def save_checkpoint(
    directory: str | Path,
    layout: str = "fused",
    with_mtp: bool = True,
    shards: int = 1,
    dtype: torch.dtype = torch.bfloat16,
    seed: int = 0,
    num_layers: int = 6,
) -> Path:
    """The package's tiny checkpoint of `build_tiny_model(seed, layout, num_layers)`; returns the directory."""
    config = tiny.tiny_config(layout, num_layers)
    return tiny.write_checkpoint(directory, config, layout, mtp=with_mtp, shards=shards, dtype=dtype, seed=seed)


@torch.no_grad()
def router_margin(model, token_ids: list[int]) -> float:
    """Smallest gap, over layers and tokens, between the k-th and (k+1)-th router logit.

    A seed whose margin is far from 0 routes identically under small numeric differences, so a
    re-implementation's logits can be compared with transformers' without near-tie flips.
    """
    ids = torch.as_tensor(token_ids, dtype=torch.long).reshape(1, -1)
    out = model(input_ids=ids, output_router_logits=True, use_cache=False)
    k = text_config_of(model).num_experts_per_tok
    margins = [torch.sort(logits.float(), dim=-1, descending=True).values for logits in out.router_logits]
    return min(float((m[:, k - 1] - m[:, k]).min()) for m in margins)


def hf_state_from_artifact(artifact, config) -> dict[str, torch.Tensor]:
    """Hugging Face `Qwen3_5MoeForCausalLM` tensors rebuilt from the artifact's bindings."""
    t = artifact.tensor
    state = {
        "model.embed_tokens.weight": t("text/token_embedding"),
        "model.norm.weight": t("text/final_norm"),
        "lm_head.weight": t("text/output_head"),
    }
    heads, dim = config.num_attention_heads, config.head_dim
    for layer, kind in enumerate(config.layer_types):
        src, dst = f"text/layers/{layer}", f"model.layers.{layer}"
        state[f"{dst}.input_layernorm.weight"] = t(f"{src}/input_norm")
        state[f"{dst}.post_attention_layernorm.weight"] = t(f"{src}/post_attention_norm")
        if kind == "full_attention":
            a = f"{src}/attention"
            query = t(f"{a}/query").reshape(heads, 1, dim, -1)
            gate = t(f"{a}/gate").reshape(heads, 1, dim, -1)
            state[f"{dst}.self_attn.q_proj.weight"] = torch.cat([query, gate], dim=1).reshape(2 * heads * dim, -1)
            for ours, theirs in (("key", "k_proj"), ("value", "v_proj"), ("output", "o_proj")):
                state[f"{dst}.self_attn.{theirs}.weight"] = t(f"{a}/{ours}")
            state[f"{dst}.self_attn.q_norm.weight"] = t(f"{a}/query_norm").reshape(-1)
            state[f"{dst}.self_attn.k_norm.weight"] = t(f"{a}/key_norm").reshape(-1)
        else:
            g, out = f"{src}/gdn", f"{dst}.linear_attn"
            state[f"{out}.in_proj_qkv.weight"] = torch.cat([t(f"{g}/query"), t(f"{g}/key"), t(f"{g}/value")])
            state[f"{out}.in_proj_z.weight"] = t(f"{g}/z")
            state[f"{out}.in_proj_a.weight"] = t(f"{g}/a_projection").reshape(config.linear_num_value_heads, -1)
            state[f"{out}.in_proj_b.weight"] = t(f"{g}/b_projection").reshape(config.linear_num_value_heads, -1)
            state[f"{out}.A_log"] = t(f"{g}/a_log").reshape(-1)
            state[f"{out}.dt_bias"] = t(f"{g}/dt_bias").reshape(-1)
            state[f"{out}.conv1d.weight"] = t(f"{g}/convolution").T.unsqueeze(1).contiguous()
            state[f"{out}.norm.weight"] = t(f"{g}/norm").reshape(-1)
            state[f"{out}.out_proj.weight"] = t(f"{g}/output")
        m, out = f"{src}/moe", f"{dst}.mlp"
        state[f"{out}.gate.weight"] = t(f"{m}/router").reshape(config.num_experts, -1)
        state[f"{out}.shared_expert_gate.weight"] = t(f"{m}/shared_score").reshape(1, -1)
        for part in ("gate", "up", "down"):
            state[f"{out}.shared_expert.{part}_proj.weight"] = t(f"{m}/shared/{part}")
        experts = range(config.num_experts)
        state[f"{out}.experts.gate_up_proj"] = torch.stack(
            [torch.cat([t(f"{m}/experts/{e}/gate"), t(f"{m}/experts/{e}/up")]) for e in experts]
        )
        state[f"{out}.experts.down_proj"] = torch.stack([t(f"{m}/experts/{e}/down") for e in experts])
    return state
