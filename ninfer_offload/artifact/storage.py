"""The logical payload of a file set: memory-mapped, lazily opened, split across entry and parts (docs/format.md §2.2)."""

from __future__ import annotations

import mmap
import os
import struct
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from ninfer_offload.artifact.errors import ArtifactError
from ninfer_offload.artifact.framing import PART_HEADER, PART_MAGIC, PART_PAYLOAD_START


@dataclass
class PayloadSegment:
    """Logical bytes [begin, begin+size) stored in `path` from file offset `start`."""

    path: Path
    index: int
    begin: int
    size: int
    start: int
    artifact_id: bytes | None  # expected part id; None for the entry (already checked)
    view: np.ndarray | None = None
    _map: mmap.mmap | None = None

    def open(self) -> np.ndarray:
        """Map the file (checking a part's header and length first); returns its payload bytes."""
        if self.view is None:
            try:
                with open(self.path, "rb") as f:
                    if self.artifact_id is not None:
                        self._check_part_header(f)
                    actual = os.fstat(f.fileno()).st_size
                    if actual != self.start + self.size:
                        raise ArtifactError(
                            f"{self._name()}: file has {actual} bytes, the files table requires {self.start + self.size}"
                        )
                    self._map = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
            except FileNotFoundError:
                raise ArtifactError(f"{self._name()}: file {str(self.path)!r} is missing") from None
            except OSError as err:
                raise ArtifactError(f"{self._name()}: cannot read {str(self.path)!r}: {err.strerror}") from None
            self.view = np.frombuffer(self._map, dtype=np.uint8, count=self.size, offset=self.start)
        return self.view

    def _name(self) -> str:
        return "entry file" if self.index == 0 else f"part file files[{self.index}]"

    def _check_part_header(self, f) -> None:
        header = f.read(PART_HEADER)
        if len(header) < PART_HEADER:
            raise ArtifactError(f"{self._name()}: truncated header ({len(header)} of {PART_HEADER} bytes)")
        if header[:8] != PART_MAGIC:
            raise ArtifactError(f"{self._name()}: wrong magic {header[:8].hex()} (not a v3 continuation part)")
        (index,) = struct.unpack("<Q", header[8:16])
        if index != self.index:
            raise ArtifactError(f"{self._name()}: header says part index {index}, expected {self.index}")
        if header[16:32] != self.artifact_id:
            raise ArtifactError(
                f"{self._name()}: artifact_id {header[16:32].hex()} does not match the entry's {self.artifact_id.hex()}"
            )

    def close(self) -> None:
        self.view = None
        if self._map is not None:
            try:
                self._map.close()
            except BufferError:  # arrays handed out still view the map; it closes when they die
                pass
            self._map = None


class PayloadStorage:
    """Reads logical-payload ranges; a range inside one file comes back as a zero-copy view."""

    def __init__(self, segments: list[PayloadSegment]):
        self.segments = segments
        self.payload_bytes = sum(s.size for s in segments)

    @classmethod
    def for_files(cls, entry: Path, entry_start: int, files, artifact_id: bytes | None) -> "PayloadStorage":
        segments, begin = [], 0
        for i, rec in enumerate(files):
            path = entry if i == 0 else entry.with_name(rec.path)
            start = entry_start if i == 0 else PART_PAYLOAD_START
            segments.append(PayloadSegment(path, i, begin, rec.payload_bytes, start, None if i == 0 else artifact_id))
            begin += rec.payload_bytes
        return cls(segments)

    def read(self, offset: int, length: int) -> np.ndarray:
        """Logical bytes [offset, offset+length) as a read-only uint8 array."""
        end = offset + length
        if offset < 0 or length < 0 or end > self.payload_bytes:
            raise ArtifactError(f"payload read [{offset}, {end}) is outside the payload of {self.payload_bytes} bytes")
        pieces = []
        for seg in self.segments:
            a, b = max(offset, seg.begin), min(end, seg.begin + seg.size)
            if a < b:
                pieces.append(seg.open()[a - seg.begin : b - seg.begin])
        if len(pieces) == 1:
            return pieces[0]
        return np.concatenate(pieces) if pieces else np.empty(0, dtype=np.uint8)

    def prefetch(self) -> None:
        """Ask the OS to start reading every file's payload now (readahead in the background), so a
        load that walks the payload finds it in the page cache. A hint: failures are ignored."""
        for seg in self.segments:
            try:
                fd = os.open(seg.path, os.O_RDONLY)
            except OSError:
                continue
            try:
                os.posix_fadvise(fd, seg.start, seg.size, os.POSIX_FADV_WILLNEED)
            except (OSError, AttributeError):  # AttributeError: no posix_fadvise on this platform
                pass
            finally:
                os.close(fd)

    def close(self) -> None:
        for seg in self.segments:
            seg.close()
