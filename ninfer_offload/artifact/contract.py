"""The official Qwen3.6-35B-A3B v3 directory, generated from the model contract (docs/format.md §8).

`official_directory()` builds the JSON root of the official artifact without any weights:
components, the 6 resources and 934 tensor objects with the converter's ID scheme and order
(§8.6), their formats, byte sizes and offsets (§8.5), all 32,713 bindings and 32,184 uses (§8.4).
The planner uses it so that `ninfer plan` works with no artifact at hand.

Placeholders (the official file was never inspected, docs/format.md §11.1): the resource byte lengths
(RESOURCE_BYTES), `metadata` and `provenance`. The resource lengths are chosen so that the
payload ends at 22,783,095,296 bytes, the value inferred in docs/format.md §10.3; only the offsets of
the tensors depend on them, never their sizes.

`nvfp4_directory()` is the same directory with the formats of the `nvfp4` recipe (docs/format.md
§8.5): the routed and shared experts of the 40 text layers NVFP4, one divisor per member matrix.
"""

from __future__ import annotations

from ninfer_offload.artifact.formats import BLOCK_SCALE, CONTIGUOUS, NVFP4, RAW_BYTES, ROW_SPLIT, align_up, elements, encoded_size

HIDDEN = 2048
VOCAB_ROWS = 248320
TEXT_LAYERS = 40
EXPERTS = 256
EXPERT_WIDTH = 512
PROPOSAL_ROWS = 131072
VISION_DEPTH = 27
VISION_HIDDEN = 1152
VISION_MLP = 4304
DFLASH_LAYERS = 6
DFLASH_MLP = 6144
Q6_DOWN_LAYERS = frozenset({34, 38, 39})

# Placeholder resource lengths (bytes), in the converter's order. Their sum, 12,834,304, makes
# the payload end where docs/format.md §10.3 infers it; the real lengths are unknown.
RESOURCE_BYTES: dict[tuple[str, str], int] = {
    ("text", "tokenizer.json"): 12_807_168,
    ("text", "tokenizer_config.json"): 16_384,
    ("text", "chat_template.jinja"): 8_192,
    ("text", "generation_config.json"): 1_024,
    ("vision", "preprocessor_config.json"): 768,
    ("vision", "video_preprocessor_config.json"): 768,
}

TEXT_CONFIG = {
    "architectures": ["Qwen3_5MoeForCausalLM"],
    "model_type": "qwen3_5_moe_text",
    "hidden_size": HIDDEN,
    "vocab_size": VOCAB_ROWS,
    "num_hidden_layers": TEXT_LAYERS,
    "max_position_embeddings": 262144,
    "tie_word_embeddings": False,
    "rms_norm_eps": 9.999999974752427e-07,
    "layer_types": ["full_attention" if (i + 1) % 4 == 0 else "linear_attention" for i in range(TEXT_LAYERS)],
    "num_attention_heads": 16,
    "num_key_value_heads": 2,
    "head_dim": 256,
    "rope_parameters": {"rope_theta": 10000000.0, "partial_rotary_factor": 0.25, "mrope_section": [11, 11, 10]},
    "linear_num_key_heads": 16,
    "linear_key_head_dim": 128,
    "linear_num_value_heads": 32,
    "linear_value_head_dim": 128,
    "linear_conv_kernel_dim": 4,
    "num_experts": EXPERTS,
    "num_experts_per_tok": 8,
    "moe_intermediate_size": EXPERT_WIDTH,
    "shared_expert_intermediate_size": EXPERT_WIDTH,
}
VISION_CONFIG = {
    "model_type": "qwen3_5_moe_vision",
    "depth": VISION_DEPTH,
    "hidden_size": VISION_HIDDEN,
    "intermediate_size": VISION_MLP,
    "num_heads": 16,
    "patch_size": 16,
    "temporal_patch_size": 2,
    "spatial_merge_size": 2,
    "num_position_embeddings": 2304,
}
MTP_CONFIG = {"architectures": ["Qwen3_5MoeMTP"]}
DFLASH_CONFIG = {
    "architectures": ["DFlashDraftModel"],
    "model_type": "qwen3",
    "intermediate_size": DFLASH_MLP,
    "num_attention_heads": 32,
    "num_key_value_heads": 8,
    "head_dim": 128,
    "num_hidden_layers": DFLASH_LAYERS,
    "max_position_embeddings": 262144,
    "rms_norm_eps": 9.999999974752427e-07,
    "rope_parameters": {"rope_theta": 10000000.0},
    "layer_types": ["sliding_attention"] * 5 + ["full_attention"],
    "sliding_window": 4096,
    "dflash_config": {"target_layer_ids": [1, 6, 11, 16, 22, 27, 32, 37], "mask_token_id": 248077},
}

