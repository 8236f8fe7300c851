"""Read a Hugging Face Qwen3.5/3.6-MoE `config.json` into model dimensions and component configs.

Only the MoE family is supported: `Qwen3_5MoeForCausalLM` (flat config, weights under `model.`)
and `Qwen3_5MoeForConditionalGeneration` (nested `text_config` / `vision_config`, weights under
`model.language_model.` and `model.visual.`). The component configs follow the binder member
sets of docs/format.md §8.2 exactly; floats are rounded to binary32 as the reference writer does.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ninfer_offload.artifact.dims import SUPPORTED_ARCHITECTURES, ModelDims
from ninfer_offload.errors import NinferError

CAUSAL, CONDITIONAL = SUPPORTED_ARCHITECTURES  # Qwen3_5MoeForCausalLM, Qwen3_5MoeForConditionalGeneration
_MODEL_TYPES = {"qwen3_5_moe_text": CAUSAL, "qwen3_5_moe": CONDITIONAL}


@dataclass(frozen=True)
class VisionDims:
    """Dimensions of the vision tower (carried through, never run by this engine)."""

    depth: int
    hidden: int
    intermediate: int
    heads: int
    patch: int
    temporal_patch: int
    merge: int
    positions: int
    in_channels: int
    out_hidden: int

    @property
    def merged(self) -> int:
        return self.hidden * self.merge * self.merge


@dataclass(frozen=True)
class ModelSpec:
    """What `config.json` says: architecture, text dims, optional vision dims, component configs."""

    architecture: str
    text: ModelDims
    tied: bool  # `tie_word_embeddings`: without `lm_head.weight` the output head is the token embedding
    vision: VisionDims | None
    text_config: dict
    vision_config: dict | None


def _f32(value: float) -> float:
    return float(np.float32(value))


def _get(config: dict, key: str, where: str, kind=int):
    if key not in config:
        raise NinferError(f"{where}: missing {key!r}")
    value = config[key]
    if kind is int and (type(value) is not int or value <= 0):
        raise NinferError(f"{where}: {key!r} must be a positive integer, got {value!r}")
    if kind is float and (isinstance(value, bool) or not isinstance(value, (int, float))):
        raise NinferError(f"{where}: {key!r} must be a number, got {value!r}")
    return value


def _architecture(raw: dict) -> str:
    names = raw.get("architectures") or []
    if not isinstance(names, list):
        names = [names]
    for name in names:
        if name in (CAUSAL, CONDITIONAL):
            return name
    if not names and raw.get("model_type") in _MODEL_TYPES:
        return _MODEL_TYPES[raw["model_type"]]
    found = ", ".join(map(str, names)) or f"model_type {raw.get('model_type')!r}"
    raise NinferError(f"unsupported architecture {found}: ninfer convert reads {CAUSAL} and {CONDITIONAL} checkpoints")


def _layer_types(text: dict, layers: int) -> tuple[str, ...]:
    types = text.get("layer_types")
    if types is None:
        interval = text.get("full_attention_interval", 4)
        types = ["full_attention" if (i + 1) % interval == 0 else "linear_attention" for i in range(layers)]
    if len(types) != layers or not set(types) <= {"full_attention", "linear_attention"}:
        raise NinferError(f"config.json: layer_types must be {layers} of 'full_attention'/'linear_attention', got {types!r}")
    return tuple(types)


def _rope_parameters(text: dict, head_dim: int) -> dict:
    rope = text.get("rope_parameters") or {}
    theta = rope.get("rope_theta", text.get("rope_theta"))
    if theta is None:
        raise NinferError("config.json: missing 'rope_theta' (in rope_parameters)")
    partial = rope.get("partial_rotary_factor", text.get("partial_rotary_factor", 0.25))
    half = int(head_dim * partial) // 2
    section = rope.get("mrope_section") or (text.get("rope_scaling") or {}).get("mrope_section")
    if section is None:  # text-only: the three axes are equal, any split is exact
        section = [half // 3 + (1 if i < half % 3 else 0) for i in range(3)]
    if sum(section) != half:
        raise NinferError(f"config.json: mrope_section {section} must sum to rotary_dim/2 = {half}")
    return {"rope_theta": _f32(theta), "partial_rotary_factor": _f32(partial), "mrope_section": [int(s) for s in section]}


# Integer members of the text config, copied as they are, in the order the component config lists them
# (`rope_parameters` stands between the two groups).
_ATTENTION_KEYS = ("num_attention_heads", "num_key_value_heads", "head_dim")
_GDN_MOE_KEYS = (
    "linear_num_key_heads",
    "linear_key_head_dim",
    "linear_num_value_heads",
    "linear_value_head_dim",
    "linear_conv_kernel_dim",
    "num_experts",
    "num_experts_per_tok",
    "moe_intermediate_size",
    "shared_expert_intermediate_size",
)


def _text(text: dict) -> dict:
    """The text component config of a Hugging Face text config (the flat one, or its `text_config`)."""
    where = "config.json"
    layers = _get(text, "num_hidden_layers", where)
    hidden, vocab = _get(text, "hidden_size", where), _get(text, "vocab_size", where)
    layer_types = _layer_types(text, layers)
    attention = {key: _get(text, key, where) for key in _ATTENTION_KEYS}
    gdn_moe = {key: _get(text, key, where) for key in _GDN_MOE_KEYS}
    if attention["num_attention_heads"] % attention["num_key_value_heads"] or (
        gdn_moe["linear_num_value_heads"] % gdn_moe["linear_num_key_heads"]
    ):
        raise NinferError("config.json: query heads must be a multiple of KV heads (attention and linear attention)")
    return {
        "architectures": [CAUSAL],
        "model_type": "qwen3_5_moe_text",
        "hidden_size": hidden,
        "vocab_size": vocab,
        "num_hidden_layers": layers,
        "max_position_embeddings": _get(text, "max_position_embeddings", where),
        "tie_word_embeddings": bool(text.get("tie_word_embeddings", False)),
        "rms_norm_eps": _f32(_get(text, "rms_norm_eps", where, float)),
        "layer_types": list(layer_types),
        **attention,
        "rope_parameters": _rope_parameters(text, attention["head_dim"]),
        **gdn_moe,
    }


def _vision(vision: dict, text_hidden: int) -> tuple[VisionDims, dict]:
    where = "config.json vision_config"
    dims = VisionDims(
        depth=_get(vision, "depth", where),
        hidden=_get(vision, "hidden_size", where),
        intermediate=_get(vision, "intermediate_size", where),
        heads=_get(vision, "num_heads", where),
        patch=_get(vision, "patch_size", where),
        temporal_patch=_get(vision, "temporal_patch_size", where),
        merge=_get(vision, "spatial_merge_size", where),
        positions=_get(vision, "num_position_embeddings", where),
        in_channels=vision.get("in_channels", 3),
        out_hidden=vision.get("out_hidden_size", text_hidden),
    )
    config = {
        "model_type": "qwen3_5_moe_vision",
        "depth": dims.depth,
        "hidden_size": dims.hidden,
        "intermediate_size": dims.intermediate,
        "num_heads": dims.heads,
        "patch_size": dims.patch,
        "temporal_patch_size": dims.temporal_patch,
        "spatial_merge_size": dims.merge,
        "num_position_embeddings": dims.positions,
    }
    return dims, config


def read_model_config(raw: dict) -> ModelSpec:
    """Validate a parsed `config.json` and derive dims and the v3 component configs."""
    if not isinstance(raw, dict):
        raise NinferError("config.json: expected a JSON object")
    architecture = _architecture(raw)
    if architecture == CONDITIONAL:
        text_raw = raw.get("text_config")
        if not isinstance(text_raw, dict):
            raise NinferError(f"config.json: {CONDITIONAL} needs a 'text_config' object")
    else:
        text_raw = raw
    text_config = _text(text_raw)
    text = ModelDims.from_text_config(text_config)
    vision = vision_config = None
    if architecture == CONDITIONAL and isinstance(raw.get("vision_config"), dict):
        vision, vision_config = _vision(raw["vision_config"], text.hidden_size)
    return ModelSpec(architecture, text, text_config["tie_word_embeddings"], vision, text_config, vision_config)
