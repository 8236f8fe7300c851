"""Open `.ninfer` artifacts (container v3 and v1) and read their objects as numpy bytes or torch tensors.

`open_artifact(path)` reads only the header and JSON directory and validates every structural rule
(docs/format.md §4.8); payload is memory-mapped on first use, continuation parts are opened (and their
headers checked) only when a read touches them.
"""

from __future__ import annotations

import os
import struct
from pathlib import Path

import numpy as np

from ninfer_offload.artifact import codecs
from ninfer_offload.artifact.errors import ArtifactError
from ninfer_offload.artifact.formats import (
    BLOCK_SCALE,
    CONTIGUOUS,
    DIRECT_FORMATS,
    GROUPED_FORMATS,
    ROW_SPLIT,
    RowSplitGeometry,
    align_up,
)
from ninfer_offload.artifact.framing import (
    ENTRY_HEADER_V1,
    ENTRY_HEADER_V3,
    ENTRY_MAGIC_V1,
    ENTRY_MAGIC_V2,
    ENTRY_MAGIC_V3,
    PAYLOAD_ALIGNMENT,
    decode_json,
)
from ninfer_offload.artifact.schema import (
    Binding,
    Component,
    Directory,
    ObjectInfo,
    Part,
    Use,
    check_encoded_size,
    parse_directory,
    resource_encoding_check,
)
from ninfer_offload.artifact.storage import PayloadStorage
from ninfer_offload.artifact.v1 import parse_v1_directory

__all__ = ["Artifact", "open_artifact", "ArtifactError"]


def not_an_artifact_file(path: Path) -> ArtifactError:
    """The error for an entry path that is no file: missing, a directory, or a Hugging Face checkpoint's
    directory (with the command that converts it)."""
    if not path.is_dir():
        return ArtifactError(f"no such artifact file: {path}")
    if (path / "config.json").is_file():
        return ArtifactError(
            f"{path} is a directory holding a Hugging Face checkpoint, not a .ninfer artifact: "
            f"convert it first with 'ninfer convert {path} {path.name}.ninfer'"
        )
    return ArtifactError(f"{path} is a directory, not a .ninfer artifact file")


def open_artifact(path) -> "Artifact":
    """Open and validate a `.ninfer` entry file (v3 or v1)."""
    return Artifact(path)