Q8, Q6, Q5, Q4 = "q8_g32_fp16", "q6_g64_fp16", "q5_g64_fp16", "q4_g64_fp16"
BF16, FP32, INT32 = "bf16", "fp32", "int32"

# A parameter: (binding name, logical shape, format, use inputs). A group: its parameters share one
# parent object, stacked by rows (rank 2) or elements (rank 1), in the listed order.
Param = tuple[str, tuple[int, ...], str, tuple[str, ...]]


def _p(name: str, shape: tuple[int, ...], fmt: str = BF16, *inputs: str) -> Param:
    return (name, shape, fmt, inputs)


def _is_attention(layer: int) -> bool:
    return (layer + 1) % 4 == 0


def _moe_groups(prefix: str, expert_fmt: str, down_fmt: str, shared_fmt: str) -> list[list[Param]]:
    ffn = f"{prefix}/ffn_input"
    gate_up: list[Param] = []
    down: list[Param] = []
    for e in range(EXPERTS):
        ex = f"{prefix}/moe/experts/{e}"
        gate_up += [_p(f"{ex}/gate", (EXPERT_WIDTH, HIDDEN), expert_fmt, ffn), _p(f"{ex}/up", (EXPERT_WIDTH, HIDDEN), expert_fmt, ffn)]
        down.append(_p(f"{ex}/down", (HIDDEN, EXPERT_WIDTH), down_fmt, f"{ex}/product"))
    return [
        [_p(f"{prefix}/moe/router", (EXPERTS, HIDDEN), BF16, ffn), _p(f"{prefix}/moe/shared_score", (1, HIDDEN), BF16, ffn)],
        gate_up,
        down,
        [
            _p(f"{prefix}/moe/shared/gate", (EXPERT_WIDTH, HIDDEN), shared_fmt, ffn),
            _p(f"{prefix}/moe/shared/up", (EXPERT_WIDTH, HIDDEN), shared_fmt, ffn),
        ],
    ]


def _attention_group(prefix: str) -> list[Param]:
    mix = f"{prefix}/mixer_input"
    return [
        _p(f"{prefix}/attention/query", (4096, HIDDEN), Q8, mix),
        _p(f"{prefix}/attention/key", (512, HIDDEN), Q8, mix),
        _p(f"{prefix}/attention/gate", (4096, HIDDEN), Q8, mix),
        _p(f"{prefix}/attention/value", (512, HIDDEN), Q8, mix),
    ]


def _attention_singles(prefix: str, shared_fmt: str) -> list[Param]:
    return [
        _p(f"{prefix}/input_norm", (HIDDEN,)),
        _p(f"{prefix}/attention/query_norm", (256,)),
        _p(f"{prefix}/attention/key_norm", (256,)),
        _p(f"{prefix}/attention/output", (HIDDEN, 4096), Q8, f"{prefix}/attention/gated_output"),
        _p(f"{prefix}/post_attention_norm", (HIDDEN,)),
        _p(f"{prefix}/moe/shared/down", (HIDDEN, EXPERT_WIDTH), shared_fmt, f"{prefix}/moe/shared/product"),
    ]


