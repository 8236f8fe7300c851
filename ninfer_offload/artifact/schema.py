"""The v3 JSON directory: closed schema, typed records and every structural rule of docs/format.md §4.8.

`parse_directory(root, entry_name)` turns the decoded JSON root into a `Directory` or raises an
`ArtifactError` naming the member at fault and the rule it breaks. All integer arithmetic is exact
(Python ints) and checked against the unsigned 64-bit range.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from ninfer_offload.artifact.errors import ArtifactError
from ninfer_offload.artifact.formats import (
    BLOCK_SCALE,
    LAYOUT_FORMATS,
    NVFP4,
    RAW_BYTES,
    TENSOR_ALIGNMENT,
    U64_MAX,
    elements,
    encoded_size,
)
from ninfer_offload.artifact.framing import checked_sum

ACTIVATION_POLICIES = ("A16Only", "AllowA8", "AllowA4")
MAX_RANK = 16


@dataclass(frozen=True)
class Component:
    config: dict
    target: str | None = None
    resources: dict[str, str] = field(default_factory=dict)
    proposal: dict | None = None


@dataclass(frozen=True)
class ObjectInfo:
    """One physical object. Tensors have shape/format/layout; resources have encoding."""

    id: str
    kind: str
    offset: int
    bytes: int
    shape: tuple[int, ...] = ()
    format: str | None = None
    layout: str | None = None
    encoding: str | None = None
    divisors: int = 1

    @property
    def end(self) -> int:
        return self.offset + self.bytes

    @property
    def elements(self) -> int:
        return elements(self.shape)


@dataclass(frozen=True)
class Part:
    """Flat C-order element range [begin, end) of one tensor object."""

    object: str
    begin: int
    end: int


@dataclass(frozen=True)
class Binding:
    parts: list[Part]
    whole: bool

    @property
    def elements(self) -> int:
        return sum(p.end - p.begin for p in self.parts)


@dataclass(frozen=True)
class Use:
    parameter: str
    input: str
    activation_policy: str | None = None
    auxiliaries: dict[str, Binding] = field(default_factory=dict)


@dataclass(frozen=True)
class FileRecord:
    path: str | None
    payload_bytes: int


@dataclass(frozen=True)
class Directory:
    components: dict[str, Component]
    objects: list[ObjectInfo]
    bindings: dict[str, Binding]
    uses: list[Use]
    files: list[FileRecord]
    metadata: dict
    provenance: dict

    @property
    def payload_bytes(self) -> int:
        return sum(f.payload_bytes for f in self.files)


# ----------------------------------------------------------------------------- primitive checks


def members(value, where: str, required: set[str], optional: set[str] = frozenset()) -> dict:
    """A JSON object with all `required` members, optionally some of `optional`, and nothing else."""
    if not isinstance(value, dict):
        raise ArtifactError(f"{where}: must be a JSON object, got {_json_type(value)}")
    keys = value.keys()
    if not required <= keys:
        raise ArtifactError(f"{where}: missing member {min(required - keys)!r}")
    if not keys <= required | optional:
        raise ArtifactError(f"{where}: unknown member {min(keys - required - optional)!r} (closed member set)")
    return value


def _json_type(value) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "a boolean"
    if isinstance(value, int):
        return "an integer"
    if isinstance(value, float):
        return "a float"
    if isinstance(value, str):
        return "a string"
    if isinstance(value, list):
        return "an array"
    return "an object"


def u64(value, where: str, positive: bool = False) -> int:
    """A JSON integer in [0, 2^64) (or (0, 2^64) when positive); booleans and floats are rejected."""
    if type(value) is not int:
        raise ArtifactError(f"{where}: must be an integer, got {_json_type(value)}")
    if value < 0 or value > U64_MAX:
        raise ArtifactError(f"{where}: {value} is outside the unsigned 64-bit range")
    if positive and value == 0:
        raise ArtifactError(f"{where}: must be positive")
    return value


def identifier(value, where: str) -> str:
    """A non-empty string without U+0000."""
    if not isinstance(value, str):
        raise ArtifactError(f"{where}: must be a string, got {_json_type(value)}")
    if not value or "\x00" in value:
        raise ArtifactError(f"{where}: must be a non-empty string without U+0000")
    return value


def _json_object(value, where: str) -> dict:
    if not isinstance(value, dict):
        raise ArtifactError(f"{where}: must be a JSON object, got {_json_type(value)}")
    return value


def shape_of(value, where: str) -> tuple[int, ...]:
    """A Shape: array of at most 16 positive integers whose product fits in U64."""
    if not isinstance(value, list):
        raise ArtifactError(f"{where}: must be an array, got {_json_type(value)}")
    if len(value) > MAX_RANK:
        raise ArtifactError(f"{where}: rank {len(value)} exceeds {MAX_RANK}")
    dims = tuple(u64(d, f"{where}[{i}]", positive=True) for i, d in enumerate(value))
    if elements(dims) > U64_MAX:
        raise ArtifactError(f"{where}: element count overflows 64 bits")
    return dims


# ----------------------------------------------------------------------------- records


def _object(value, index: int) -> ObjectInfo:
    where = f"objects[{index}]"
    if isinstance(value, dict) and isinstance(value.get("id"), str):
        where = f"object {value['id']!r}"
    kind = value.get("kind") if isinstance(value, dict) else None
    if kind == "tensor":
        rec = members(value, where, {"id", "kind", "shape", "format", "layout", "offset", "bytes"}, {"divisors"})
        obj = ObjectInfo(
            id=identifier(rec["id"], f"{where} id"),
            kind="tensor",
            shape=shape_of(rec["shape"], f"{where} shape"),
            format=identifier(rec["format"], f"{where} format"),
            layout=identifier(rec["layout"], f"{where} layout"),
            offset=u64(rec["offset"], f"{where} offset"),
            bytes=u64(rec["bytes"], f"{where} bytes", positive=True),
            divisors=u64(rec.get("divisors", 1), f"{where} divisors", positive=True),
        )
        if obj.divisors != 1 and (obj.format != NVFP4 or obj.layout != BLOCK_SCALE):
            raise ArtifactError(f"{where}: divisors > 1 is only allowed for nvfp4 block-scale objects")
        check_tensor_placement(obj)
        return obj
    if kind == "resource":
        rec = members(value, where, {"id", "kind", "encoding", "offset", "bytes"})
        return ObjectInfo(
            id=identifier(rec["id"], f"{where} id"),
            kind="resource",
            encoding=identifier(rec["encoding"], f"{where} encoding"),
            offset=u64(rec["offset"], f"{where} offset"),
            bytes=u64(rec["bytes"], f"{where} bytes", positive=True),
        )
    if not isinstance(value, dict):
        raise ArtifactError(f"{where}: must be a JSON object, got {_json_type(value)}")
    if "kind" not in value:
        raise ArtifactError(f"{where}: missing member 'kind'")
    raise ArtifactError(f"{where}: kind must be \"tensor\" or \"resource\", got {value['kind']!r}")


def check_tensor_placement(obj: ObjectInfo) -> None:
    """Offset aligned to 256; `bytes` equal to the encoded size when the format/layout pair is registered.

    Unregistered pairs are accepted here and fail only when the object is decoded (§4.3).
    """
    if obj.offset % TENSOR_ALIGNMENT:
        raise ArtifactError(f"object {obj.id!r}: offset {obj.offset} is not a multiple of the tensor alignment {TENSOR_ALIGNMENT}")
    if obj.layout in LAYOUT_FORMATS and obj.format in LAYOUT_FORMATS[obj.layout]:
        check_encoded_size(obj)


def check_encoded_size(obj: ObjectInfo) -> None:
    """`bytes` must equal the layout's encoded size for (format, shape); unknown pairs fail here."""
    try:
        expected = encoded_size(obj.layout, obj.format, obj.shape, obj.divisors)
    except ArtifactError as err:
        raise ArtifactError(f"object {obj.id!r}: {err}") from None
    if obj.bytes != expected:
        raise ArtifactError(
            f"object {obj.id!r}: bytes {obj.bytes} != encoded size {expected} of {obj.format}/{obj.layout} {list(obj.shape)}"
        )


