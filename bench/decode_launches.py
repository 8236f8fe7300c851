"""Kernel launches of one captured decode step, counted on the CPU: Triton kernels and torch ops.

Usage: python bench/decode_launches.py [--dtype bfloat16] [--tokens T] [ARTIFACT]

Runs the step a captured decode graph records (`StepRunner.forward` on device-held inputs) on the Triton backend under
the Triton interpreter, after a short prefill, and counts what it would launch on a GPU (with `--tokens T`, a
step of T tokens that keeps each token's state, as a verification of T - 1 drafts does): each
Triton kernel call, and each torch op that computes (views and uninitialised allocations launch
nothing and are left out). Without ARTIFACT it converts the tiny model of `ninfer tiny` (`ninfer_offload.convert.tiny`) to
the `official` recipe in a temporary directory. Prints one JSON object, with the launches of each
kind of layer and an estimate for the full model's 40 layers (its layer kinds, these per-layer
counts, the launches outside the layers).
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
from torch.utils._python_dispatch import TorchDispatchMode  # noqa: E402
from triton.runtime.interpreter import InterpretedFunction  # noqa: E402

from ninfer_offload.model.attention import GatedAttention  # noqa: E402
from ninfer_offload.artifact.dims import FULL_ATTENTION  # noqa: E402
from ninfer_offload.artifact.contract import TEXT_CONFIG  # noqa: E402
from ninfer_offload.runtime.engine import Engine  # noqa: E402
from ninfer_offload.runtime.step_inputs import pack_inputs, unpack_inputs  # noqa: E402

PROMPT = [5, 17, 300, 42, 7]
STEP_TOKENS = [11, 250, 3, 99, 42, 8, 77, 123]
_NO_KERNEL = {"empty", "empty_like", "empty_strided", "detach", "lift_fresh"}


class LaunchCounter(TorchDispatchMode):
    """While active: Triton kernel calls by kernel name, and the torch ops outside them that would launch a
    kernel (not views, not uninitialised allocations; the interpreter's own tensor traffic is not counted)."""

    def __init__(self) -> None:
        super().__init__()
        self.kernels: Counter[str] = Counter()
        self.ops: Counter[str] = Counter()
        self._in_kernel = False

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.overloadpacket.__name__
        if not self._in_kernel and not func.is_view and name not in _NO_KERNEL:
            self.ops[name] += 1
        return func(*args, **(kwargs or {}))

    @property
    def total(self) -> int:
        return sum(self.kernels.values()) + sum(self.ops.values())

    def __enter__(self) -> "LaunchCounter":
        self._run = run = InterpretedFunction.run

        def counted(fn, *args, **kwargs):
            self.kernels[fn.fn.__name__] += 1
            self._in_kernel = True
            try:
                return run(fn, *args, **kwargs)
            finally:
                self._in_kernel = False

        InterpretedFunction.run = counted
        return super().__enter__()

    def __exit__(self, *exc) -> None:
        InterpretedFunction.run = self._run
        super().__exit__(*exc)


class MeasuredLayer:
    """A decoder layer that records the launches of each of its calls under its mixer's kind."""

    def __init__(self, layer, counter: LaunchCounter, per_kind: dict[str, list[int]]) -> None:
        self.layer, self.counter, self.per_kind = layer, counter, per_kind

    def __call__(self, *args, **kwargs):
        before = self.counter.total
        result = self.layer(*args, **kwargs)
        kind = "attention" if isinstance(self.layer.mixer, GatedAttention) else "gdn"
        self.per_kind.setdefault(kind, []).append(self.counter.total - before)
        return result


def tiny_artifact(directory: Path) -> Path:
    """The tiny model converted with the official recipe."""
    from ninfer_offload.convert import convert
    from ninfer_offload.convert.tiny import write_checkpoint

    checkpoint = write_checkpoint(directory / "checkpoint", seed=0)
    return convert(checkpoint, directory / "tiny.ninfer", recipe="official", progress=False)


def count_step(artifact: Path, dtype: str, tokens: int = 1) -> dict:
    engine = Engine.load(artifact, device="cpu", dtype=dtype, backend="triton", spec="none", draft_tokens=tokens - 1)
    session = engine.session()
    session.prefill(PROMPT)
    packed = pack_inputs(STEP_TOKENS[:tokens], [session.slot], [session.length], tokens, engine.max_context)
    token, ctx = unpack_inputs(packed, 1, tokens, prefill=False, keep_states=tokens > 1, host=None)
    per_kind: dict[str, list[int]] = {}
    with torch.no_grad(), LaunchCounter() as counter:
        layers, engine.text.layers = engine.text.layers, [MeasuredLayer(layer, counter, per_kind) for layer in engine.text.layers]
        try:
            engine.runner.forward(token, ctx)
        finally:
            engine.text.layers = layers
    triton_total, torch_total = sum(counter.kernels.values()), sum(counter.ops.values())
    per_layer = {kind: min(counts) for kind, counts in per_kind.items()}  # the first layer also fills a per-shape cache
    outside = counter.total - sum(sum(counts) for counts in per_kind.values())
    full_kinds = ["attention" if kind == FULL_ATTENTION else "gdn" for kind in TEXT_CONFIG["layer_types"]]
    return {
        "dtype": dtype,
        "tokens": tokens,
        "layers": len(layers),
        "launches_per_step": counter.total,
        "launches_per_layer_kind": per_layer,
        "launches_outside_layers": outside,
        "full_model_estimate": outside + sum(per_layer[kind] for kind in full_kinds),
        "triton_kernels": triton_total,
        "torch_ops": torch_total,
        "triton_by_kernel": dict(counter.kernels.most_common()),
        "torch_by_op": dict(counter.ops.most_common()),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("artifact", nargs="?", type=Path, help="a .ninfer artifact (default: the tiny test model)")
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"], help="activation dtype")
    parser.add_argument("--tokens", type=int, default=1, choices=range(1, len(STEP_TOKENS) + 1), help="tokens of the step")
    args = parser.parse_args()
    if args.artifact is not None:
        print(json.dumps(count_step(args.artifact, args.dtype, args.tokens), indent=1))
        return
    with tempfile.TemporaryDirectory() as directory:
        print(json.dumps(count_step(tiny_artifact(Path(directory)), args.dtype, args.tokens), indent=1))


if __name__ == "__main__":
    main()
