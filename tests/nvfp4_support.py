"""nvfp4 test objects: E2M1 codes, E4M3FN block-scale bytes and FP32 divisors packed into a
`block_scale_k16_m128x4_v1` object exactly as docs/format.md §6.3 lays it out, a test encoder, and
artifacts with chosen tensors re-encoded as nvfp4."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from ninfer_offload import open_artifact
from ninfer_offload.artifact.codecs import E2M1_VALUES, E4M3FN_VALUES
from ninfer_offload.artifact.formats import BLOCK_SCALE, NVFP4, BlockScaleGeometry
from ninfer_offload.artifact.writer import ArtifactWriter
from ninfer_offload.convert import tiny


def pack_nvfp4(codes: np.ndarray, scales: np.ndarray, divisors: np.ndarray) -> np.ndarray:
    """Object bytes from codes [n, k] (0..15), natural-order scale bytes [n, k / 16] and divisors [D]."""
    n, k = codes.shape
    geometry = BlockScaleGeometry(n, k, len(divisors))
    out = np.zeros(geometry.encoded_size, dtype=np.uint8)
    codes = codes.astype(np.uint8)
    out[: geometry.code_bytes] = (codes[:, 0::2] | (codes[:, 1::2] << 4)).reshape(-1)
    swizzled = scales.astype(np.uint8).reshape(n // 128, 4, 32, k // 64, 4).transpose(0, 3, 2, 1, 4)
    out[geometry.scale_offset : geometry.divisor_offset] = swizzled.reshape(-1)
    out[geometry.divisor_offset :] = np.asarray(divisors, dtype="<f4").view(np.uint8)
    return out


def random_nvfp4(rng: np.random.Generator, n: int, k: int, divisors: int = 1) -> np.ndarray:
    """A valid object whose values are about 1/sqrt(k): every code, normal scales 0.25..2 with some
    subnormal ones, distinct divisors."""
    codes = rng.integers(0, 16, size=(n, k))
    scales = rng.integers(0x28, 0x41, size=(n, k // 16))
    scales[rng.random(scales.shape) < 0.05] = rng.integers(1, 8)  # subnormal scales: m * 2^-9 (tiny values)
    return pack_nvfp4(codes, scales, rng.uniform(1.0, 4.0, size=divisors) * np.sqrt(k))


_E4M3 = E4M3FN_VALUES[:0x7F]  # the sign-0, non-NaN scale bytes, values increasing
_E2M1 = E2M1_VALUES[:8]  # code magnitudes, increasing


def _nearest(table: np.ndarray, x: np.ndarray) -> np.ndarray:
    """Index of the entry of the increasing `table` nearest to each x >= 0."""
    i = np.clip(np.searchsorted(table, x), 1, len(table) - 1)
    return np.where(x - table[i - 1] <= table[i] - x, i - 1, i)


def quantize_nvfp4(values: np.ndarray, divisors: int = 1) -> np.ndarray:
    """An nvfp4 object [n, k] near `values`: each divisor maps its rows' largest value to 6 x 448,
    block scales and codes round to nearest (a test encoder; any valid object would do)."""
    n, k = values.shape
    amax = np.abs(values.reshape(divisors, -1)).max(axis=1)
    d = (6 * 448 / np.where(amax > 0, amax, 1)).astype(np.float32)
    blocks = (values * np.repeat(d, n // divisors)[:, None]).reshape(n, k // 16, 16)
    scale_bytes = _nearest(_E4M3, np.abs(blocks).max(-1) / 6)
    scales = _E4M3[scale_bytes]
    magnitudes = np.minimum(np.abs(blocks) / np.where(scales > 0, scales, 1)[..., None], 6)
    codes = _nearest(_E2M1, magnitudes) | np.where(blocks < 0, 8, 0)
    return pack_nvfp4(codes.reshape(n, k), scale_bytes, d)


def nvfp4_artifact(src: Path, dst: Path, divisors: dict[str, int], edit=None) -> Path:
    """Copy artifact `src` to `dst` with the tensors named in `divisors` (object id -> divisor count)
    re-encoded as nvfp4 from their decoded values; `edit(object_id, data)` may then change any
    tensor's bytes in place."""
    with open_artifact(src) as artifact:
        root = artifact.directory
        writer = ArtifactWriter(dst)
        for cid, component in root["components"].items():
            writer.add_component(cid, component["config"], component.get("target"), component.get("proposal"))
        roles = {oid: (cid, role) for cid, c in root["components"].items() for role, oid in c.get("resources", {}).items()}
        for obj in root["objects"]:
            oid = obj["id"]
            if obj["kind"] == "resource":
                writer.add_resource(oid, artifact.payload(oid).tobytes(), *roles[oid])
                continue
            fmt, layout, count = obj["format"], obj["layout"], 1
            if oid in divisors:
                fmt, layout, count = NVFP4, BLOCK_SCALE, divisors[oid]
                data = quantize_nvfp4(artifact.tensor(oid).numpy(), count)
            else:
                data = artifact.payload(oid).copy()
            if edit is not None:
                edit(oid, data)
            writer.add_tensor(oid, obj["shape"], fmt, layout, lambda data=data: data, count)
        for name, binding in root["bindings"].items():
            if "object" in binding:
                writer.bind(name, binding["object"])
            else:
                writer.bind_parts(name, [(p["object"], *p["range"]) for p in binding["parts"]])
        for use in root["uses"]:
            writer.use(use["parameter"], use["input"], use.get("activation_policy", "A16Only"))
        return writer.write()


