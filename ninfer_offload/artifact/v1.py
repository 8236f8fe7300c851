"""Container v1: closed `{model_id, objects}` directory, and logical bindings synthesised from its names.

v1 objects carry semantic names (e.g. `text/layers/3/moe/routed_gate_up`). Every object is bound
under its own name, and the 35B fused parents are also bound under the v3 logical names with the
element ranges of docs/format.md §8.5, so code written against v3 binding names reads v1 files too.
"""

from __future__ import annotations

import re

from ninfer_offload.artifact.errors import ArtifactError
from ninfer_offload.artifact.formats import V1_FORMAT_NAMES, V1_LAYOUT_NAMES
from ninfer_offload.artifact.schema import (
    Binding,
    Component,
    Directory,
    FileRecord,
    ObjectInfo,
    Part,
    check_object_ranges,
    check_tensor_placement,
    identifier,
    members,
    shape_of,
    u64,
)
from ninfer_offload.artifact import contract

VISION_RESOURCES = ("preprocessor_config.json", "video_preprocessor_config.json")
OFFICIAL_MODEL_ID = "qwen3.6-35b-a3b"

# 35B fused parents whose split cannot be derived from the shape alone: (shape, [(suffix, row0, row1)]).
_ATTENTION_QKGV = ((9216, 2048), [("query", 0, 4096), ("key", 4096, 4608), ("gate", 4608, 8704), ("value", 8704, 9216)])
_GDN_QKVZ = ((12288, 2048), [("query", 0, 2048), ("key", 2048, 4096), ("value", 4096, 8192), ("z", 8192, 12288)])
_DFLASH_QKV = (
    (6144, 2048),
    [("query", 0, 4096), ("key", 4096, 5120), ("context_key", 4096, 5120), ("value", 5120, 6144), ("context_value", 5120, 6144)],
)


def _object(value, index: int) -> ObjectInfo:
    where = f"objects[{index}]"
    if isinstance(value, dict) and isinstance(value.get("name"), str):
        where = f"object {value['name']!r}"
    kind = value.get("kind") if isinstance(value, dict) else None
    if kind == "tensor":
        rec = members(value, where, {"name", "kind", "shape", "format", "layout", "offset", "bytes"})
        fmt, layout = identifier(rec["format"], f"{where} format"), identifier(rec["layout"], f"{where} layout")
        obj = ObjectInfo(
            id=identifier(rec["name"], f"{where} name"),
            kind="tensor",
            shape=shape_of(rec["shape"], f"{where} shape"),
            format=V1_FORMAT_NAMES.get(fmt, fmt),
            layout=V1_LAYOUT_NAMES.get(layout, layout),
            offset=u64(rec["offset"], f"{where} offset"),
            bytes=u64(rec["bytes"], f"{where} bytes", positive=True),
        )
        check_tensor_placement(obj)
        return obj
    if kind == "resource":
        rec = members(value, where, {"name", "kind", "encoding", "offset", "bytes"})
        encoding = identifier(rec["encoding"], f"{where} encoding")
        return ObjectInfo(
            id=identifier(rec["name"], f"{where} name"),
            kind="resource",
            encoding=V1_LAYOUT_NAMES.get(encoding, encoding),
            offset=u64(rec["offset"], f"{where} offset"),
            bytes=u64(rec["bytes"], f"{where} bytes", positive=True),
        )
    members(value, where, {"kind"}, {"name", "shape", "format", "layout", "encoding", "offset", "bytes"})
    raise ArtifactError(f"{where}: kind must be \"tensor\" or \"resource\", got {value['kind']!r}")


def parse_v1_directory(root, payload_bytes: int) -> tuple[str, Directory]:
    """Validate a v1 root and return (model_id, Directory with synthesised components and bindings)."""
    rec = members(root, "directory root", {"model_id", "objects"})
    model_id = identifier(rec["model_id"], "model_id")
    if not isinstance(rec["objects"], list) or not rec["objects"]:
        raise ArtifactError("objects: must be a non-empty array")
    objects = [_object(v, i) for i, v in enumerate(rec["objects"])]
    check_object_ranges(objects, payload_bytes)
    directory = Directory(
        components=_components(model_id, objects),
        objects=objects,
        bindings=synthesize_bindings({o.id: o for o in objects if o.kind == "tensor"}),
        uses=[],
        files=[FileRecord(None, payload_bytes)],
        metadata={"name": model_id},
        provenance={},
    )
    return model_id, directory


