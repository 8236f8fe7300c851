"""The converter's layout for the full-size Qwen3.6-35B-A3B config equals the official v3 directory.

No weights are read: the plan is a pure function of the config, the recipe and the tensor names.
Every binding (parent shape, format, element range), every Use, object order and the component
configs are compared with `official_directory()` (PLANNER's independent model contract), minus the
parts no Hugging Face checkpoint carries (DFlash companion, proposal head).
"""

from __future__ import annotations

import pytest

from ninfer_offload.artifact.dims import ModelDims
from ninfer_offload.artifact.formats import CONTIGUOUS, ROW_SPLIT, encoded_size
from ninfer_offload.convert.converter import directory_entries
from ninfer_offload.convert.hf_config import read_model_config
from ninfer_offload.convert.layout import plan_layout
from ninfer_offload.convert.recipes import RECIPES, q6_down_layers, role_format
from ninfer_offload.errors import NinferError
from ninfer_offload.artifact.contract import TEXT_CONFIG, VISION_CONFIG, nvfp4_directory, official_directory

FULL_HF_CONFIG = {
    "architectures": ["Qwen3_5MoeForConditionalGeneration"],
    "model_type": "qwen3_5_moe",
    "text_config": {**TEXT_CONFIG, "rms_norm_eps": 1e-6, "rope_parameters": {"rope_type": "default", **TEXT_CONFIG["rope_parameters"]}},
    "vision_config": {**VISION_CONFIG, "model_type": "qwen3_5_moe", "in_channels": 3, "out_hidden_size": 2048},
}


def _describe(directory: dict, skip=("dflash/", "proposal/")) -> tuple[dict, set, list]:
    """binding -> (parent shape, format, range or None), uses, parent order as binding tuples."""
    objects = {o["id"]: o for o in directory["objects"]}
    bindings = {}
    for name, b in directory["bindings"].items():
        if name.startswith(skip):
            continue
        if "object" in b:
            obj = objects[b["object"]]
            bindings[name] = (tuple(obj["shape"]), obj["format"], None)
        else:
            (part,) = b["parts"]
            obj = objects[part["object"]]
            bindings[name] = (tuple(obj["shape"]), obj["format"], tuple(part["range"]))
    uses = {(u["parameter"], u["input"]) for u in directory["uses"] if not u["parameter"].startswith(skip)}
    uses -= {("text/output_head", "dflash/final_hidden")}
    owners: dict[str, list[str]] = {}
    for name, b in directory["bindings"].items():
        if not name.startswith(skip):
            oid = b["object"] if "object" in b else b["parts"][0]["object"]
            owners.setdefault(oid, []).append(name)
    order = [tuple(owners[o["id"]]) for o in directory["objects"] if o["id"] in owners]
    return bindings, uses, order


def _converter_directory(recipe: str) -> dict:
    spec = read_model_config(FULL_HF_CONFIG)
    layout = plan_layout(spec, recipe, lambda name: True, "model.language_model.", mtp=True, vision=True)
    objects, bindings, uses = [], {}, []
    for oid, parent, ranges, parent_uses in directory_entries(layout):
        objects.append({"id": oid, "shape": list(parent.shape), "format": parent.format, "divisors": parent.divisors})
        for name, begin, end in ranges:
            bindings[name] = {"object": oid} if len(ranges) == 1 else {"parts": [{"object": oid, "range": [begin, end]}]}
        uses += [{"parameter": p, "input": i} for p, i in parent_uses]
    return {"objects": objects, "bindings": bindings, "uses": uses, "spec": spec, "layout": layout}


def test_official_recipe_layout_matches_the_official_directory():
    ours = _converter_directory("official")
    official = official_directory()
    our_bindings, our_uses, our_order = _describe(ours)
    ref_bindings, ref_uses, ref_order = _describe(official)
    assert len(our_bindings) == 32713 - 81 - 2  # minus DFlash and proposal bindings
    assert our_bindings == ref_bindings
    assert our_uses == ref_uses
    assert our_order == ref_order
    assert ours["spec"].text_config == official["components"]["text"]["config"]
    assert ours["spec"].text == ModelDims.from_text_config(TEXT_CONFIG) and not ours["spec"].tied
    assert ours["spec"].vision_config == official["components"]["vision"]["config"]