class Artifact:
    """A validated `.ninfer` file set.

    Directory: `path`, `version` (1 or 3), `artifact_id` (v3) / `model_id` (v1), `components`,
    `objects`, `bindings`, `uses`, `files`, `metadata`, `provenance`, `directory` (the JSON root).
    Payload: `payload(id)`, `read(offset, length)`, `tensor(name)`, `quantized(name)`, `rows(name)`,
    `resource(name)`. v1 files expose synthesised bindings (see `artifact.v1`) and no uses.
    """

    def __init__(self, path):
        self.path = Path(path)
        try:
            with open(self.path, "rb") as f:
                file_size = os.fstat(f.fileno()).st_size
                magic = f.read(8)
                self.version = _version(magic, file_size)
                header_size = ENTRY_HEADER_V3 if self.version == 3 else ENTRY_HEADER_V1
                header = magic + f.read(header_size - 8)
                if len(header) < header_size:
                    raise ArtifactError(f"truncated header: {len(header)} of {header_size} bytes")
                (json_bytes,) = struct.unpack("<Q", header[8:16])
                if json_bytes == 0:
                    raise ArtifactError("header json_bytes is 0 (must be positive)")
                if header_size + json_bytes > file_size:
                    raise ArtifactError(f"header json_bytes {json_bytes} runs past the end of the {file_size}-byte file")
                text = f.read(json_bytes)
        except (FileNotFoundError, IsADirectoryError):
            raise not_an_artifact_file(self.path) from None
        except OSError as err:
            raise ArtifactError(f"cannot read {str(self.path)!r}: {err.strerror}") from None
        self.directory: dict = decode_json(text)
        payload_start = align_up(header_size + json_bytes, PAYLOAD_ALIGNMENT)
        if self.version == 3:
            self.artifact_id: bytes | None = header[16:32]
            parsed = parse_directory(self.directory, self.path.name)
            expected = payload_start + parsed.files[0].payload_bytes
            if file_size != expected:
                raise ArtifactError(
                    f"entry file has {file_size} bytes, but its header and files[0] require {expected} (truncated or padded file)"
                )
            self.model_id: str | None = None
        else:
            self.artifact_id = None
            if file_size < payload_start:
                raise ArtifactError(f"file ends at {file_size}, before its payload start {payload_start} (truncated file)")
            self.model_id, parsed = parse_v1_directory(self.directory, file_size - payload_start)
        self._dir: Directory = parsed
        self._by_id = {o.id: o for o in parsed.objects}
        self._storage = PayloadStorage.for_files(self.path, payload_start, parsed.files, self.artifact_id)

    # ------------------------------------------------------------------ directory

    @property
    def components(self) -> dict[str, Component]:
        return self._dir.components

    @property
    def objects(self) -> list[ObjectInfo]:
        return self._dir.objects

    @property
    def bindings(self) -> dict[str, Binding]:
        return self._dir.bindings

    @property
    def uses(self) -> list[Use]:
        return self._dir.uses

    @property
    def files(self):
        return self._dir.files

    @property
    def metadata(self) -> dict:
        return self._dir.metadata

    @property
    def provenance(self) -> dict:
        return self._dir.provenance

    @property
    def payload_bytes(self) -> int:
        return self._storage.payload_bytes

    def object(self, object_id: str) -> ObjectInfo:
        try:
            return self._by_id[object_id]
        except KeyError:
            raise ArtifactError(f"no object {object_id!r} in {self.path.name}") from None

    def binding(self, name: str) -> Binding:
        """The binding `name`; a tensor object id also works (as a whole-object binding)."""
        if name in self._dir.bindings:
            return self._dir.bindings[name]
        obj = self._by_id.get(name)
        if obj is not None and obj.kind == "tensor":
            return Binding([Part(obj.id, 0, obj.elements)], whole=True)
        raise ArtifactError(f"no binding or tensor object {name!r} in {self.path.name}")

    # ------------------------------------------------------------------ payload

    def payload(self, object_id: str) -> np.ndarray:
        """The object's stored bytes (read-only uint8; zero-copy when it lies in one file)."""
        obj = self.object(object_id)
        return self._storage.read(obj.offset, obj.bytes)

    def read(self, offset: int, length: int) -> np.ndarray:
        """Raw logical-payload bytes [offset, offset+length)."""
        return self._storage.read(offset, length)

    def resource(self, name: str) -> bytes:
        """Resource bytes by role (text component first, then the others) or by resource object id."""
        roles = [self.components["text"]] if "text" in self.components else []
        roles += [c for cid, c in self.components.items() if cid != "text"]
        object_id = next((c.resources[name] for c in roles if name in c.resources), name)
        obj = self._by_id.get(object_id)
        if obj is None or obj.kind != "resource":
            raise ArtifactError(f"no resource {name!r} in {self.path.name}")
        resource_encoding_check(obj)
        return self.payload(obj.id).tobytes()

    def rows(self, name: str) -> tuple[str, int, int]:
        """(object id, first row, end row) of a binding made of whole consecutive rows of one rank-2 object."""
        binding = self.binding(name)
        obj = self.object(binding.parts[0].object)
        if len(obj.shape) != 2:
            raise ArtifactError(f"binding {name!r}: object {obj.id!r} of shape {list(obj.shape)} is not rank 2")
        k = obj.shape[1]
        cursor = binding.parts[0].begin
        for part in binding.parts:
            if part.object != obj.id or part.begin != cursor or part.begin % k or part.end % k:
                raise ArtifactError(f"binding {name!r} is not a run of whole consecutive rows of one object")
            cursor = part.end
        return obj.id, binding.parts[0].begin // k, cursor // k

    def quantized(self, name: str):
        """(codes int8 [N, K], scales float16 [N, ceil(K/G)]) of a row-split binding or object, as torch tensors."""
        import torch

        object_id, r0, r1 = self.rows(name)
        obj = self._decodable(object_id)
        if obj.layout != ROW_SPLIT:
            raise ArtifactError(f"{name!r}: object {obj.id!r} is {obj.format}/{obj.layout}, not a row-split quantized object")
        codes, scales = codecs.decode_row_split(self._row_slice(obj, r0, r1 - r0), obj.format, r1 - r0, obj.shape[1])
        return torch.from_numpy(codes), torch.from_numpy(scales)

    def tensor(self, name: str):
        """Logical values of a binding (or tensor object): float32, or int32 for int32 objects.

        Parts are concatenated in order; the result has the object's shape for a whole binding,
        [rows, K] when every part is whole rows of rank-2 objects with the same K, else it is flat.
        """
        import torch

        binding = self.binding(name)
        pieces = [self._decode_part(self._decodable(p.object), p.begin, p.end) for p in binding.parts]
        values = pieces[0] if len(pieces) == 1 else np.concatenate(pieces)
        values = values.reshape(self._logical_shape(binding))
        return torch.from_numpy(values if values.flags.c_contiguous else values.copy())

    def _logical_shape(self, binding: Binding) -> tuple[int, ...]:
        objs = [self._by_id[p.object] for p in binding.parts]
        if binding.whole:
            return objs[0].shape
        ks = {o.shape[1] for o in objs if len(o.shape) == 2}
        if len(ks) == 1 and all(len(o.shape) == 2 for o in objs):
            (k,) = ks
            if all(p.begin % k == 0 and p.end % k == 0 for p in binding.parts):
                return (binding.elements // k, k)
        return (binding.elements,)

    def _decodable(self, object_id: str) -> ObjectInfo:
        obj = self.object(object_id)
        if obj.kind != "tensor":
            raise ArtifactError(f"object {obj.id!r} is a resource, not a tensor")
        check_encoded_size(obj)  # unknown format/layout fails here, naming the object
        return obj

    def _row_slice(self, obj: ObjectInfo, r0: int, count: int) -> np.ndarray:
        """Rows [r0, r0+count) of a row-split object as a standalone object (reads only their plane spans)."""
        src = RowSplitGeometry(GROUPED_FORMATS[obj.format], *obj.shape)
        if r0 == 0 and count == src.n:
            return self.payload(obj.id)
        dst = RowSplitGeometry(src.fmt, count, src.k)
        out = np.zeros(dst.encoded_size, dtype=np.uint8)
        for (offset, length), start in zip(src.row_spans(r0, count), dst.plane_offsets):
            out[start : start + length] = self._storage.read(obj.offset + offset, length)
        return out

    def _decode_part(self, obj: ObjectInfo, begin: int, end: int) -> np.ndarray:
        """Flat logical values of elements [begin, end) of a tensor object."""
        if obj.layout == CONTIGUOUS:
            word = DIRECT_FORMATS[obj.format]
            raw = self._storage.read(obj.offset + begin * word, (end - begin) * word)
            return codecs.decode_contiguous(raw, obj.format, (end - begin,))
        if obj.layout == ROW_SPLIT:
            k = obj.shape[1]
            r0, r1 = begin // k, -(-end // k)
            values = codecs.decode_row_split_values(self._row_slice(obj, r0, r1 - r0), obj.format, r1 - r0, k)
            return values.reshape(-1)[begin - r0 * k : end - r0 * k]
        if obj.layout == BLOCK_SCALE:
            values = codecs.decode_nvfp4(self.payload(obj.id), *obj.shape, divisors=obj.divisors)
        else:  # ROW_SCALE, the last registered layout
            values = codecs.decode_fp8_rows(self.payload(obj.id), *obj.shape)
        return values.reshape(-1)[begin:end]

    # ------------------------------------------------------------------ lifetime

    def prefetch(self) -> None:
        """Start reading the whole payload into the page cache in the background (see `PayloadStorage.prefetch`)."""
        self._storage.prefetch()

    def close(self) -> None:
        self._storage.close()

    def __enter__(self) -> "Artifact":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"Artifact({str(self.path)!r}, version={self.version}, objects={len(self.objects)})"


def _version(magic: bytes, file_size: int) -> int:
    if len(magic) < 8:
        raise ArtifactError(f"truncated header: file has only {file_size} bytes")
    if magic == ENTRY_MAGIC_V3:
        return 3
    if magic == ENTRY_MAGIC_V1:
        return 1
    if magic == ENTRY_MAGIC_V2:
        raise ArtifactError("container version 2 is not supported: upgrade the file to v3 with the v2->v3 upgrade tool")
    if magic[:6] == b"NINPRT":
        raise ArtifactError("this is a continuation part, not an entry file: open the entry file instead")
    raise ArtifactError(f"wrong magic {magic.hex()}: not a .ninfer entry file")
