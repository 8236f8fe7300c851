"""Conversion recipes: the storage format of every role (docs/format.md §8.5).

`official` is the published Qwen3.6-35B-A3B assignment: routed gate/up Q4, routed down Q5 with
Q6 on a set of late layers, Q8 projections, shared experts and embedding, Q6 output head, all MTP
projections (its routed experts included) Q8, vision patch Q6 / attention q,k,v and fc1 Q4 /
attention output and fc2 Q5 / merger Q8. `nvfp4` is the assignment of the published NVFP4 file:
routed and shared experts of the text layers NVFP4, everything else as in `official` (the MTP
layer, its experts included, stays Q8). `q8` stores every one of those matrices as Q8; `bf16`
stores them losslessly. In every recipe the control matrices (router, shared-expert score, GDN
a/b projections), norms, convolution taps, biases and position embeddings are BF16 and the GDN
A_log/dt_bias are FP32 (their binder-required formats).
"""

from __future__ import annotations

from ninfer_offload.errors import NinferError

RECIPES = ("official", "nvfp4", "bf16", "q8")

BF16, FP32 = "bf16", "fp32"
Q4, Q5, Q6, Q8 = "q4_g64_fp16", "q5_g64_fp16", "q6_g64_fp16", "q8_g32_fp16"
NVFP4 = "nvfp4"

# Roles whose format depends on the recipe, with their format in the official recipe.
_OFFICIAL = {
    "token_embedding": Q8,
    "output_head": Q6,
    "projection": Q8,  # attention, GDN, MTP input projection and the MTP shared expert
    "shared_expert": Q8,  # shared expert of the text layers
    "routed_gate_up": Q4,
    "routed_down": Q5,  # Q6 on `q6_down_layers`
    "mtp_routed": Q8,
    "vision_patch": Q6,
    "vision_qkv": Q4,
    "vision_fc1": Q4,
    "vision_output": Q5,
    "vision_fc2": Q5,
    "vision_merger": Q8,
}
# Roles the nvfp4 recipe stores as NVFP4 (the rest as in the official recipe).
_NVFP4_ROLES = frozenset({"routed_gate_up", "routed_down", "shared_expert"})
# Roles with one format in every recipe (norms, taps, biases are BF16 and A_log/dt_bias FP32 by
# binder rule, so the layout writes those directly).
_FIXED = {"control": BF16}

# Layers of the published 40-layer model whose routed down projections are Q6.
_PUBLISHED_Q6_DOWN = (34, 38, 39)
_PUBLISHED_LAYERS = 40


def q6_down_layers(num_layers: int) -> frozenset[int]:
    """Layers whose routed down bank is Q6 in the official recipe, for a model of any depth.

    The published set {34, 38, 39} of 40 layers is kept at the same relative depths:
    layer floor(l * L / 40) for l in {34, 38, 39}. L = 40 gives exactly {34, 38, 39}; L = 48 gives
    {40, 45, 46}; shallow models collapse the set onto fewer, always late, layers (L = 6: {5}).
    """
    return frozenset(l * num_layers // _PUBLISHED_LAYERS for l in _PUBLISHED_Q6_DOWN)


def check_recipe(recipe: str) -> str:
    if recipe not in RECIPES:
        raise NinferError(f"unknown recipe {recipe!r}: choose one of {', '.join(RECIPES)}")
    return recipe


def role_format(recipe: str, role: str, layer: int | None = None, num_layers: int | None = None) -> str:
    """The storage format of `role` under `recipe` (`layer`/`num_layers` matter for routed_down only)."""
    if role in _FIXED:
        return _FIXED[role]
    if role not in _OFFICIAL:
        raise KeyError(role)
    if recipe == "bf16":
        return BF16
    if recipe == "q8":
        return Q8
    if recipe == "nvfp4" and role in _NVFP4_ROLES:
        return NVFP4
    if role == "routed_down" and layer is not None and layer in q6_down_layers(num_layers):
        return Q6
    return _OFFICIAL[role]
