"""Write a synthetic full-size Qwen3.6-35B-A3B artifact: the official v3 directory, random valid weights.

    python bench/make_synthetic.py /tmp/qwen36-synthetic.ninfer [--seed 0] [--recipe official|nvfp4]

The directory (components, 940 objects, bindings, uses, formats) is
`ninfer_offload.artifact.contract.official_directory()` (`--recipe nvfp4`: `nvfp4_directory()`,
routed and shared experts NVFP4), so sizes, formats and the placement the planner computes are those
of that artifact. Weights are random but valid:

* row-split objects (q4/q5/q6/q8): random code planes (q8 never uses the illegal byte 0x80) and
  positive fp16 group scales of about sqrt(3) / (qmax * sqrt(K)), so every product keeps the
  scale of its input and activations stay finite through all 40 layers; embedding rows have
  unit scale;
* nvfp4 objects: random codes (every nibble is a valid E2M1 code), E4M3FN block scales drawn from
  [NVFP4_SCALE / 2, 1.5 NVFP4_SCALE] and positive divisors near NVFP4_SCALE * RMS_E2M1 * sqrt(K),
  which again keeps each product at the scale of its input;
* bf16/fp32 vectors: offset-RMSNorm weights near 0, the plain GDN norm at 1, router and GDN a/b
  projections ~ N(0, 1/H), conv taps ~ N(0, 0.3), A_log = log U(1, 16), dt_bias = 1;
* proposal token ids: a random permutation of the public vocabulary, first 131,072;
* vision and DFlash weights (not read by the text engine) are sparse holes, which read as zeros
  (zero codes with zero scales: valid);
* resources: the tiny tokenizer of `ninfer tiny` (`ninfer_offload.convert.tiny_tokenizer`), its vocabulary filled up
  to the model's with word tokens, so `ninfer generate` and `ninfer serve` run on the file and stream every token as text.

Random bytes come from one pre-drawn pool (sliced at random offsets), so writing ~22.8 GB takes
about as long as the disk needs. The file is a benchmark input: never commit it.
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path

import numpy as np

from ninfer_offload.artifact.codecs import E2M1_VALUES, E4M3FN_VALUES
from ninfer_offload.artifact.formats import BLOCK_SCALE, CONTIGUOUS, BlockScaleGeometry, RowSplitGeometry, grouped_format
from ninfer_offload.artifact.writer import write_directory
from ninfer_offload.artifact.contract import HIDDEN, nvfp4_directory, official_directory

POOL_BYTES = 1 << 29
PUBLIC_VOCAB = 248077
DIRECTORIES = {"official": official_directory, "nvfp4": nvfp4_directory}
# Typical E4M3FN block scale of the random nvfp4 objects (a normal number, far from 0 and 448),
# and the RMS of a uniformly random E2M1 code.
NVFP4_SCALE = 16.0
RMS_E2M1 = float(np.sqrt(np.mean(E2M1_VALUES**2)))
# E4M3FN bytes of the values in [NVFP4_SCALE / 2, 1.5 NVFP4_SCALE]: the block scales drawn from.
NVFP4_SCALE_BYTES = np.flatnonzero((E4M3FN_VALUES >= NVFP4_SCALE / 2) & (E4M3FN_VALUES <= 1.5 * NVFP4_SCALE)).astype(np.uint8)
# Components whose weights the text engine never reads: left as holes.
HOLE_COMPONENTS = ("vision/", "dflash/")


class RandomWeights:
    """Sources of random valid object bytes, keyed by what the object's bindings are."""

    def __init__(self, seed: int):
        self.rng = np.random.default_rng(seed)
        pool = np.frombuffer(self.rng.bytes(POOL_BYTES), dtype=np.uint8).copy()
        pool[pool == 0x80] = 0x81  # q8 code -128 is illegal; any nibble is a legal q4/q5/q6 code
        self.pool = pool

    def _random_bytes(self, count: int) -> np.ndarray:
        out = np.empty(count, dtype=np.uint8)
        for start in range(0, count, POOL_BYTES // 2):
            length = min(POOL_BYTES // 2, count - start)
            at = int(self.rng.integers(0, POOL_BYTES - length + 1))
            out[start : start + length] = self.pool[at : at + length]
        return out

    def row_split(self, fmt: str, shape: list[int], unit_rows: bool) -> np.ndarray:
        geometry = RowSplitGeometry(grouped_format(fmt), *shape)
        if geometry.k % 128:
            raise ValueError(f"random row-split objects need K % 128 == 0, got {shape}")
        data = np.zeros(geometry.encoded_size, dtype=np.uint8)
        data[: geometry.base_bytes] = self._random_bytes(geometry.base_bytes)
        if geometry.high_bytes:
            data[geometry.high_offset : geometry.high_offset + geometry.high_bytes] = self._random_bytes(geometry.high_bytes)
        gain = np.sqrt(3.0) / geometry.fmt.qmax / (1.0 if unit_rows else np.sqrt(geometry.k))
        scales = (self.rng.uniform(0.5, 1.5, geometry.scale_bytes // 2) * gain).astype(np.float16)
        data[geometry.scale_offset :] = scales.view(np.uint8)
        return data

    def nvfp4(self, shape: list[int], divisors: int) -> np.ndarray:
        """A random valid nvfp4 object: any codes, scales from NVFP4_SCALE_BYTES, divisors about NVFP4_SCALE * RMS_E2M1 * sqrt(K)."""
        geometry = BlockScaleGeometry(*shape, divisors)
        data = np.empty(geometry.encoded_size, dtype=np.uint8)
        data[: geometry.code_bytes] = self._random_bytes(geometry.code_bytes)
        data[geometry.code_bytes : geometry.scale_offset] = 0
        picks = self._random_bytes(geometry.scale_bytes)
        data[geometry.scale_offset : geometry.divisor_offset] = NVFP4_SCALE_BYTES[picks % NVFP4_SCALE_BYTES.size]
        gain = NVFP4_SCALE * RMS_E2M1 * np.sqrt(geometry.k)
        data[geometry.divisor_offset :] = (self.rng.uniform(0.9, 1.1, divisors) * gain).astype("<f4").view(np.uint8)
        return data

    def vector(self, fmt: str, shape: list[int], names: list[str]) -> np.ndarray:
        count = int(np.prod(shape))
        name = names[0]
        if fmt == "int32":  # proposal/token_ids
            return self.rng.permutation(PUBLIC_VOCAB)[:count].astype("<i4").view(np.uint8)
        if name.endswith("/a_log"):
            values = np.log(self.rng.uniform(1.0, 16.0, count))
        elif name.endswith("/dt_bias"):
            values = np.ones(count)
        elif name.endswith("/gdn/norm"):
            values = np.ones(count)
        elif name.endswith("/convolution"):
            values = self.rng.normal(0.0, 0.3, count)
        elif any(name.endswith(s) for s in ("/router", "/shared_score", "/a_projection", "/b_projection")):
            values = self.rng.normal(0.0, HIDDEN**-0.5, count)
        else:  # offset RMSNorm weights: (1 + w)
            values = self.rng.normal(0.0, 0.02, count)
        values = values.astype(np.float32)
        if fmt == "fp32":
            return values.view(np.uint8)
        return (values.view(np.uint32) >> 16).astype("<u2").view(np.uint8)  # bf16 by truncation

    def source(self, obj: dict, names: list[str]):
        """A callable producing the object's bytes, or None for a hole."""
        if all(n.startswith(HOLE_COMPONENTS) for n in names):
            return None
        if obj["layout"] == CONTIGUOUS:
            return lambda: self.vector(obj["format"], obj["shape"], names)
        if obj["layout"] == BLOCK_SCALE:
            return lambda: self.nvfp4(obj["shape"], obj.get("divisors", 1))
        unit_rows = names == ["text/token_embedding"]
        return lambda: self.row_split(obj["format"], obj["shape"], unit_rows)


def _resources(vocab_size: int) -> dict[str, bytes]:
    """The tiny tokenizer's files, its vocabulary filled up to `vocab_size` with word tokens (id i
    decodes to " w<i>"), so any id the random model picks streams as text."""
    from ninfer_offload.convert.tiny_tokenizer import write_tokenizer_files

    with tempfile.TemporaryDirectory() as tmp:
        write_tokenizer_files(tmp)
        files = {p.name: p.read_bytes() for p in Path(tmp).iterdir()}
    tokenizer = json.loads(files["tokenizer.json"])
    vocab = tokenizer["model"]["vocab"]
    taken = set(vocab.values()) | {added["id"] for added in tokenizer["added_tokens"]}
    vocab.update({f"\u0120w{i}": i for i in range(vocab_size) if i not in taken})
    files["tokenizer.json"] = json.dumps(tokenizer, ensure_ascii=False).encode()
    return files


def write_synthetic(path: Path, seed: int = 0, recipe: str = "official") -> Path:
    """Write the artifact of `recipe` ("official" or "nvfp4") to `path`; returns the entry path."""
    root = {
        **DIRECTORIES[recipe](),
        "metadata": {"name": f"qwen3.6-35b-a3b-{recipe}-synthetic"},
        "provenance": {"generator": "bench/make_synthetic.py", "seed": seed, "recipe": recipe},
    }
    weights = RandomWeights(seed)
    names: dict[str, list[str]] = {}
    for name, binding in root["bindings"].items():
        for part in binding["parts"] if "parts" in binding else [binding]:
            names.setdefault(part["object"], []).append(name)
    vocab_size = root["components"]["text"]["config"]["vocab_size"]
    resources = {"preprocessor_config.json": b"{}", "video_preprocessor_config.json": b"{}", **_resources(vocab_size)}
    return write_directory(root, path, lambda obj: weights.source(obj, names[obj["id"]]), resources)


def main() -> None:
    parser = argparse.ArgumentParser(description="Write a synthetic full-size Qwen3.6-35B-A3B .ninfer artifact.")
    parser.add_argument("path", type=Path)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--recipe", choices=tuple(DIRECTORIES), default="official", help="official (groupwise) or nvfp4 experts")
    args = parser.parse_args()
    began = time.perf_counter()
    entry = write_synthetic(args.path, args.seed, args.recipe)
    print(f"wrote {entry} ({entry.stat().st_size / 1e9:.2f} GB) in {time.perf_counter() - began:.0f} s")


if __name__ == "__main__":
    main()