def _expert_formats(recipe: str, layer: int) -> tuple[str, str, str]:
    """Formats of a text layer's routed gate/up bank, routed down bank and shared expert."""
    if recipe == NVFP4:
        return NVFP4, NVFP4, NVFP4
    return Q4, Q6 if layer in Q6_DOWN_LAYERS else Q5, Q8


def _text_layer(layer: int, recipe: str) -> tuple[list[list[Param]], list[Param]]:
    prefix = f"text/layers/{layer}"
    gate_up_fmt, down_fmt, shared_fmt = _expert_formats(recipe, layer)
    moe = _moe_groups(prefix, gate_up_fmt, down_fmt, shared_fmt)
    if _is_attention(layer):
        return [_attention_group(prefix), *moe], _attention_singles(prefix, shared_fmt)
    mix = f"{prefix}/mixer_input"
    groups = [
        [
            _p(f"{prefix}/gdn/query", (2048, HIDDEN), Q8, mix),
            _p(f"{prefix}/gdn/key", (2048, HIDDEN), Q8, mix),
            _p(f"{prefix}/gdn/value", (4096, HIDDEN), Q8, mix),
            _p(f"{prefix}/gdn/z", (4096, HIDDEN), Q8, mix),
        ],
        [_p(f"{prefix}/gdn/a_projection", (32, HIDDEN), BF16, mix), _p(f"{prefix}/gdn/b_projection", (32, HIDDEN), BF16, mix)],
        *moe,
    ]
    singles = [
        _p(f"{prefix}/input_norm", (HIDDEN,)),
        _p(f"{prefix}/gdn/a_log", (32,), FP32),
        _p(f"{prefix}/gdn/dt_bias", (32,), FP32),
        _p(f"{prefix}/gdn/convolution", (4, 8192)),
        _p(f"{prefix}/gdn/norm", (128,)),
        _p(f"{prefix}/gdn/output", (HIDDEN, 4096), Q8, f"{prefix}/gdn/gated_output"),
        _p(f"{prefix}/post_attention_norm", (HIDDEN,)),
        _p(f"{prefix}/moe/shared/down", (HIDDEN, EXPERT_WIDTH), shared_fmt, f"{prefix}/moe/shared/product"),
    ]
    return groups, singles


def _vision_layer(i: int) -> tuple[list[list[Param]], list[Param]]:
    v, h = f"vision/layers/{i}", VISION_HIDDEN
    qkv = [_p(f"{v}/attention/{n}", (h, h), Q4, f"{v}/attention_input") for n in ("query", "key", "value")]
    bias = [_p(f"{v}/attention/{n}_bias", (h,)) for n in ("query", "key", "value")]
    singles = [
        _p(f"{v}/norm1_weight", (h,)),
        _p(f"{v}/norm1_bias", (h,)),
        _p(f"{v}/norm2_weight", (h,)),
        _p(f"{v}/norm2_bias", (h,)),
        _p(f"{v}/attention/output", (h, h), Q5, f"{v}/attention_output"),
        _p(f"{v}/attention/output_bias", (h,)),
        _p(f"{v}/mlp/fc1", (VISION_MLP, h), Q4, f"{v}/mlp_input"),
        _p(f"{v}/mlp/fc1_bias", (VISION_MLP,)),
        _p(f"{v}/mlp/fc2", (h, VISION_MLP), Q5, f"{v}/mlp_activation"),
        _p(f"{v}/mlp/fc2_bias", (h,)),
    ]
    return [qkv, bias], singles


