"""Tiny random Qwen3.5/3.6-MoE Hugging Face models: the transformers oracle for the engine's math.

`build_tiny_model` makes a float32 `Qwen3_5MoeForCausalLM` (or, for the "conditional" layout, a
`Qwen3_5MoeForConditionalGeneration` whose language model is the same CausalLM weights plus a tiny
vision tower) with non-degenerate weights that are exactly representable in bfloat16, so the
lossless `bf16` recipe reproduces them bit for bit. `save_checkpoint` writes it the way published
checkpoints look: config.json, safetensors (one file or shards + index), tokenizer files,
generation_config.json, and optionally random `mtp.*` tensors.

Checkpoint layouts:
  "fused"        `model.*` prefix, `mlp.experts.gate_up_proj [E, 2I, H]` / `down_proj [E, H, I]`
  "per_expert"   `model.*` prefix, `mlp.experts.{e}.{gate,up,down}_proj.weight` (save_pretrained's form)
  "conditional"  `model.language_model.*` + `model.visual.*` + `lm_head`, fused experts, nested config

Import this module (or `tests/conftest.py`, which does) before anything else imports transformers'
qwen3_5_moe modeling code: `oracle_module()` imports it with flash-linear-attention and
causal-conv1d hidden, because on CPU those Triton kernels would receive CPU tensors and fail.
"""

from __future__ import annotations

import importlib
import inspect
import json
import math
import sys
from pathlib import Path

import torch
from safetensors.torch import save_file
from tiny_tokenizer import write_tokenizer_files

LAYOUTS = ("fused", "per_expert", "conditional")
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
        if inspect.getclosurevars(fn).nonlocals.get("is_new_implementation"):
            raise RuntimeError(f"{_MODELING} was imported with a fast kernel bound; import tests/tiny_hf.py first")
    return module


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


def tiny_text_config(
    num_layers: int = 6,
    full_attention_interval: int = 3,
    hidden_size: int = 64,
    vocab_size: int = 512,
    num_experts: int = 8,
    top_k: int = 2,
    **overrides,
):
    """A tiny `Qwen3_5MoeTextConfig`: both layer kinds, head_dim != hidden/heads, distinct GDN dims.

    Layer i is full attention iff (i + 1) % full_attention_interval == 0 (the real model uses 4),
    so the last layer of the default 6 is full attention like layer 39 of the real model.
    """
    from transformers import Qwen3_5MoeTextConfig

    layer_types = [
        "full_attention" if (i + 1) % full_attention_interval == 0 else "linear_attention" for i in range(num_layers)
    ]
    if len(set(layer_types)) != 2:
        raise ValueError(f"{num_layers} layers with interval {full_attention_interval} do not give both layer kinds")
    values = dict(
        vocab_size=vocab_size,
        hidden_size=hidden_size,
        num_hidden_layers=num_layers,
        layer_types=layer_types,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=32,
        linear_num_key_heads=2,
        linear_key_head_dim=16,
        linear_num_value_heads=4,
        linear_value_head_dim=24,
        linear_conv_kernel_dim=4,
        num_experts=num_experts,
        num_experts_per_tok=top_k,
        moe_intermediate_size=32,
        shared_expert_intermediate_size=48,
        max_position_embeddings=4096,
        rms_norm_eps=1e-6,
        tie_word_embeddings=False,
        rope_parameters={
            "rope_type": "default",
            "rope_theta": 1e7,
            "partial_rotary_factor": 0.25,
            "mrope_section": [2, 1, 1],  # sums to rotary_dim / 2 = 32 * 0.25 / 2
        },
        eos_token_id=None,
        pad_token_id=None,
        bos_token_id=None,
    )
    values.update(overrides)
    return Qwen3_5MoeTextConfig(**values)


def tiny_vision_config(out_hidden_size: int):
    """A tiny `Qwen3_5MoeVisionConfig` (2 blocks) whose merger feeds a text model of `out_hidden_size`."""
    from transformers import Qwen3_5MoeVisionConfig

    return Qwen3_5MoeVisionConfig(
        depth=2,
        hidden_size=32,
        intermediate_size=48,
        num_heads=2,
        patch_size=4,
        temporal_patch_size=2,
        spatial_merge_size=2,
        out_hidden_size=out_hidden_size,
        num_position_embeddings=16,
        in_channels=3,
    )


