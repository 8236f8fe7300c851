"""Write v3 `.ninfer` artifacts (docs/format.md §4.9): one entry file, optionally continuation parts.

Payload is streamed object by object (each tensor's bytes come from a callable, called once, in
object order), so memory stays bounded by the largest object. Files are written under temporary
names and renamed only when everything succeeded; on any error nothing half-written remains.
"""

from __future__ import annotations

import os
import uuid
from collections.abc import Callable, Mapping, Sequence
from contextlib import ExitStack
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from ninfer_offload.artifact.errors import ArtifactError
from ninfer_offload.artifact.formats import RAW_BYTES, TENSOR_ALIGNMENT, align_up, encoded_size
from ninfer_offload.artifact.framing import (
    ENTRY_HEADER_V3,
    PART_PAYLOAD_START,
    decode_json,
    encode_json,
    pack_entry_header,
    pack_part_header,
    part_file_name,
    reserved_json_bytes,
    split_payload,
)
from ninfer_offload.artifact.schema import parse_directory

Source = Callable[[], np.ndarray]


@dataclass
class _PendingObject:
    record: dict  # JSON record without offset
    size: int
    source: Source | bytes | None  # callable (tensor), bytes (resource) or None (hole)
    offset: int = 0


class ArtifactWriter:
    """Collects components, objects, bindings and uses, then writes the file set with `write()`."""

    def __init__(self, path, max_file_bytes: int | None = None, metadata: dict | None = None, provenance: dict | None = None):
        self.path = Path(path)
        if max_file_bytes is not None and (type(max_file_bytes) is not int or max_file_bytes <= 0):
            raise ArtifactError(f"max_file_bytes must be a positive integer, got {max_file_bytes!r}")
        self.max_file_bytes = max_file_bytes
        self.metadata = dict(metadata or {})
        self.provenance = dict(provenance or {})
        self._components: dict[str, dict] = {}
        self._resource_roles: list[tuple[str, str, str]] = []  # (component, role, object id)
        self._objects: list[_PendingObject] = []
        self._ids: set[str] = set()
        self._bindings: dict[str, dict] = {}
        self._uses: list[dict] = []

    # ------------------------------------------------------------------ building

    def add_component(self, component_id: str, config: dict, target: str | None = None, proposal: dict | None = None) -> None:
        if component_id in self._components:
            raise ArtifactError(f"component {component_id!r} added twice")
        record: dict = {"config": config}
        if target is not None:
            record["target"] = target
        if proposal is not None:
            record["proposal"] = proposal
        self._components[component_id] = record

    def add_resource(self, object_id: str, data: bytes, component: str = "text", role: str = "tokenizer.json") -> None:
        data = bytes(data)
        self._new_id(object_id)
        record = {"id": object_id, "encoding": RAW_BYTES, "bytes": len(data), "kind": "resource"}
        self._objects.append(_PendingObject(record, len(data), data))
        self._resource_roles.append((component, role, object_id))

    def add_tensor(
        self, object_id: str, shape: Sequence[int], format: str, layout: str, source: Source | None, divisors: int = 1
    ) -> None:
        """A tensor object; `divisors` > 1 (nvfp4 only) is written as the optional `divisors` member (§4.3)."""
        shape = [int(d) for d in shape]
        self._new_id(object_id)
        try:
            size = encoded_size(layout, format, shape, divisors)
        except ArtifactError as err:
            raise ArtifactError(f"object {object_id!r}: {err}") from None
        record = {"id": object_id, "shape": shape, "format": format, "layout": layout, "bytes": size, "kind": "tensor"}
        if divisors != 1:
            record["divisors"] = divisors
        self._objects.append(_PendingObject(record, size, source))

    def bind(self, name: str, object_id: str) -> None:
        self._new_binding(name)
        self._bindings[name] = {"object": object_id}

    def bind_parts(self, name: str, parts: Sequence[tuple[str, int, int]]) -> None:
        self._new_binding(name)
        self._bindings[name] = {"parts": [{"object": o, "range": [int(b), int(e)]} for o, b, e in parts]}

    def use(self, parameter: str, input: str, activation_policy: str = "A16Only") -> None:
        self._uses.append({"parameter": parameter, "input": input, "activation_policy": activation_policy})

    def _new_id(self, object_id: str) -> None:
        if object_id in self._ids:
            raise ArtifactError(f"object {object_id!r} added twice")
        self._ids.add(object_id)

    def _new_binding(self, name: str) -> None:
        if name in self._bindings:
            raise ArtifactError(f"binding {name!r} added twice")

    # ------------------------------------------------------------------ layout

    def _root(self, files: list[dict]) -> dict:
        components = {cid: dict(rec) for cid, rec in self._components.items()}
        for cid, role, oid in self._resource_roles:
            if cid not in components:
                raise ArtifactError(f"resource {oid!r}: component {cid!r} was never added")
            resources = components[cid].setdefault("resources", {})
            if role in resources:
                raise ArtifactError(f"component {cid!r}: resource role {role!r} given twice")
            resources[role] = oid
        objects = []
        for obj in self._objects:
            record = dict(obj.record)
            record["offset"] = obj.offset
            objects.append(_ordered(record))
        root = {"components": components, "objects": objects, "bindings": self._bindings, "uses": self._uses, "files": files}
        if self.metadata:
            root["metadata"] = self.metadata
        if self.provenance:
            root["provenance"] = self.provenance
        return root

    def _assign_offsets(self) -> int:
        cursor = 0
        for obj in self._objects:
            obj.offset = align_up(cursor, TENSOR_ALIGNMENT) if obj.record["kind"] == "tensor" else cursor
            cursor = obj.offset + obj.size
        return cursor

    def _plan(self, payload_bytes: int) -> tuple[bytes, list[int]]:
        """Directory text (space padded to json_bytes) and per-file payload sizes (§4.9 steps 2-3)."""
        sizes = [payload_bytes]
        reserved = reserved_json_bytes(len(encode_json(self._root(self._files_table(sizes)))))
        while True:
            sizes = split_payload(ENTRY_HEADER_V3 + reserved, payload_bytes, self.max_file_bytes)
            text = encode_json(self._root(self._files_table(sizes)))
            if len(text) <= reserved:
                return text + b" " * (reserved - len(text)), sizes
            reserved = reserved_json_bytes(len(text))

    def _files_table(self, sizes: list[int]) -> list[dict]:
        return [{"path": None if i == 0 else part_file_name(self.path.name, i), "payload_bytes": s} for i, s in enumerate(sizes)]

    # ------------------------------------------------------------------ writing

    def write(self) -> Path:
        """Validate, write parts then entry under temporary names, rename; returns the entry path."""
        if not self._objects:
            raise ArtifactError("an artifact needs at least one object")
        payload_bytes = self._assign_offsets()
        text, sizes = self._plan(payload_bytes)
        parse_directory(decode_json(text), self.path.name)
        artifact_id = uuid.uuid4().bytes
        names = [self.path.name] + [part_file_name(self.path.name, i) for i in range(1, len(sizes))]
        token = uuid.uuid4().hex[:8]
        temps = [self.path.with_name(f".{name}.{token}.tmp") for name in names]
        try:
            with ExitStack() as stack:
                handles = [stack.enter_context(open(t, "wb")) for t in temps]
                handles[0].write(pack_entry_header(len(text), artifact_id) + text)
                for i, h in enumerate(handles[1:], start=1):
                    h.write(pack_part_header(i, artifact_id))
                starts = [ENTRY_HEADER_V3 + len(text)] + [PART_PAYLOAD_START] * (len(sizes) - 1)
                sink = _PayloadSink(handles, starts, sizes)
                for obj in self._objects:
                    data = _object_bytes(obj)
                    if data is not None:
                        sink.write(obj.offset, data)
                    del data  # only one encoded object alive while the next source runs
                for h, start, size in zip(handles, starts, sizes):
                    h.truncate(start + size)  # also extends over trailing holes (sparse)
            for temp, name in list(zip(temps, names))[1:] + [(temps[0], names[0])]:
                os.replace(temp, self.path.with_name(name))
        except BaseException as err:
            for t in temps:
                t.unlink(missing_ok=True)
            if isinstance(err, OSError):
                raise ArtifactError(f"cannot write {str(self.path)!r}: {err.strerror or err}") from None
            raise
        return self.path