def check_object_ranges(objects: list[ObjectInfo], payload_bytes: int) -> None:
    """Unique IDs; offsets ordered and non-overlapping; every object inside the payload."""
    seen: set[str] = set()
    cursor = 0
    previous = None
    for obj in objects:
        if obj.id in seen:
            raise ArtifactError(f"object {obj.id!r}: duplicate object id")
        seen.add(obj.id)
        if obj.offset < cursor:
            raise ArtifactError(
                f"object {obj.id!r}: offset {obj.offset} overlaps or precedes object {previous!r} ending at {cursor} "
                "(objects must be ordered and non-overlapping)"
            )
        end = obj.offset + obj.bytes
        if end > payload_bytes:
            raise ArtifactError(f"object {obj.id!r}: ends at {end}, past the payload of {payload_bytes} bytes")
        cursor, previous = end, obj.id


def _binding(value, where: str, objects: dict[str, ObjectInfo]) -> Binding:
    if isinstance(value, dict) and "object" in value and "parts" in value:
        raise ArtifactError(f"{where}: has both 'object' and 'parts' (exactly one form allowed)")
    if isinstance(value, dict) and "object" in value:
        rec = members(value, where, {"object"})
        obj = _tensor_ref(rec["object"], where, objects)
        return Binding([Part(obj.id, 0, obj.elements)], whole=True)
    rec = members(value, where, {"parts"})
    if not isinstance(rec["parts"], list) or not rec["parts"]:
        raise ArtifactError(f"{where}: parts must be a non-empty array")
    parts = []
    for i, raw in enumerate(rec["parts"]):
        pwhere = f"{where} part {i}"
        prec = members(raw, pwhere, {"object", "range"})
        obj = _tensor_ref(prec["object"], pwhere, objects)
        rng = prec["range"]
        if not isinstance(rng, list) or len(rng) != 2:
            raise ArtifactError(f"{pwhere}: range must be an array [begin, end]")
        begin, end = u64(rng[0], f"{pwhere} range begin"), u64(rng[1], f"{pwhere} range end")
        if not begin < end <= obj.elements:
            raise ArtifactError(
                f"{pwhere}: range [{begin}, {end}) is outside object {obj.id!r} of {obj.elements} elements "
                "(need 0 <= begin < end <= elements)"
            )
        parts.append(Part(obj.id, begin, end))
    checked_sum((p.end - p.begin for p in parts), f"{where} element count")
    return Binding(parts, whole=False)