def _components(model_id: str, objects: list[ObjectInfo]) -> dict[str, Component]:
    """v1 keeps configs in the binder, keyed by model_id: the 35B gets the official configs of docs/format.md §8.2.

    Other model ids get empty configs. Resources `frontend/<file>` become roles of text (or vision).
    """
    official = model_id == OFFICIAL_MODEL_ID
    configs = {
        "text": contract.TEXT_CONFIG,
        "vision": contract.VISION_CONFIG,
        "mtp": contract.MTP_CONFIG,
        "dflash": contract.DFLASH_CONFIG,
    }
    resources: dict[str, dict[str, str]] = {"text": {}, "vision": {}}
    for obj in objects:
        if obj.kind == "resource":
            role = obj.id.rsplit("/", 1)[-1]
            resources["vision" if role in VISION_RESOURCES else "text"][role] = obj.id
    present = {o.id.split("/", 1)[0] for o in objects if o.kind == "tensor"}
    names = {o.id: o for o in objects}
    proposal = None
    if "text/draft_head" in names:
        proposal = {"domain": "indexed", "rows": names["text/draft_head"].shape[0]}
    components = {"text": Component(config=dict(configs["text"]) if official else {}, resources=resources["text"], proposal=proposal)}
    for cid in ("vision", "mtp", "dflash"):
        if cid in present or resources.get(cid):
            config = dict(configs[cid]) if official else {}
            components[cid] = Component(config=config, target="text", resources=resources.get(cid, {}))
    return components


def _rows(obj: ObjectInfo, r0: int, r1: int) -> Binding:
    k = obj.shape[1]
    return Binding([Part(obj.id, r0 * k, r1 * k)], whole=False)


def _elements(obj: ObjectInfo, b: int, e: int) -> Binding:
    return Binding([Part(obj.id, b, e)], whole=False)


def _whole(obj: ObjectInfo) -> Binding:
    return Binding([Part(obj.id, 0, obj.elements)], whole=True)


_LAYER = re.compile(r"^(text/layers/\d+|mtp/layer)/(.+)$")
_VISION = re.compile(r"^vision/layers/(\d+)/(.+)$")
_DFLASH = re.compile(r"^dflash/layers/(\d+)/attention/query_key_value$")
_RENAMED = {"text/draft_head": "proposal/head", "text/draft_head_token_ids": "proposal/token_ids"}


def synthesize_bindings(tensors: dict[str, ObjectInfo]) -> dict[str, Binding]:
    """Bindings for v1 objects: the v3 logical names first, then every object under its own name.

    Logical names come first so that consumers labelling an object by its first binding (the
    inventory) see the logical role, not the v1 parent name.
    """
    bindings: dict[str, Binding] = {}
    for name, obj in tensors.items():
        for logical, binding in _logical(name, obj, tensors).items():
            bindings.setdefault(logical, binding)
    for name, obj in tensors.items():
        bindings.setdefault(name, _whole(obj))
    return bindings


def _fixed_split(prefix: str, obj: ObjectInfo, table) -> dict[str, Binding]:
    shape, rows = table
    if obj.shape != shape:
        return {}
    return {f"{prefix}/{suffix}": _rows(obj, r0, r1) for suffix, r0, r1 in rows}


def _halves(obj: ObjectInfo, first: str, second: str) -> dict[str, Binding]:
    if len(obj.shape) != 2 or obj.shape[0] % 2:
        return {}
    half = obj.shape[0] // 2
    return {first: _rows(obj, 0, half), second: _rows(obj, half, 2 * half)}