# The tiny model at dimensions nvfp4 can hold: every expert, shared-expert and attention-output
# matrix is whole 128-row tiles with K a multiple of 64.
NVFP4_DIMENSIONS = {"hidden_size": 128, "moe_intermediate_size": 64, "shared_expert_intermediate_size": 128}


def tiny_nvfp4_config() -> dict:
    """config.json of the tiny nvfp4 test model (4 layers: three GDN, one attention)."""
    return {**tiny.tiny_config("fused", num_layers=4), **NVFP4_DIMENSIONS}


def nvfp4_divisors(artifact) -> dict[str, int]:
    """Object id -> divisor count of every tensor the nvfp4 test artifact stores as nvfp4: routed banks
    (gate/up: one divisor per four experts; down: one per expert), the shared expert (gate/up: one per
    half), attention outputs, the embedding and the output head (several divisors)."""
    def object_of(name: str) -> str:
        return artifact.bindings[name].parts[0].object

    chosen = {object_of("text/token_embedding"): 1, object_of("text/output_head"): 4}
    for name in artifact.bindings:
        if name.endswith("/moe/experts/0/gate"):
            chosen[object_of(name)] = 2
        elif name.endswith("/moe/experts/0/down"):
            chosen[object_of(name)] = artifact.object(object_of(name)).shape[0] // 128
        elif name.endswith("/moe/shared/gate"):
            chosen[object_of(name)] = 2
        elif name.endswith(("/moe/shared/down", "/attention/output")):
            chosen[object_of(name)] = 1
    return chosen


def build_nvfp4_artifact(directory: Path, seed: int = 1, edit=None) -> Path:
    """The tiny nvfp4 test artifact: the `bf16` conversion of a tiny checkpoint at `NVFP4_DIMENSIONS`
    (with its MTP layer), the tensors of `nvfp4_divisors` re-encoded as nvfp4."""
    from ninfer_offload.convert import convert

    checkpoint = tiny.write_checkpoint(directory / "checkpoint", tiny_nvfp4_config(), seed=seed)
    lossless = convert(checkpoint, directory / "bf16.ninfer", recipe="bf16", progress=False)
    with open_artifact(lossless) as artifact:
        chosen = nvfp4_divisors(artifact)
    return nvfp4_artifact(lossless, directory / "nvfp4.ninfer", chosen, edit)