def _dflash_layer(j: int) -> tuple[list[list[Param]], list[Param]]:
    f = f"dflash/layers/{j}"
    qin, mlp_in = f"{f}/query_projection_input", f"{f}/mlp_input"
    qkv = [
        _p(f"{f}/attention/query", (4096, HIDDEN), Q8, qin),
        _p(f"{f}/attention/key", (1024, HIDDEN), Q8, qin),
        _p(f"{f}/attention/value", (1024, HIDDEN), Q8, qin),
    ]
    gate_up = [_p(f"{f}/mlp/gate", (DFLASH_MLP, HIDDEN), Q8, mlp_in), _p(f"{f}/mlp/up", (DFLASH_MLP, HIDDEN), Q8, mlp_in)]
    singles = [
        _p(f"{f}/input_norm", (HIDDEN,)),
        _p(f"{f}/post_attention_norm", (HIDDEN,)),
        _p(f"{f}/attention/query_norm", (128,)),
        _p(f"{f}/attention/key_norm", (128,)),
        _p(f"{f}/attention/output", (HIDDEN, 4096), Q8, f"{f}/attention_output"),
        _p(f"{f}/mlp/down", (HIDDEN, DFLASH_MLP), Q8, f"{f}/mlp_product"),
    ]
    return [qkv, gate_up], singles


def _emission_order(recipe: str) -> list[list[Param]]:
    """All parents in converter order: every multi-member group first, then every single (§8.6)."""
    groups: list[list[Param]] = []
    singles: list[Param] = [
        _p("text/token_embedding", (VOCAB_ROWS, HIDDEN), Q8),
        _p("text/output_head", (VOCAB_ROWS, HIDDEN), Q6, "text/final_hidden", "mtp/final_hidden", "dflash/final_hidden"),
        _p("text/final_norm", (HIDDEN,)),
    ]
    for layer in range(TEXT_LAYERS):
        g, s = _text_layer(layer, recipe)
        groups += g
        singles += s
    mtp = "mtp/layers/0"
    groups += [_attention_group(mtp), *_moe_groups(mtp, Q8, Q8, Q8)]
    singles += [
        _p("mtp/input_projection", (HIDDEN, 4096), Q8, "mtp/stem_input"),
        _p("mtp/embedding_norm", (HIDDEN,)),
        _p("mtp/hidden_norm", (HIDDEN,)),
        _p("mtp/final_norm", (HIDDEN,)),
        *_attention_singles(mtp, Q8),
    ]
    singles += [
        _p("vision/patch_embedding", (VISION_HIDDEN, 1536), Q6, "vision/patch_input"),
        _p("vision/patch_embedding_bias", (VISION_HIDDEN,)),
        _p("vision/position_embedding", (2304, VISION_HIDDEN)),
    ]
    for i in range(VISION_DEPTH):
        g, s = _vision_layer(i)
        groups += g
        singles += s
    singles += [
        _p("vision/merger/norm_weight", (VISION_HIDDEN,)),
        _p("vision/merger/norm_bias", (VISION_HIDDEN,)),
        _p("vision/merger/fc1", (4608, 4608), Q8, "vision/merger/input"),
        _p("vision/merger/fc1_bias", (4608,)),
        _p("vision/merger/fc2", (HIDDEN, 4608), Q8, "vision/merger/activation"),
        _p("vision/merger/fc2_bias", (HIDDEN,)),
    ]
    singles += [
        _p("dflash/feature_projection", (HIDDEN, 16384), Q8, "dflash/target_features"),
        _p("dflash/context_norm", (HIDDEN,)),
        _p("dflash/final_norm", (HIDDEN,)),
    ]
    for j in range(DFLASH_LAYERS):
        g, s = _dflash_layer(j)
        groups += g
        singles += s
    singles += [
        _p("proposal/head", (PROPOSAL_ROWS, HIDDEN), Q4, "mtp/final_hidden", "dflash/final_hidden"),
        _p("proposal/token_ids", (PROPOSAL_ROWS,), INT32),
    ]
    return groups + [[s] for s in singles]


def _parent_shape(group: list[Param]) -> tuple[int, ...]:
    first = group[0][1]
    if len(group) == 1:
        return first
    if len(first) == 1:
        return (sum(p[1][0] for p in group),)
    return (sum(p[1][0] for p in group), first[1])


