"""Binary framing of `.ninfer` files: headers, strict JSON text, part names and sharding (docs/format.md §2-3)."""

from __future__ import annotations

import json
import struct

from ninfer_offload.artifact.errors import ArtifactError
from ninfer_offload.artifact.formats import U64_MAX, align_up

ENTRY_MAGIC_V3 = b"NINFER\x00\x03"
ENTRY_MAGIC_V2 = b"NINFER\x00\x02"
ENTRY_MAGIC_V1 = b"NINFER\x00\x01"
PART_MAGIC = b"NINPRT\x00\x03"
ENTRY_HEADER_V3 = 32
ENTRY_HEADER_V1 = 16
PART_HEADER = 32
PAYLOAD_ALIGNMENT = 4096
PART_PAYLOAD_START = 4096


def pack_entry_header(json_bytes: int, artifact_id: bytes) -> bytes:
    """The 32-byte v3 entry header."""
    return ENTRY_MAGIC_V3 + struct.pack("<Q", json_bytes) + artifact_id


def pack_part_header(part_index: int, artifact_id: bytes) -> bytes:
    """The 32-byte continuation-part header."""
    return PART_MAGIC + struct.pack("<Q", part_index) + artifact_id


def part_file_name(entry_name: str, index: int) -> str:
    """Writer convention for part `index` (>= 1): `<entry>.part-0001`."""
    return f"{entry_name}.part-{index:04d}"


def encode_json(root: dict) -> bytes:
    """Compact UTF-8 JSON (no spaces, non-ASCII unescaped), as the reference writer spells it."""
    try:
        return json.dumps(root, separators=(",", ":"), ensure_ascii=False, allow_nan=False).encode("utf-8")
    except (TypeError, ValueError) as err:
        raise ArtifactError(f"directory is not serialisable as JSON: {err}") from None


def _reject_duplicates(pairs: list[tuple[str, object]]) -> dict:
    result = dict(pairs)
    if len(result) < len(pairs):
        seen: set[str] = set()
        key = next(key for key, _ in pairs if key in seen or seen.add(key))
        raise ArtifactError(f"JSON directory: duplicate member {key!r} in one object")
    return result


def _reject_constant(name: str):
    raise ArtifactError(f"JSON directory: literal {name} is not allowed")


def decode_json(text: bytes) -> object:
    """Parse the directory: strict UTF-8, duplicate member names and NaN/Infinity rejected."""
    try:
        string = text.decode("utf-8")
    except UnicodeDecodeError as err:
        raise ArtifactError(f"JSON directory is not valid UTF-8 (byte {err.start})") from None
    try:
        return json.loads(string, object_pairs_hook=_reject_duplicates, parse_constant=_reject_constant)
    except json.JSONDecodeError as err:
        raise ArtifactError(f"JSON directory is not valid JSON: {err.msg} at line {err.lineno} column {err.colno}") from None
    except RecursionError:
        raise ArtifactError("JSON directory is nested too deeply") from None


def checked_sum(values, what: str) -> int:
    """Sum that must stay within U64."""
    total = 0
    for v in values:
        total += v
        if total > U64_MAX:
            raise ArtifactError(f"{what} overflows 64 bits")
    return total


def split_payload(entry_payload_start: int, payload_bytes: int, max_file_bytes: int | None) -> list[int]:
    """Per-file payload sizes (§2.3): entry first, then parts; one entry when it fits or no limit."""
    if max_file_bytes is None or entry_payload_start + payload_bytes <= max_file_bytes:
        return [payload_bytes]
    entry_capacity = (max_file_bytes - entry_payload_start) // PAYLOAD_ALIGNMENT * PAYLOAD_ALIGNMENT
    part_capacity = (max_file_bytes - PART_PAYLOAD_START) // PAYLOAD_ALIGNMENT * PAYLOAD_ALIGNMENT
    if entry_capacity <= 0 or part_capacity <= 0:
        raise ArtifactError(
            f"max_file_bytes {max_file_bytes} leaves no payload room (entry header and directory take {entry_payload_start} bytes)"
        )
    sizes = [entry_capacity]
    remaining = payload_bytes - entry_capacity
    while remaining > part_capacity:
        sizes.append(part_capacity)
        remaining -= part_capacity
    sizes.append(remaining)
    return sizes


def reserved_json_bytes(json_length: int) -> int:
    """Reserve JSON space so that the payload starts right after it at a 4096 boundary."""
    return align_up(ENTRY_HEADER_V3 + json_length, PAYLOAD_ALIGNMENT) - ENTRY_HEADER_V3