def _tensor_ref(value, where: str, objects: dict[str, ObjectInfo]) -> ObjectInfo:
    oid = identifier(value, f"{where} object")
    obj = objects.get(oid)
    if obj is None:
        raise ArtifactError(f"{where}: references unknown object {oid!r}")
    if obj.kind != "tensor":
        raise ArtifactError(f"{where}: references resource object {oid!r} (bindings must reference tensors)")
    return obj


def _component(cid: str, value, objects: dict[str, ObjectInfo]) -> Component:
    where = f"component {cid!r}"
    rec = members(value, where, {"config"}, {"target", "resources", "proposal"})
    config = _json_object(rec["config"], f"{where} config")
    target = identifier(rec["target"], f"{where} target") if "target" in rec else None
    resources = {}
    for role, oid in _json_object(rec.get("resources", {}), f"{where} resources").items():
        identifier(role, f"{where} resource role")
        obj = objects.get(identifier(oid, f"{where} resource {role!r}"))
        if obj is None or obj.kind != "resource":
            raise ArtifactError(f"{where}: resource {role!r} must reference a resource object, got {oid!r}")
        resources[role] = oid
    proposal = None
    if "proposal" in rec:
        if cid != "text":
            raise ArtifactError(f"{where}: only the text component may carry a proposal")
        proposal = _proposal(rec["proposal"], f"{where} proposal")
    return Component(config=config, target=target, resources=resources, proposal=proposal)


def _proposal(value, where: str) -> dict:
    domain = value.get("domain") if isinstance(value, dict) else None
    if domain == "full":
        members(value, where, {"domain"})
        return {"domain": "full"}
    if domain == "indexed":
        rec = members(value, where, {"domain", "rows"})
        return {"domain": "indexed", "rows": u64(rec["rows"], f"{where} rows", positive=True)}
    members(value, where, {"domain"}, {"rows"})
    raise ArtifactError(f"{where}: domain must be \"full\" or \"indexed\", got {domain!r}")


