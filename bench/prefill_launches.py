"""Kernel launches of one prefill chunk, counted on the CPU: Triton kernels and torch ops per layer kind.

Usage: python bench/prefill_launches.py [--dtype float32] [--chunk 256] [ARTIFACT]

Prefills two chunks of `--chunk` tokens on the Triton backend under the Triton interpreter and
counts, for one layer of each kind in the second chunk (which attends over the first), what it
would launch on a GPU (`decode_launches.LaunchCounter`): Triton kernels by name, and torch ops
sorted into copies, fills and the rest. Each mixer's core counts as one op, as the CPU runs other
kernels for it than CUDA: `gdn_prefill` (flash-linear-attention's chunked delta rule on CUDA, the
reference's many small products here) and `attention_prefill` (SDPA). Outside the layers: the
embedding, the final norm and the output head of the chunk's last token.
Without ARTIFACT it converts the tiny model of `ninfer tiny` to the `official` recipe (top-2
routing, so a chunk of more than 128 tokens takes the MoE kernels' prefill tiles, as 2048 tokens
of the full model's top-8 do). Prints one JSON object, with an estimate for the full model's 40
layers per chunk (its layer kinds, these per-layer counts, the launches outside the layers).
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
from collections import Counter
from pathlib import Path

os.environ.setdefault("TRITON_INTERPRET", "1")

import torch  # noqa: E402
from torch.utils._python_dispatch import _disable_current_modes  # noqa: E402

from decode_launches import LaunchCounter, tiny_artifact  # noqa: E402

from ninfer_offload.artifact.contract import TEXT_CONFIG  # noqa: E402
from ninfer_offload.model.attention import GatedAttention  # noqa: E402
from ninfer_offload.artifact.dims import FULL_ATTENTION  # noqa: E402
from ninfer_offload.runtime.engine import Engine  # noqa: E402

COPIES = {"copy_", "_to_copy", "clone", "cat", "contiguous", "index_copy_"}
FILLS = {"fill_", "zero_", "zeros", "zeros_like", "ones", "ones_like", "full", "full_like", "new_zeros", "new_full"}


def kinds(ops: Counter) -> dict:
    """Torch ops sorted into copies, fills and the rest."""
    copies = sum(n for op, n in ops.items() if op in COPIES)
    fills = sum(n for op, n in ops.items() if op in FILLS)
    return {"copies": copies, "fills": fills, "other": sum(ops.values()) - copies - fills}


def one_op(counter: LaunchCounter, name: str, op):
    """`op` counted as one op `name`, run outside the counter (the CPU runs other kernels for it than CUDA)."""

    def counted(*args):
        counter.ops[name] += 1
        with _disable_current_modes():
            return op(*args)

    return counted


class MeasuredLayer:
    """A decoder layer that keeps the launches of its last call under its mixer's kind (Triton kernels and
    torch ops by name) and adds them to `totals`."""

    def __init__(self, layer, counter: LaunchCounter, last: dict[str, tuple[Counter, Counter]], totals: Counter) -> None:
        self.layer, self.counter, self.last, self.totals = layer, counter, last, totals

    def __call__(self, *args, **kwargs):
        kernels, ops = Counter(self.counter.kernels), Counter(self.counter.ops)
        result = self.layer(*args, **kwargs)
        kind = "attention" if isinstance(self.layer.mixer, GatedAttention) else "gdn"
        self.last[kind] = (self.counter.kernels - kernels, self.counter.ops - ops)
        self.totals["layers"] += sum(self.last[kind][0].values()) + sum(self.last[kind][1].values())
        return result


def count_prefill(artifact: Path, dtype: str, chunk: int) -> dict:
    engine = Engine.load(artifact, device="cpu", dtype=dtype, backend="triton", spec="none", max_context=2 * chunk)
    counter, last, totals = LaunchCounter(), {}, Counter()
    for name in ("gdn_prefill", "attention_prefill"):
        setattr(engine.backend, name, one_op(counter, name, getattr(engine.backend, name)))
    session = engine.session()
    ids = [(7 * i) % engine.config.vocab_size for i in range(2 * chunk)]
    layers = engine.text.layers
    with torch.no_grad():
        session.prefill(ids[:chunk])
        engine.text.layers = [MeasuredLayer(layer, counter, last, totals) for layer in layers]
        try:
            with counter:
                session.prefill(ids[chunk:])
        finally:
            engine.text.layers = layers
    per_kind = {
        kind: {
            "launches": sum(k.values()) + sum(o.values()), "triton": sum(k.values()), **kinds(o),
            "triton_by_kernel": dict(k.most_common()), "torch_by_op": dict(o.most_common()),
        }
        for kind, (k, o) in sorted(last.items())
    }
    outside = counter.total - totals["layers"]
    full_kinds = ["attention" if kind == FULL_ATTENTION else "gdn" for kind in TEXT_CONFIG["layer_types"]]
    return {
        "dtype": dtype,
        "chunk_tokens": chunk,
        "launches_per_chunk": counter.total,
        "per_layer_kind": per_kind,
        "launches_outside_layers": outside,
        "full_model_estimate_per_chunk": outside + sum(per_kind[kind]["launches"] for kind in full_kinds),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("artifact", nargs="?", type=Path, help="a .ninfer artifact (default: the tiny test model)")
    parser.add_argument("--dtype", default="bfloat16", choices=["float32", "bfloat16"], help="activation dtype")
    parser.add_argument("--chunk", type=int, default=256, help="tokens per prefill chunk")
    args = parser.parse_args()
    if args.artifact is not None:
        print(json.dumps(count_prefill(args.artifact, args.dtype, args.chunk), indent=1))
        return
    with tempfile.TemporaryDirectory() as directory:
        print(json.dumps(count_prefill(tiny_artifact(Path(directory)), args.dtype, args.chunk), indent=1))


if __name__ == "__main__":
    main()
