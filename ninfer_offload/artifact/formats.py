"""Registered numeric formats and layouts, and the exact byte geometry of each (docs/format.md §5-6)."""

from __future__ import annotations

from dataclasses import dataclass
from math import prod

from ninfer_offload.artifact.errors import ArtifactError

TENSOR_ALIGNMENT = 256
U64_MAX = 2**64 - 1

CONTIGUOUS = "contiguous_le_v1"
ROW_SPLIT = "row_split_k128_v1"
BLOCK_SCALE = "block_scale_k16_m128x4_v1"
ROW_SCALE = "row_scale_v1"
RAW_BYTES = "raw_bytes_v1"


@dataclass(frozen=True)
class GroupedFormat:
    """A groupwise signed-integer format with one FP16 multiplier per group."""

    name: str
    bits: int
    group: int
    base_bytes: int  # base-plane bytes per group
    high_bytes: int  # high-plane bytes per group (Q5/Q6 only)
    qmin: int
    qmax: int

    @property
    def bits_per_weight(self) -> float:
        return (8 * (self.base_bytes + self.high_bytes) + 16) / self.group


GROUPED_FORMATS: dict[str, GroupedFormat] = {
    f.name: f
    for f in (
        GroupedFormat("q4_g64_fp16", 4, 64, 32, 0, -8, 7),
        GroupedFormat("q5_g64_fp16", 5, 64, 32, 8, -16, 15),
        GroupedFormat("q6_g64_fp16", 6, 64, 32, 16, -32, 31),
        GroupedFormat("q8_g32_fp16", 8, 32, 32, 0, -127, 127),
    )
}

# Element word sizes of the contiguous formats.
DIRECT_FORMATS: dict[str, int] = {"bf16": 2, "fp32": 4, "int32": 4}

NVFP4 = "nvfp4"
FP8_ROW = "fp8_e4m3fn_row_bf16"

# Which formats each layout accepts.
LAYOUT_FORMATS: dict[str, frozenset[str]] = {
    CONTIGUOUS: frozenset(DIRECT_FORMATS),
    ROW_SPLIT: frozenset(GROUPED_FORMATS),
    BLOCK_SCALE: frozenset({NVFP4}),
    ROW_SCALE: frozenset({FP8_ROW}),
}

# Container v1 spellings of the same formats and layouts.
V1_FORMAT_NAMES = {
    "BF16": "bf16",
    "FP32": "fp32",
    "I32": "int32",
    "Q4G64_F16S": "q4_g64_fp16",
    "Q5G64_F16S": "q5_g64_fp16",
    "Q6G64_F16S": "q6_g64_fp16",
    "W8G32_F16S": "q8_g32_fp16",
    "NVFP4": NVFP4,
    "FP8_E4M3FN_ROW_BF16S": FP8_ROW,
}
V1_LAYOUT_NAMES = {
    "contiguous-le-v1": CONTIGUOUS,
    "row-split-k128-v1": ROW_SPLIT,
    "blockscale-k16-m128x4-v1": BLOCK_SCALE,
    "row-scale-v1": ROW_SCALE,
    "raw-bytes-v1": RAW_BYTES,
}