def _files(value, entry_name: str | None) -> list[FileRecord]:
    if not isinstance(value, list) or not value:
        raise ArtifactError("files: must be a non-empty array")
    files = []
    names: set[str] = set()
    for i, raw in enumerate(value):
        where = f"files[{i}]"
        rec = members(raw, where, {"path", "payload_bytes"})
        size = u64(rec["payload_bytes"], f"{where} payload_bytes", positive=True)
        path = rec["path"]
        if i == 0:
            if path is not None:
                raise ArtifactError(f"{where}: path of the entry file must be null")
        else:
            path = identifier(path, f"{where} path")
            if "/" in path or "\\" in path or path in (".", ".."):
                raise ArtifactError(f"{where}: path {path!r} is not a plain sibling file name")
            if path in names or path == entry_name:
                raise ArtifactError(f"{where}: path {path!r} is used twice or names the entry file")
            names.add(path)
        files.append(FileRecord(path, size))
    checked_sum((f.payload_bytes for f in files), "files payload_bytes total")
    return files


def _use(value, index: int, bindings: dict[str, Binding], objects: dict[str, ObjectInfo]) -> Use:
    where = f"uses[{index}]"
    rec = members(value, where, {"parameter", "input"}, {"activation_policy", "auxiliaries"})
    parameter = identifier(rec["parameter"], f"{where} parameter")
    if parameter not in bindings:
        raise ArtifactError(f"{where}: parameter {parameter!r} is not a binding")
    inp = identifier(rec["input"], f"{where} input")
    where = f"use ({parameter!r}, {inp!r})"
    policy = rec.get("activation_policy")
    if policy is not None and policy not in ACTIVATION_POLICIES:
        raise ArtifactError(f"{where}: activation_policy {policy!r} is not one of {', '.join(ACTIVATION_POLICIES)}")
    if "activation_policy" in rec and policy is None:
        raise ArtifactError(f"{where}: activation_policy must be a string, got null")
    aux = {
        identifier(role, f"{where} auxiliary role"): _binding(b, f"{where} auxiliary {role!r}", objects)
        for role, b in _json_object(rec.get("auxiliaries", {}), f"{where} auxiliaries").items()
    }
    return Use(parameter, inp, policy, aux)


def parse_directory(root, entry_name: str | None = None) -> Directory:
    """Validate a decoded v3 JSON root (rules 2-7 of §4.8) and return its typed records."""
    rec = members(root, "directory root", {"components", "objects", "bindings", "uses", "files"}, {"metadata", "provenance"})
    files = _files(rec["files"], entry_name)
    payload_bytes = sum(f.payload_bytes for f in files)
    if not isinstance(rec["objects"], list) or not rec["objects"]:
        raise ArtifactError("objects: must be a non-empty array")
    objects = [_object(v, i) for i, v in enumerate(rec["objects"])]
    check_object_ranges(objects, payload_bytes)
    by_id = {o.id: o for o in objects}
    raw_components = _json_object(rec["components"], "components")
    components = {identifier(cid, "component id"): _component(cid, v, by_id) for cid, v in raw_components.items()}
    if "text" not in components:
        raise ArtifactError("components: the 'text' component is required")
    for cid, comp in components.items():
        if comp.target is not None and comp.target not in components:
            raise ArtifactError(f"component {cid!r}: target {comp.target!r} is not a component")
    bindings = {
        identifier(name, "binding name"): _binding(v, f"binding {name!r}", by_id)
        for name, v in _json_object(rec["bindings"], "bindings").items()
    }
    if not isinstance(rec["uses"], list):
        raise ArtifactError(f"uses: must be an array, got {_json_type(rec['uses'])}")
    uses = [_use(v, i, bindings, by_id) for i, v in enumerate(rec["uses"])]
    seen: set[tuple[str, str]] = set()
    for u in uses:
        if (u.parameter, u.input) in seen:
            raise ArtifactError(f"use ({u.parameter!r}, {u.input!r}): duplicate (parameter, input) pair")
        seen.add((u.parameter, u.input))
    metadata = _json_object(rec.get("metadata", {}), "metadata")
    if "name" in metadata:
        identifier(metadata["name"], "metadata name")
    provenance = _json_object(rec.get("provenance", {}), "provenance")
    return Directory(components, objects, bindings, uses, files, metadata, provenance)


def resource_encoding_check(obj: ObjectInfo) -> None:
    """Resources are readable only in the registered raw-bytes encoding."""
    if obj.encoding != RAW_BYTES:
        raise ArtifactError(f"object {obj.id!r}: unknown resource encoding {obj.encoding!r}")