def official_directory() -> dict:
    """The official Qwen3.6-35B-A3B v3 JSON root (docs/format.md §8), with placeholder resource sizes."""
    return _directory("official", "Qwen3.6-35B-A3B")


def nvfp4_directory() -> dict:
    """`official_directory()` with the `nvfp4` recipe's formats (docs/format.md §8.5, §10.4)."""
    return _directory(NVFP4, "Qwen3.6-35B-A3B-NVFP4")


def _directory(recipe: str, name: str) -> dict:
    """The JSON root of the 35B model with the formats of `recipe` ("official" or "nvfp4")."""
    objects: list[dict] = []
    offset = 0
    resources: dict[str, dict[str, str]] = {"text": {}, "vision": {}}
    for (component, role), size in RESOURCE_BYTES.items():
        oid = f"resource/{component}/{role}"
        objects.append({"id": oid, "encoding": RAW_BYTES, "offset": offset, "bytes": size, "kind": "resource"})
        resources[component][role] = oid
        offset += size
    bindings: dict[str, dict] = {}
    uses: list[dict] = []
    for index, group in enumerate(_emission_order(recipe)):
        oid = f"weight/{index:06d}"
        shape = _parent_shape(group)
        fmt = group[0][2]
        layout = CONTIGUOUS if fmt in (BF16, FP32, INT32) else BLOCK_SCALE if fmt == NVFP4 else ROW_SPLIT
        divisors = len(group) if fmt == NVFP4 else 1  # one per member matrix (§7.1)
        size = encoded_size(layout, fmt, shape, divisors)
        offset = align_up(offset, 256)
        record = {"id": oid, "shape": list(shape), "format": fmt, "layout": layout, "offset": offset, "bytes": size}
        objects.append({**record, **({"divisors": divisors} if divisors > 1 else {}), "kind": "tensor"})
        offset += size
        begin = 0
        for name, pshape, _, inputs in group:
            end = begin + elements(pshape)
            if len(group) == 1:
                bindings[name] = {"object": oid}
            else:
                bindings[name] = {"parts": [{"object": oid, "range": [begin, end]}]}
            uses += [{"parameter": name, "input": i, "activation_policy": "A16Only"} for i in inputs]
            begin = end
        uses += _share_dflash_context(group, bindings)
    text = {"config": TEXT_CONFIG, "resources": resources["text"], "proposal": {"domain": "indexed", "rows": PROPOSAL_ROWS}}
    return {
        "components": {
            "text": text,
            "vision": {"config": VISION_CONFIG, "target": "text", "resources": resources["vision"]},
            "mtp": {"config": MTP_CONFIG, "target": "text"},
            "dflash": {"config": DFLASH_CONFIG, "target": "text"},
        },
        "objects": objects,
        "bindings": bindings,
        "uses": uses,
        "files": [{"path": None, "payload_bytes": offset}],
        "metadata": {"name": name},  # placeholder: the official value is unknown
        "provenance": {"converter": "ninfer-v3", "recipe": "qwen3_6_35b_a3b" if recipe == "official" else recipe},  # placeholder
    }


def _share_dflash_context(group: list[Param], bindings: dict[str, dict]) -> list[dict]:
    """Bind DFlash `context_key`/`context_value` to the rows of `key`/`value` (§8.5); their Uses."""
    name = group[0][0]
    if not (name.startswith("dflash/layers/") and name.endswith("/attention/query")):
        return []
    layer = name.rsplit("/attention/", 1)[0]
    uses = []
    for kind in ("key", "value"):
        bindings[f"{layer}/attention/context_{kind}"] = {"parts": [dict(p) for p in bindings[f"{layer}/attention/{kind}"]["parts"]]}
        uses.append({"parameter": f"{layer}/attention/context_{kind}", "input": "dflash/context_input", "activation_policy": "A16Only"})
    return uses
