"""Payload validity checks (`ninfer inspect --verify`): decode every tensor and check its codes and scales.

Rules (docs/format.md §5.1, §6): grouped scales are +0 or finite positive FP16, a zero scale needs
all-zero codes, W8 never stores code -128, padding lanes and padding groups are zero; float words
are finite; NVFP4 block scales are sign-0 non-NaN E4M3FN and divisors finite > 0; FP8 row codes
are never 0x7F/0xFF and row scales are finite non-negative BF16. Work is done in row chunks so
memory stays bounded on full-size banks.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

from ninfer_offload.artifact.codecs import unpack_codes
from ninfer_offload.artifact.errors import ArtifactError
from ninfer_offload.artifact.formats import (
    BLOCK_SCALE,
    CONTIGUOUS,
    ROW_SCALE,
    ROW_SPLIT,
    GROUPED_FORMATS,
    RowSplitGeometry,
    align_up,
    elements,
)
from ninfer_offload.artifact.schema import ObjectInfo, check_encoded_size

_CHUNK_BYTES = 1 << 26


def verify_artifact(artifact, progress: Callable[[int], None] | None = None) -> dict[str, list[str]]:
    """Problems per object id (empty dict when everything is valid); `progress(bytes)` after each chunk."""
    problems: dict[str, list[str]] = {}
    for obj in artifact.objects:
        if obj.kind == "tensor":
            found = verify_tensor(artifact, obj, progress)
            if found:
                problems[obj.id] = found
        elif progress:
            progress(obj.bytes)
    return problems


def verify_tensor(artifact, obj: ObjectInfo, progress: Callable[[int], None] | None = None) -> list[str]:
    """Problems of one tensor object (reads its whole payload)."""
    try:
        check_encoded_size(obj)
    except ArtifactError as err:
        if progress:
            progress(obj.bytes)
        return [str(err)]
    check = {ROW_SPLIT: _row_split, CONTIGUOUS: _contiguous, BLOCK_SCALE: _nvfp4, ROW_SCALE: _fp8_rows}[obj.layout]
    done = 0

    def advance(n: int) -> None:
        nonlocal done
        done += n
        if progress:
            progress(n)

    counts: dict[str, int] = {}
    for rule, count in check(artifact, obj, advance):
        if count:
            counts[rule] = counts.get(rule, 0) + count
    if progress and obj.bytes > done:
        progress(obj.bytes - done)  # plane padding is not read but counts as done
    return [f"{count} {rule}" for rule, count in counts.items()]


def require_valid(artifact, obj: ObjectInfo, name: str) -> None:
    """ArtifactError (one line, naming `name` and the object) when `obj` breaks a payload rule: what a load
    checks for objects whose bad values no later step would catch (nvfp4 scales and divisors)."""
    problems = verify_tensor(artifact, obj)
    if problems:
        raise ArtifactError(f"{name}: object {obj.id!r} has {', '.join(problems)}")


def _read(artifact, obj: ObjectInfo, offset: int, length: int) -> np.ndarray:
    return artifact.read(obj.offset + offset, length)


def _f16_bad(words: np.ndarray) -> tuple[int, int, np.ndarray]:
    """(negative count, non-finite count, zero mask) of FP16 scale words."""
    nonfinite = (words & 0x7C00) == 0x7C00
    negative = ((words & 0x8000) != 0) & ~nonfinite
    return int(negative.sum()), int(nonfinite.sum()), (words & 0x7FFF) == 0


def _row_split(artifact, obj: ObjectInfo, progress):
    fmt = GROUPED_FORMATS[obj.format]
    geo = RowSplitGeometry(fmt, *obj.shape)
    gpr, per_row = geo.groups_per_row, geo.groups_per_row * (fmt.base_bytes + fmt.high_bytes + 2)
    step = max(1, _CHUNK_BYTES // per_row)
    logical = geo.logical_groups_per_row
    for r0 in range(0, geo.n, step):
        rows = min(step, geo.n - r0)
        spans = geo.row_spans(r0, rows)
        base = _read(artifact, obj, *spans[0])
        high = _read(artifact, obj, *spans[1]) if fmt.high_bytes else None
        words = _read(artifact, obj, *spans[-1]).view("<u2").reshape(rows, gpr)
        negative, nonfinite, zero = _f16_bad(words)
        # A group's codes are all zero exactly when its stored bits are: test 8 bytes at a time.
        nonzero_group = base.reshape(rows, gpr, -1).view(np.uint64).any(axis=-1)
        if high is not None:
            nonzero_group |= high.reshape(rows, gpr, -1).view(np.uint64).any(axis=-1)
        yield "negative scales", negative
        yield "NaN/Inf scales", nonfinite
        yield "zero scales with non-zero codes", int((zero & nonzero_group).sum())
        if fmt.bits == 8:
            yield "W8 codes equal to -128", int(np.count_nonzero(base == 0x80))
        if geo.k < geo.k_pad:
            lanes = unpack_codes(fmt, base, high, rows, gpr)
            yield "non-zero padding lanes", int(np.count_nonzero(lanes[:, geo.k :]))
        yield "non-zero padding-group scales", int(np.count_nonzero(words[:, logical:]))
        progress(sum(length for _, length in spans))


def _contiguous(artifact, obj: ObjectInfo, progress):
    word = {"bf16": 2, "fp32": 4, "int32": 4}[obj.format]
    total = elements(obj.shape) * word
    step = _CHUNK_BYTES // word * word
    for start in range(0, total, step):
        raw = _read(artifact, obj, start, min(step, total - start))
        if obj.format == "bf16":
            yield "NaN/Inf values", int(((raw.view("<u2") & 0x7F80) == 0x7F80).sum())
        elif obj.format == "fp32":
            yield "NaN/Inf values", int(((raw.view("<u4") & 0x7F800000) == 0x7F800000).sum())
        progress(raw.size)


def _nvfp4(artifact, obj: ObjectInfo, progress):
    n, k = obj.shape
    scale_offset = align_up(n * k // 2, 256)
    scales = _read(artifact, obj, scale_offset, n * k // 16)
    yield "negative block scales", int(((scales & 0x80) != 0).sum())
    yield "NaN block scales", int(((scales & 0x7F) == 0x7F).sum())
    divisors = _read(artifact, obj, scale_offset + n * k // 16, 4 * obj.divisors).view("<f4")
    yield "divisors that are not finite and > 0", int((~(np.isfinite(divisors) & (divisors > 0))).sum())
    progress(obj.bytes)


def _fp8_rows(artifact, obj: ObjectInfo, progress):
    n, k = obj.shape
    for start in range(0, n * k, _CHUNK_BYTES):
        codes = _read(artifact, obj, start, min(_CHUNK_BYTES, n * k - start))
        yield "FP8 NaN codes (0x7F/0xFF)", int(((codes & 0x7F) == 0x7F).sum())
        progress(codes.size)
    words = _read(artifact, obj, align_up(n * k, 256), 2 * n).view("<u2")
    nonfinite = (words & 0x7F80) == 0x7F80
    yield "NaN/Inf row scales", int(nonfinite.sum())
    yield "negative row scales", int((((words & 0x8000) != 0) & ~nonfinite).sum())
