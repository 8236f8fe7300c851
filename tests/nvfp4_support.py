"""nvfp4 test objects and artifacts: E2M1 codes, E4M3FN block-scale bytes and FP32 divisors packed
into a `block_scale_k16_m128x4_v1` object exactly as docs/format.md §6.3 lays it out, and artifacts
with chosen tensors re-encoded as nvfp4 (by the codec's encoder, §7.1)."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from ninfer_offload import open_artifact
from ninfer_offload.artifact.codecs import quantize_nvfp4, swizzle_scales
from ninfer_offload.artifact.formats import BLOCK_SCALE, NVFP4, BlockScaleGeometry
from ninfer_offload.artifact.writer import ArtifactWriter


def pack_nvfp4(codes: np.ndarray, scales: np.ndarray, divisors: np.ndarray) -> np.ndarray:
    """Object bytes from codes [n, k] (0..15), natural-order scale bytes [n, k / 16] and divisors [D]."""
    n, k = codes.shape
    geometry = BlockScaleGeometry(n, k, len(divisors))
    out = np.zeros(geometry.encoded_size, dtype=np.uint8)
    codes = codes.astype(np.uint8)
    out[: geometry.code_bytes] = (codes[:, 0::2] | (codes[:, 1::2] << 4)).reshape(-1)
    out[geometry.scale_offset : geometry.divisor_offset] = swizzle_scales(scales.astype(np.uint8))
    out[geometry.divisor_offset :] = np.asarray(divisors, dtype="<f4").view(np.uint8)
    return out


def random_nvfp4(rng: np.random.Generator, n: int, k: int, divisors: int = 1) -> np.ndarray:
    """A valid object whose values are about 1/sqrt(k): every code, normal scales 0.25..2 with some
    subnormal ones, distinct divisors."""
    codes = rng.integers(0, 16, size=(n, k))
    scales = rng.integers(0x28, 0x41, size=(n, k // 16))
    scales[rng.random(scales.shape) < 0.05] = rng.integers(1, 8)  # subnormal scales: m * 2^-9 (tiny values)
    return pack_nvfp4(codes, scales, rng.uniform(1.0, 4.0, size=divisors) * np.sqrt(k))


def encode_nvfp4(values: np.ndarray, divisors: int) -> np.ndarray:
    """An nvfp4 object of `values` [n, k] whose `divisors` equal runs of rows are each encoded as one matrix."""
    n, k = values.shape
    parts = [quantize_nvfp4(rows) for rows in values.reshape(divisors, n // divisors, k)]
    codes = np.concatenate([packed for packed, _, _ in parts])
    codes = np.stack([codes & 15, codes >> 4], axis=-1).reshape(n, k)
    return pack_nvfp4(codes, np.concatenate([scales for _, scales, _ in parts]), np.array([d for _, _, d in parts]))


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
            fmt, layout, count = obj["format"], obj["layout"], obj.get("divisors", 1)
            if oid in divisors:
                fmt, layout, count = NVFP4, BLOCK_SCALE, divisors[oid]
                data = encode_nvfp4(artifact.tensor(oid).numpy(), count)
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


def nvfp4_divisors(artifact) -> dict[str, int]:
    """Object id -> divisor count of every tensor `build_nvfp4_artifact` stores as nvfp4: routed banks
    (gate/up: one divisor per two experts; down: one per 128-row tile), the shared expert (gate/up: one
    per half), attention outputs, the embedding and the output head (several divisors)."""
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


def build_nvfp4_artifact(checkpoint: Path, directory: Path) -> Path:
    """The `bf16` conversion of a checkpoint at NVFP4 dimensions (`tiny_config(nvfp4=True)`) with
    the tensors of `nvfp4_divisors` re-encoded as nvfp4: every kind of nvfp4 matrix the engine reads."""
    from ninfer_offload.convert import convert

    lossless = convert(checkpoint, directory / "bf16.ninfer", recipe="bf16", progress=False)
    with open_artifact(lossless) as artifact:
        chosen = nvfp4_divisors(artifact)
    return nvfp4_artifact(lossless, directory / "nvfp4_matrices.ninfer", chosen)
