"""A tiny random Qwen3.5/3.6-MoE Hugging Face checkpoint: the real architecture at toy size (`ninfer tiny`).

Tensor names and shapes are the converter's own layout plan (`convert.layout.plan_layout`), so the
checkpoint holds exactly the tensors `ninfer convert` reads. The weights are non-degenerate (one
wrong convention moves logits by O(1), docs/model.md §10) and exactly representable in bfloat16,
so the lossless `bf16` recipe reproduces them bit for bit. Every tensor has its own generator,
seeded from the seed and the tensor's name without the text prefix: its values depend on nothing
else, so the text weights of the "conditional" layout equal those of "fused".

Layouts:
  "fused"        `model.*` prefix, `mlp.experts.gate_up_proj [E, 2I, H]` / `down_proj [E, H, I]`
  "per_expert"   `mlp.experts.{e}.{gate,up,down}_proj.weight` (save_pretrained's form)
  "conditional"  `model.language_model.*` + `model.visual.*` + `lm_head`, fused experts, nested config
The text prefix follows the config: `model.language_model.` for a nested (ConditionalGeneration)
config, whatever the expert form.

The tests load the same tensors into transformers' models, their oracle (tests/tiny_hf.py).
"""

from __future__ import annotations

import json
import math
import zlib
from collections.abc import Iterator
from pathlib import Path

import torch
from safetensors.torch import save_file

from ninfer_offload.convert.hf_config import CAUSAL, CONDITIONAL, read_model_config
from ninfer_offload.convert.layout import plan_layout
from ninfer_offload.convert.tiny_tokenizer import write_tokenizer_files

LAYOUTS = ("fused", "per_expert", "conditional")
CAUSAL_PREFIX, CONDITIONAL_PREFIX = "model.", "model.language_model."

# Both layer kinds, head_dim != hidden / heads, distinct GDN key and value dims: the conventions
# a re-implementation can get wrong all show at this size.
TEXT_CONFIG = {
    "vocab_size": 512,
    "hidden_size": 64,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 32,
    "linear_num_key_heads": 2,
    "linear_key_head_dim": 16,
    "linear_num_value_heads": 4,
    "linear_value_head_dim": 24,
    "linear_conv_kernel_dim": 4,
    "num_experts": 8,
    "num_experts_per_tok": 2,
    "moe_intermediate_size": 32,
    "shared_expert_intermediate_size": 48,
    "max_position_embeddings": 4096,
    "rms_norm_eps": 1e-6,
    "tie_word_embeddings": False,
    # mrope_section sums to rotary_dim / 2 = 32 * 0.25 / 2
    "rope_parameters": {"rope_type": "default", "rope_theta": 1e7, "partial_rotary_factor": 0.25, "mrope_section": [2, 1, 1]},
    "bos_token_id": None,
    "eos_token_id": None,
    "pad_token_id": None,
}
# Dimensions that NVFP4 expert matrices accept (rows a multiple of 128, columns of 64): hidden size,
# expert and shared-expert widths 128, and 4 experts to keep the model small.
NVFP4_DIMS = {"hidden_size": 128, "moe_intermediate_size": 128, "shared_expert_intermediate_size": 128, "num_experts": 4}
VISION_CONFIG = {
    "depth": 2,
    "hidden_size": 32,
    "intermediate_size": 48,
    "num_heads": 2,
    "patch_size": 4,
    "temporal_patch_size": 2,
    "spatial_merge_size": 2,
    "num_position_embeddings": 16,
    "in_channels": 3,
}


def tiny_config(layout: str = "fused", num_layers: int = 6, full_attention_interval: int = 3, nvfp4: bool = False) -> dict:
    """The config.json of a tiny model: flat (CausalLM) or nested with a vision tower ("conditional").

    Layer i is full attention iff (i + 1) % full_attention_interval == 0 (the real model uses 4), so
    the last of the default 6 layers is full attention like layer 39 of the real model. `nvfp4`
    selects NVFP4_DIMS, so that `ninfer convert --recipe nvfp4` accepts the model.
    """
    if layout not in LAYOUTS:
        raise ValueError(f"layout must be one of {LAYOUTS}, got {layout!r}")
    kinds = ["full_attention" if (i + 1) % full_attention_interval == 0 else "linear_attention" for i in range(num_layers)]
    if len(set(kinds)) != 2:
        raise ValueError(f"{num_layers} layers with interval {full_attention_interval} do not give both layer kinds")
    text = {"model_type": "qwen3_5_moe_text", **TEXT_CONFIG, **(NVFP4_DIMS if nvfp4 else {}), "num_hidden_layers": num_layers,
            "layer_types": kinds}
    if layout != "conditional":
        return {"architectures": [CAUSAL], **text}
    vision = {"model_type": "qwen3_5_moe_vision", **VISION_CONFIG, "out_hidden_size": text["hidden_size"]}
    return {
        "architectures": [CONDITIONAL],
        "model_type": "qwen3_5_moe",
        "text_config": text,
        "vision_config": vision,
        "tie_word_embeddings": False,
    }


def source_shapes(config: dict, mtp: bool = True) -> dict[str, tuple[int, ...]]:
    """Hugging Face name -> shape of every tensor the converter reads from a checkpoint of `config` (fused experts)."""
    spec = read_model_config(config)
    prefix = CONDITIONAL_PREFIX if "text_config" in config else CAUSAL_PREFIX
    plan = plan_layout(spec, "bf16", lambda name: True, prefix, mtp, spec.vision is not None)
    return {source.tensor: source.shape for parent in plan.parents for source in parent.sources}