def _bf16_exact(t: torch.Tensor) -> torch.Tensor:
    return t.to(torch.bfloat16).to(torch.float32)


@torch.no_grad()
def _init_nondegenerate(module: torch.nn.Module, generator: torch.Generator) -> None:
    """Weights under which one wrong convention moves logits by O(1) (docs/model.md §10, test-model weights).

    Matrices ~ N(0, 1/fan_in); embeddings ~ N(0, 1); offset-norm weights ~ N(0, 0.2) (they act as
    1 + w); plain norms (GDN output norm, vision LayerNorms) ~ 1 + N(0, 0.2); biases ~ N(0, 0.1);
    A_log = log U(1, 16); dt_bias = inverse-softplus of a log-uniform step in [1e-3, 1e-1].
    Everything is then rounded to bfloat16-representable float32 values.
    """

    def normal(shape, std, mean=0.0):
        return torch.randn(shape, generator=generator) * std + mean

    for name, p in module.named_parameters():
        shape = tuple(p.shape)
        leaf = name.rsplit(".", 1)[-1]
        if leaf == "A_log":
            value = torch.log(torch.rand(shape, generator=generator) * 15 + 1)
        elif leaf == "dt_bias":
            dt = torch.exp(torch.rand(shape, generator=generator) * math.log(100) + math.log(1e-3))
            value = dt + torch.log(-torch.expm1(-dt))  # softplus^-1(dt)
        elif "embed_tokens" in name:
            value = normal(shape, 1.0)
        elif leaf == "bias":
            value = normal(shape, 0.1)
        elif len(shape) == 1:
            plain = "linear_attn.norm" in name or "visual" in name
            value = normal(shape, 0.2, mean=1.0 if plain else 0.0)
        elif leaf in ("gate_up_proj", "down_proj") and len(shape) == 3:
            value = normal(shape, 1 / math.sqrt(shape[-1]))
        else:
            fan_in = math.prod(shape[1:])
            value = normal(shape, 1 / math.sqrt(fan_in))
        p.copy_(_bf16_exact(value))


def build_tiny_model(seed: int = 0, layout: str = "fused", num_layers: int = 6, **config_overrides):
    """A float32 tiny model in eval mode; "conditional" adds a vision tower around the same text weights.

    For a given seed and config, the text weights are identical for every layout.
    """
    if layout not in LAYOUTS:
        raise ValueError(f"layout must be one of {LAYOUTS}, got {layout!r}")
    modeling = oracle_module()
    text_config = tiny_text_config(num_layers=num_layers, **config_overrides)
    torch.manual_seed(seed)
    causal = modeling.Qwen3_5MoeForCausalLM(text_config)
    _init_nondegenerate(causal, torch.Generator().manual_seed(seed))
    if layout != "conditional":
        return causal.eval()

    from transformers import Qwen3_5MoeConfig

    config = Qwen3_5MoeConfig(
        text_config=text_config.to_dict(),
        vision_config=tiny_vision_config(text_config.hidden_size).to_dict(),
        tie_word_embeddings=False,
    )
    model = modeling.Qwen3_5MoeForConditionalGeneration(config)
    _init_nondegenerate(model.model.visual, torch.Generator().manual_seed(seed + 1))
    model.model.language_model.load_state_dict(causal.model.state_dict())
    model.lm_head.load_state_dict(causal.lm_head.state_dict())
    return model.eval()


def text_config_of(model):
    """The text config of a CausalLM or ConditionalGeneration model."""
    return getattr(model.config, "text_config", model.config)


def build_mtp_weights(text_config, seed: int = 0, fused_experts: bool = True) -> dict[str, torch.Tensor]:
    """Random `mtp.*` tensors shaped like the published ones (fc, three norms, one full-attention layer)."""
    modeling = oracle_module()
    full = text_config.layer_types.index("full_attention")
    torch.manual_seed(seed + 2)
    layer = modeling.Qwen3_5MoeDecoderLayer(text_config, full)
    hidden = text_config.hidden_size
    stem = torch.nn.ParameterDict(
        {
            "fc": torch.nn.Parameter(torch.empty(hidden, 2 * hidden)),
            "pre_fc_norm_embedding": torch.nn.Parameter(torch.empty(hidden)),
            "pre_fc_norm_hidden": torch.nn.Parameter(torch.empty(hidden)),
            "norm": torch.nn.Parameter(torch.empty(hidden)),
        }
    )
    generator = torch.Generator().manual_seed(seed + 2)
    _init_nondegenerate(stem, generator)
    _init_nondegenerate(layer, generator)
    tensors = {f"mtp.{name}.weight": p.detach().clone() for name, p in stem.items()}
    layer_tensors = {f"mtp.layers.0.{k}": v for k, v in layer.state_dict().items()}
    tensors.update(layer_tensors if fused_experts else _split_experts(layer_tensors))
    return tensors