def write_directory(
    root: dict,
    path,
    tensor_source: Callable[[dict], Source | None] | None = None,
    resource_bytes: Mapping[str, bytes] | None = None,
    max_file_bytes: int | None = None,
) -> Path:
    """Write the artifact a parsed JSON directory root describes (components, objects, bindings, uses).

    `tensor_source(object_record)` gives each tensor's source (None: a hole); without it every
    tensor is a hole. Resources take their bytes from `resource_bytes[role]`, else zeros of the
    size the directory records. Offsets are recomputed by the writer.
    """
    writer = ArtifactWriter(path, max_file_bytes, metadata=root.get("metadata"), provenance=root.get("provenance"))
    roles: dict[str, tuple[str, str]] = {}
    for cid, component in root["components"].items():
        writer.add_component(cid, component["config"], target=component.get("target"), proposal=component.get("proposal"))
        roles.update({oid: (cid, role) for role, oid in component.get("resources", {}).items()})
    resource_bytes = resource_bytes or {}
    for obj in root["objects"]:
        if obj["kind"] == "resource":
            cid, role = roles[obj["id"]]
            writer.add_resource(obj["id"], resource_bytes.get(role, bytes(obj["bytes"])), component=cid, role=role)
        else:
            source = tensor_source(obj) if tensor_source is not None else None
            writer.add_tensor(obj["id"], obj["shape"], obj["format"], obj["layout"], source, obj.get("divisors", 1))
    for name, binding in root["bindings"].items():
        if "object" in binding:
            writer.bind(name, binding["object"])
        else:
            writer.bind_parts(name, [(p["object"], *p["range"]) for p in binding["parts"]])
    for use in root["uses"]:
        writer.use(use["parameter"], use["input"], use["activation_policy"])
    return writer.write()