def test_official_parents_have_the_official_formats_and_sizes():
    """Per format: object count and encoded bytes equal the official directory's, less DFlash and proposal."""
    official = official_directory()
    skipped = {b["object"] if "object" in b else b["parts"][0]["object"]
               for n, b in official["bindings"].items() if n.startswith(("dflash/", "proposal/"))}
    want: dict[str, list[int]] = {}
    for obj in official["objects"]:
        if obj["kind"] == "tensor" and obj["id"] not in skipped:
            want.setdefault(obj["format"], [0, 0])
            want[obj["format"]][0] += 1
            want[obj["format"]][1] += obj["bytes"]
    got: dict[str, list[int]] = {}
    for parent in _converter_directory("official")["layout"].parents:
        fmt = parent.format
        got.setdefault(fmt, [0, 0])
        got[fmt][0] += 1
        got[fmt][1] += encoded_size(CONTIGUOUS if fmt in ("bf16", "fp32") else ROW_SPLIT, fmt, parent.shape)
    assert got == want
    assert got["q6_g64_fp16"][0] == 5 and got["q5_g64_fp16"][0] == 91 and got["fp32"][0] == 60


def test_nvfp4_recipe_layout_matches_the_nvfp4_directory():
    ours = _converter_directory("nvfp4")
    reference = nvfp4_directory()
    assert _describe(ours) == _describe(reference)
    divisors = {o["id"]: o.get("divisors", 1) for o in reference["objects"]}
    ref_ids = [o["id"] for o in reference["objects"] if o["kind"] == "tensor"]
    ours_divisors = {o["id"]: o["divisors"] for o in ours["objects"]}
    assert all(ours_divisors[oid] == divisors[oid] for oid in ours_divisors)
    assert set(ours_divisors) <= set(ref_ids)
    assert sorted(set(divisors.values())) == [1, 2, 256, 512]  # shared gate/up, down banks, gate/up banks
    formats = {n: f for n, (_, f, _) in _describe(ours)[0].items()}
    assert formats["text/layers/39/moe/experts/255/down"] == formats["text/layers/0/moe/shared/down"] == "nvfp4"
    assert formats["mtp/layers/0/moe/experts/0/gate"] == formats["mtp/layers/0/moe/shared/gate"] == "q8_g32_fp16"
    assert formats["text/layers/3/attention/key"] == formats["text/layers/0/gdn/z"] == "q8_g32_fp16"


@pytest.mark.parametrize("recipe", ["bf16", "q8"])
def test_other_recipes_keep_the_official_bindings(recipe):
    ours, _, _ = _describe(_converter_directory(recipe))
    ref, _, _ = _describe(official_directory())
    assert ours.keys() == ref.keys()
    for name, (shape, fmt, rng) in ours.items():
        assert (shape, rng) == (ref[name][0], ref[name][2]), name
        if ref[name][1] in ("bf16", "fp32"):
            assert fmt == ref[name][1], name
        else:
            assert fmt == ("bf16" if recipe == "bf16" else "q8_g32_fp16"), name


def test_q6_down_layers_generalise_by_relative_depth():
    assert q6_down_layers(40) == {34, 38, 39}
    assert q6_down_layers(48) == {40, 45, 46}
    assert q6_down_layers(6) == {5}
    for layers in range(1, 100):
        chosen = q6_down_layers(layers)
        assert chosen and all(0.8 * layers - 1 < l < layers for l in chosen)
    assert role_format("official", "routed_down", 38, 40) == "q6_g64_fp16"
    assert role_format("official", "routed_down", 37, 40) == "q5_g64_fp16"
    assert {role_format(r, "control") for r in RECIPES} == {"bf16"}


def test_config_errors_are_one_line():
    with pytest.raises(NinferError, match="unsupported architecture LlamaForCausalLM"):
        read_model_config({"architectures": ["LlamaForCausalLM"], "model_type": "llama"})
    broken = {k: v for k, v in TEXT_CONFIG.items() if k != "num_experts"}
    with pytest.raises(NinferError, match="missing 'num_experts'"):
        read_model_config(broken)
    with pytest.raises(NinferError, match="mrope_section"):
        read_model_config(
            {**TEXT_CONFIG, "rope_parameters": {"rope_theta": 1e7, "partial_rotary_factor": 0.25, "mrope_section": [1, 1, 1]}}
        )