def align_up(value: int, alignment: int) -> int:
    """Smallest multiple of `alignment` that is >= `value`."""
    return -(-value // alignment) * alignment


def elements(shape: tuple[int, ...] | list[int]) -> int:
    """Number of logical elements of a shape (1 for a scalar)."""
    return prod(shape)


@dataclass(frozen=True)
class RowSplitGeometry:
    """Plane offsets and sizes of one `row_split_k128_v1` object of logical shape [n, k]."""

    fmt: GroupedFormat
    n: int
    k: int

    @property
    def k_pad(self) -> int:
        return align_up(self.k, 128)

    @property
    def groups_per_row(self) -> int:
        return self.k_pad // self.fmt.group

    @property
    def logical_groups_per_row(self) -> int:
        return -(-self.k // self.fmt.group)

    @property
    def base_bytes(self) -> int:
        return self.n * self.groups_per_row * self.fmt.base_bytes

    @property
    def high_bytes(self) -> int:
        return self.n * self.groups_per_row * self.fmt.high_bytes

    @property
    def scale_bytes(self) -> int:
        return self.n * self.groups_per_row * 2

    @property
    def format(self) -> str:
        return self.fmt.name

    @property
    def high_offset(self) -> int:
        return align_up(self.base_bytes, 256)

    @property
    def scale_offset(self) -> int:
        return self.high_offset + align_up(self.high_bytes, 256)

    @property
    def encoded_size(self) -> int:
        return self.scale_offset + self.scale_bytes

    @property
    def plane_offsets(self) -> list[int]:
        """Where each plane starts: base, high (if any), scale (the order of `row_spans`)."""
        return [0] + ([self.high_offset] if self.fmt.high_bytes else []) + [self.scale_offset]

    def row_spans(self, r0: int, count: int) -> list[tuple[int, int]]:
        """Byte spans (offset, length) of rows [r0, r0+count): base, high (if any), scale."""
        if r0 < 0 or count <= 0 or r0 + count > self.n:
            raise ArtifactError(f"row range [{r0}, {r0 + count}) outside [0, {self.n})")
        gpr = self.groups_per_row
        spans = [(r0 * gpr * self.fmt.base_bytes, count * gpr * self.fmt.base_bytes)]
        if self.fmt.high_bytes:
            spans.append((self.high_offset + r0 * gpr * self.fmt.high_bytes, count * gpr * self.fmt.high_bytes))
        spans.append((self.scale_offset + r0 * gpr * 2, count * gpr * 2))
        return spans


NVFP4_TILE_ROWS = 128  # rows of one scale tile (and the unit a divisor covers)
NVFP4_TILE_COLS = 64  # columns of one scale tile: 4 blocks of 16


@dataclass(frozen=True)
class BlockScaleGeometry:
    """Plane offsets and sizes of one `block_scale_k16_m128x4_v1` nvfp4 object [n, k] with `divisors`
    FP32 divisors (docs/format.md §6.3): code plane, scale plane (swizzled in 128 x 4-block tiles),
    divisor words. Divisor `i` covers the row tiles [i * tiles / divisors, (i + 1) * tiles / divisors)."""

    n: int
    k: int
    divisors: int = 1

    def __post_init__(self) -> None:
        if self.n <= 0 or self.k <= 0 or self.n % NVFP4_TILE_ROWS or self.k % NVFP4_TILE_COLS:
            raise ArtifactError(f"nvfp4 needs N % 128 == 0 and K % 64 == 0, got {[self.n, self.k]}")
        if self.divisors <= 0 or self.row_tiles % self.divisors:
            raise ArtifactError(f"nvfp4 divisors {self.divisors} must split the {self.row_tiles} row tiles evenly")

    @property
    def format(self) -> str:
        return NVFP4

    @property
    def row_tiles(self) -> int:
        return self.n // NVFP4_TILE_ROWS

    @property
    def k_tiles(self) -> int:
        return self.k // NVFP4_TILE_COLS

    @property
    def code_bytes(self) -> int:
        return self.n * self.k // 2

    @property
    def scale_offset(self) -> int:
        return align_up(self.code_bytes, 256)

    @property
    def scale_bytes(self) -> int:
        return self.n * self.k // 16

    @property
    def divisor_offset(self) -> int:
        return self.scale_offset + self.scale_bytes

    @property
    def encoded_size(self) -> int:
        return self.divisor_offset + 4 * self.divisors

    @property
    def rows_per_divisor(self) -> int:
        return self.n // self.divisors

    @property
    def plane_offsets(self) -> list[int]:
        """Where the code and scale planes start (the order of `row_spans`)."""
        return [0, self.scale_offset]

    def row_spans(self, r0: int, count: int) -> list[tuple[int, int]]:
        """Byte spans (offset, length) of the whole row tiles [r0, r0+count): codes, scales. A tile's
        scales are one contiguous run of the swizzled plane, so whole tiles cut out verbatim."""
        if r0 < 0 or count <= 0 or r0 + count > self.n:
            raise ArtifactError(f"row range [{r0}, {r0 + count}) outside [0, {self.n})")
        if r0 % NVFP4_TILE_ROWS or count % NVFP4_TILE_ROWS:
            raise ArtifactError(f"nvfp4 rows [{r0}, {r0 + count}) are not whole 128-row scale tiles")
        row_code, row_scale = self.k // 2, self.k // 16
        return [(r0 * row_code, count * row_code), (self.scale_offset + r0 * row_scale, count * row_scale)]

    def tile_divisor_index(self) -> list[int]:
        """Index of the divisor word of each row tile."""
        return [t * NVFP4_TILE_ROWS // self.rows_per_divisor for t in range(self.row_tiles)]


ObjectGeometry = RowSplitGeometry | BlockScaleGeometry


def grouped_format(name: str) -> GroupedFormat:
    """The grouped format called `name`, or an ArtifactError."""
    try:
        return GROUPED_FORMATS[name]
    except KeyError:
        raise ArtifactError(f"unknown grouped format {name!r}") from None


def runtime_geometry(fmt: str, n: int, k: int) -> ObjectGeometry:
    """Geometry of an [n, k] quantized matrix as the runtime keeps it (matrices and expert records):
    row-split as stored; nvfp4 with one divisor per 128-row tile, so any whole tiles cut out alone."""
    if fmt == NVFP4:
        return BlockScaleGeometry(n, k, n // NVFP4_TILE_ROWS)
    return RowSplitGeometry(grouped_format(fmt), n, k)


def encoded_size(layout: str, fmt: str, shape: tuple[int, ...] | list[int], divisors: int = 1) -> int:
    """Exact byte length of a tensor object (docs/format.md §6); ArtifactError for unsupported pairs.

    `divisors` is the number of FP32 weight divisors of an nvfp4 object (fork extension, default 1).
    """
    if layout not in LAYOUT_FORMATS:
        raise ArtifactError(f"unknown layout {layout!r}")
    if fmt not in LAYOUT_FORMATS[layout]:
        raise ArtifactError(f"format {fmt!r} is not supported by layout {layout!r}")
    if layout == CONTIGUOUS:
        return elements(shape) * DIRECT_FORMATS[fmt]
    if len(shape) != 2:
        raise ArtifactError(f"layout {layout!r} needs a rank-2 shape, got {list(shape)}")
    n, k = shape
    if layout == ROW_SPLIT:
        return RowSplitGeometry(GROUPED_FORMATS[fmt], n, k).encoded_size
    if layout == BLOCK_SCALE:
        return BlockScaleGeometry(n, k, divisors).encoded_size
    return align_up(n * k, 256) + 2 * n  # ROW_SCALE