def random_tensor(name: str, shape: tuple[int, ...], seed: int) -> torch.Tensor:
    """bfloat16 values of one tensor, chosen by its name so that one wrong convention shows.

    Matrices ~ N(0, 1/fan_in); embeddings ~ N(0, 1); offset-norm weights ~ N(0, 0.2) (they act as
    1 + w); plain norms (GDN output norm, vision LayerNorms) ~ 1 + N(0, 0.2); biases ~ N(0, 0.1);
    A_log = log U(1, 16); dt_bias = inverse-softplus of a log-uniform step in [1e-3, 1e-1].
    """
    canonical = name.replace(CONDITIONAL_PREFIX, CAUSAL_PREFIX, 1)
    generator = torch.Generator().manual_seed(zlib.crc32(f"{seed}:{canonical}".encode()))
    leaf = name.rsplit(".", 1)[-1]
    if leaf == "A_log":
        value = torch.log(torch.rand(shape, generator=generator) * 15 + 1)
    elif leaf == "dt_bias":
        dt = torch.exp(torch.rand(shape, generator=generator) * math.log(100) + math.log(1e-3))
        value = dt + torch.log(-torch.expm1(-dt))  # softplus^-1(dt)
    else:
        if "embed_tokens" in name:
            std, mean = 1.0, 0.0
        elif leaf == "bias":
            std, mean = 0.1, 0.0
        elif len(shape) == 1:
            std, mean = 0.2, 1.0 if "linear_attn.norm" in name or "visual" in name else 0.0
        else:  # fused banks [E, rows, K] have fan-in K; other matrices everything after the first axis
            std, mean = 1 / math.sqrt(shape[-1] if leaf in ("gate_up_proj", "down_proj") else math.prod(shape[1:])), 0.0
        value = torch.randn(shape, generator=generator).mul_(std).add_(mean)
    return value.to(torch.bfloat16)


def checkpoint_entries(name: str, value: torch.Tensor, layout: str) -> Iterator[tuple[str, torch.Tensor]]:
    """The checkpoint tensors of one source tensor: itself, or per-expert tensors of a fused bank."""
    if layout != "per_expert" or not name.endswith(("mlp.experts.gate_up_proj", "mlp.experts.down_proj")):
        yield name, value
        return
    prefix, kind = name.rsplit(".", 1)
    if kind == "down_proj":
        for e in range(value.shape[0]):
            yield f"{prefix}.{e}.down_proj.weight", value[e].clone()
        return
    inter = value.shape[1] // 2
    for e in range(value.shape[0]):
        yield f"{prefix}.{e}.gate_proj.weight", value[e, :inter].clone()
        yield f"{prefix}.{e}.up_proj.weight", value[e, inter:].clone()


def checkpoint_tensors(config: dict, layout: str = "fused", mtp: bool = True, seed: int = 0) -> dict[str, torch.Tensor]:
    """Every tensor of the checkpoint, by Hugging Face name, in float32 (exact: the values are bf16)."""
    tensors = {}
    for name, shape in source_shapes(config, mtp).items():
        tensors.update((key, value.float()) for key, value in checkpoint_entries(name, random_tensor(name, shape, seed), layout))
    return tensors


def write_checkpoint(
    directory: str | Path,
    config: dict | None = None,
    layout: str = "fused",
    mtp: bool = True,
    shards: int = 1,
    dtype: torch.dtype = torch.bfloat16,
    seed: int = 0,
) -> Path:
    """Write a checkpoint the way published ones look; returns the directory.

    config.json (default `tiny_config(layout)`), the tensors in `dtype` (bfloat16 like the published
    checkpoints) in `model.safetensors` or, with `shards > 1`, `model-0000i-of-0000n.safetensors`
    files and `model.safetensors.index.json`, the tokenizer files and generation_config.json, and
    for "conditional" the two preprocessor configs. Shards are generated one at a time, so memory
    holds one shard.
    """
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    config = config or tiny_config(layout)
    shapes = source_shapes(config, mtp)
    names = sorted(shapes)
    per_shard = -(-len(names) // shards)
    weight_map, total = {}, 0
    for i in range(shards):
        tensors = {}
        for name in names[i * per_shard : (i + 1) * per_shard]:
            value = random_tensor(name, shapes[name], seed).to(dtype)
            tensors.update((key, part.contiguous()) for key, part in checkpoint_entries(name, value, layout))
        file = "model.safetensors" if shards == 1 else f"model-{i + 1:05d}-of-{shards:05d}.safetensors"
        save_file(tensors, str(directory / file), metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(tensors, file))
        total += sum(t.numel() * t.element_size() for t in tensors.values())
    if shards > 1:
        index = {"metadata": {"total_size": total}, "weight_map": weight_map}
        (directory / "model.safetensors.index.json").write_text(json.dumps(index, indent=2))
    (directory / "config.json").write_text(json.dumps(config, indent=2))
    text = config.get("text_config", config)
    write_tokenizer_files(directory, vocab_size=text["vocab_size"])
    if "vision_config" in config:
        _write_preprocessor_configs(directory, config["vision_config"])
    return directory


def _write_preprocessor_configs(directory: Path, vision: dict) -> None:
    for name, processor in (("preprocessor_config.json", "image"), ("video_preprocessor_config.json", "video")):
        preprocessor = {
            "processor_type": f"tiny {processor} processor",
            "patch_size": vision["patch_size"],
            "temporal_patch_size": vision["temporal_patch_size"],
            "merge_size": vision["spatial_merge_size"],
            "image_mean": [0.5, 0.5, 0.5],
            "image_std": [0.5, 0.5, 0.5],
        }
        (directory / name).write_text(json.dumps(preprocessor, indent=2))