class _PayloadSink:
    """Writes logical-payload byte ranges into the per-file segments (§2.2)."""

    def __init__(self, handles, starts: list[int], sizes: list[int]):
        self.handles, self.starts, self.sizes = handles, starts, sizes
        self.prefix = [sum(sizes[:i]) for i in range(len(sizes))]

    def write(self, offset: int, data: np.ndarray) -> None:
        end = offset + data.size
        for h, start, base, size in zip(self.handles, self.starts, self.prefix, self.sizes):
            a, b = max(offset, base), min(end, base + size)
            if a < b:
                h.seek(start + a - base)
                h.write(memoryview(data[a - offset : b - offset]))


def _object_bytes(obj: _PendingObject) -> np.ndarray | None:
    if obj.source is None:
        return None
    if isinstance(obj.source, bytes):
        return np.frombuffer(obj.source, dtype=np.uint8)
    data = obj.source()
    oid = obj.record["id"]
    if not isinstance(data, np.ndarray) or data.dtype != np.uint8:
        raise ArtifactError(f"object {oid!r}: source must return a numpy uint8 array, got {type(data).__name__}")
    if data.size != obj.size:
        raise ArtifactError(f"object {oid!r}: source returned {data.size} bytes, encoded size is {obj.size}")
    return np.ascontiguousarray(data).reshape(-1)


_TENSOR_ORDER = ("id", "shape", "format", "layout", "offset", "bytes", "divisors", "kind")
_RESOURCE_ORDER = ("id", "encoding", "offset", "bytes", "kind")


def _ordered(record: dict) -> dict:
    order = _TENSOR_ORDER if record["kind"] == "tensor" else _RESOURCE_ORDER
    return {key: record[key] for key in order if key in record}