def _logical(name: str, obj: ObjectInfo, tensors: dict[str, ObjectInfo]) -> dict[str, Binding]:
    if name in _RENAMED:
        return {_RENAMED[name]: _whole(obj)}
    match = _LAYER.match(name)
    if match:
        layer = "mtp/layers/0" if match.group(1) == "mtp/layer" else match.group(1)
        return _layer_object(match.group(1), layer, match.group(2), obj, tensors)
    match = _VISION.match(name)
    if match:
        return _vision_object(f"vision/layers/{match.group(1)}", match.group(2), obj)
    if name in ("vision/merger/norm/weight", "vision/merger/norm/bias"):
        return {f"vision/merger/norm_{name.rsplit('/', 1)[1]}": _whole(obj)}
    if _DFLASH.match(name):
        return _fixed_split(name.rsplit("/", 1)[0], obj, _DFLASH_QKV)
    return {}


def _layer_object(v1_prefix: str, layer: str, suffix: str, obj: ObjectInfo, tensors: dict[str, ObjectInfo]) -> dict[str, Binding]:
    if suffix == "attention/query_key_gate_value":
        return _fixed_split(f"{layer}/attention", obj, _ATTENTION_QKGV)
    if suffix == "gdn/query_key_value_z":
        return _fixed_split(f"{layer}/gdn", obj, _GDN_QKVZ)
    if suffix == "gdn/a_b_projection":
        return _halves(obj, f"{layer}/gdn/a_projection", f"{layer}/gdn/b_projection")
    if suffix == "moe/shared_gate_up":
        return _halves(obj, f"{layer}/moe/shared/gate", f"{layer}/moe/shared/up")
    if suffix == "moe/shared_down":
        return {f"{layer}/moe/shared/down": _whole(obj)}
    if suffix == "moe/router_shared_gate" and len(obj.shape) == 2:
        experts = obj.shape[0] - 1
        return {f"{layer}/moe/router": _rows(obj, 0, experts), f"{layer}/moe/shared_score": _rows(obj, experts, experts + 1)}
    if suffix == "moe/routed_gate_up":
        return _experts(layer, obj, tensors.get(f"{v1_prefix}/moe/routed_down"))
    if suffix == "moe/routed_down":
        return {}  # bound together with its gate/up bank
    return {f"{layer}/{suffix}": _whole(obj)} if layer != v1_prefix else {}


def _experts(layer: str, gate_up: ObjectInfo, down: ObjectInfo | None) -> dict[str, Binding]:
    """Per-expert gate/up/down bindings: expert e owns gate/up rows [2Ie, 2I(e+1)) and down rows [He, H(e+1))."""
    if down is None or len(gate_up.shape) != 2 or len(down.shape) != 2:
        return {}
    hidden, intermediate = gate_up.shape[1], down.shape[1]
    experts = down.shape[0] // hidden
    if experts * hidden != down.shape[0] or gate_up.shape[0] != experts * 2 * intermediate:
        return {}
    out = {}
    for e in range(experts):
        g0 = 2 * intermediate * e
        out[f"{layer}/moe/experts/{e}/gate"] = _rows(gate_up, g0, g0 + intermediate)
        out[f"{layer}/moe/experts/{e}/up"] = _rows(gate_up, g0 + intermediate, g0 + 2 * intermediate)
        out[f"{layer}/moe/experts/{e}/down"] = _rows(down, hidden * e, hidden * (e + 1))
    return out


def _vision_object(block: str, suffix: str, obj: ObjectInfo) -> dict[str, Binding]:
    if suffix == "attention/qkv" and len(obj.shape) == 2 and obj.shape[0] % 3 == 0:
        d = obj.shape[0] // 3
        return {f"{block}/attention/{p}": _rows(obj, i * d, (i + 1) * d) for i, p in enumerate(("query", "key", "value"))}
    if suffix == "attention/qkv_bias" and len(obj.shape) == 1 and obj.shape[0] % 3 == 0:
        d = obj.shape[0] // 3
        return {f"{block}/attention/{p}_bias": _elements(obj, i * d, (i + 1) * d) for i, p in enumerate(("query", "key", "value"))}
    if suffix in ("norm1/weight", "norm1/bias", "norm2/weight", "norm2/bias"):
        return {f"{block}/{suffix.replace('/', '_')}": _whole(obj)}
    return {}