def _split_experts(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Rewrite fused expert tensors as per-expert `experts.{e}.{gate,up,down}_proj.weight` tensors."""
    out: dict[str, torch.Tensor] = {}
    for name, value in state.items():
        if name.endswith("mlp.experts.gate_up_proj"):
            prefix = name[: -len("gate_up_proj")]
            inter = value.shape[1] // 2
            for e in range(value.shape[0]):
                out[f"{prefix}{e}.gate_proj.weight"] = value[e, :inter].clone()
                out[f"{prefix}{e}.up_proj.weight"] = value[e, inter:].clone()
        elif name.endswith("mlp.experts.down_proj"):
            prefix = name[: -len("down_proj")]
            for e in range(value.shape[0]):
                out[f"{prefix}{e}.down_proj.weight"] = value[e].clone()
        else:
            out[name] = value
    return out


def checkpoint_tensors(model, layout: str, with_mtp: bool = True, seed: int = 0) -> dict[str, torch.Tensor]:
    """Every tensor the checkpoint of `model` holds in `layout`, by Hugging Face name (float32)."""
    is_conditional = hasattr(model.config, "text_config")
    if (layout == "conditional") != is_conditional:
        raise ValueError(f"layout {layout!r} does not match a {type(model).__name__}")
    state = {k: v.detach().clone() for k, v in model.state_dict().items()}
    if layout == "per_expert":
        state = _split_experts(state)
    if with_mtp:
        state.update(build_mtp_weights(text_config_of(model), seed, fused_experts=layout != "per_expert"))
    return state


def save_checkpoint(
    model,
    directory: str | Path,
    layout: str = "fused",
    with_mtp: bool = True,
    shards: int = 1,
    dtype: torch.dtype = torch.bfloat16,
    seed: int = 0,
) -> Path:
    """Write `model` as a Hugging Face checkpoint directory; returns the directory.

    Tensors are stored in `dtype` (bfloat16 like the published checkpoints: exact, because the
    weights are bf16-representable). With `shards > 1` the tensors are spread over
    `model-0000i-of-0000n.safetensors` files with a `model.safetensors.index.json`.
    """
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    tensors = {k: v.to(dtype).contiguous() for k, v in checkpoint_tensors(model, layout, with_mtp, seed).items()}
    names = sorted(tensors)
    if shards <= 1:
        save_file(tensors, str(directory / "model.safetensors"), metadata={"format": "pt"})
    else:
        weight_map = {}
        per_shard = -(-len(names) // shards)
        for i in range(shards):
            file = f"model-{i + 1:05d}-of-{shards:05d}.safetensors"
            chunk = names[i * per_shard : (i + 1) * per_shard]
            save_file({k: tensors[k] for k in chunk}, str(directory / file), metadata={"format": "pt"})
            weight_map.update({k: file for k in chunk})
        total = sum(t.numel() * t.element_size() for t in tensors.values())
        index = {"metadata": {"total_size": total}, "weight_map": weight_map}
        (directory / "model.safetensors.index.json").write_text(json.dumps(index, indent=2))
    config = model.config.to_dict()  # complete, like published configs
    config["architectures"] = [type(model).__name__]
    (directory / "config.json").write_text(json.dumps(config, indent=2))
    write_tokenizer_files(directory, vocab_size=text_config_of(model).vocab_size)
    if layout == "conditional":
        vision = model.config.vision_config
        for name, processor in (("preprocessor_config.json", "image"), ("video_preprocessor_config.json", "video")):
            preprocessor = {
                "processor_type": f"tiny {processor} processor",
                "patch_size": vision.patch_size,
                "temporal_patch_size": vision.temporal_patch_size,
                "merge_size": vision.spatial_merge_size,
                "image_mean": [0.5, 0.5, 0.5],
                "image_std": [0.5, 0.5, 0.5],
            }
            (directory / name).write_text(json.dumps(preprocessor, indent=2))
    return directory


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
