"""Fit a card's `[launches]` constants (planner/launch_cost.py) from its recorded benchmark results.

    python bench/calibrate_launches.py --profile h100 bench/results/step_ab_h100_down_walk_profile_fd5a366.json \\
        bench/results/resident_h100_1a12bdd.json

Reads the kernel tables (a `bench/step_ab.py` run with a `nopdl` variant: each kernel's own time; `bench/spec.py`'s
resident `step_kernels` / `verify_kernels` and `bench/resident.py`'s `decode_kernels`, recorded under programmatic
dependent launch, where each kernel's time includes its wait for the one before: a common wait per launch comes
off so that they sum to the measured forward), the measured forwards (decode, verification, batch steps) and a
4K prefill. Prefill's share of the tensor throughput comes from the prefill; per kernel family a least-squares fit
on the log of the family's time per table gives the launch latency, the share of the memory bandwidth and the
CUDA-core rate per SM (where the records leave the share open, the one nearest ASSUMED_SHARE, and the fastest
cores); the gap per forward is the median of the measured forwards less their launches. Prints the TOML table to
paste into the profile; an unreadable or incomplete input prints why and exits 2, so no profile changes.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from ninfer_offload.artifact.contract import official_directory
from ninfer_offload.artifact.dims import ModelDims
from ninfer_offload.artifact.inventory import Inventory
from ninfer_offload.errors import NinferError
from ninfer_offload.planner.launch_cost import LaunchConstants, forward_seconds
from ninfer_offload.planner.launches import FAMILIES, ForwardWeights, Launch, forward_launches, touched_experts
from ninfer_offload.planner.memory import kv_layer_bytes_per_token
from ninfer_offload.planner.routing import shipped_routing_stats
from ninfer_offload.profiles import DeviceProfile, load_profile

KERNEL_FAMILIES = (  # kernel-name fragment -> family (first match wins)
    ("_quantized_", "dense_product"),
    ("_paired", "dense_product"),
    ("_gate_up", "routed_gate_up"),
    ("_down_", "routed_down"),
    ("_gdn_recurrent", "gdn_recurrence"),
    ("_conv_update", "gdn_conv"),
    ("_decode_partial", "attention"),
    ("_decode_merge", "attention"),
    ("_attention_inputs", "attention"),
    ("_softmax_topk", "router_topk"),
    ("rmsnorm", "norm"),
)
NOT_LAUNCHES = ("Memcpy", "Memset")  # copies the profiler lists beside the kernels
MIN_LAUNCH_S = 0.5e-6  # the least a launch of a PDL table keeps once the wait is taken off
SPEC_CONTEXT = 1024  # bench/spec.py decodes after a short prompt
LATENCY_GRID = np.geomspace(0.3e-6, 300e-6, 160)
SHARE_GRID = np.arange(0.02, 1.0001, 0.01)
SM_FLOPS_GRID = np.geomspace(1e9, 2e12, 56)
NEAR_BEST = 1e-2  # summed squared log error within this of the best counts as a fit (about 5 % per table over four)
# Among the fits the records allow, the share nearest this one: a family whose launches were never bandwidth-bound
# here leaves its share open, and the weight kernels' assumed share (0.7) is the least surprising there.
ASSUMED_SHARE = 0.7


def family_of(kernel: str) -> str | None:
    """The launch family of a recorded kernel name; None for copies."""
    if kernel.startswith(NOT_LAUNCHES):
        return None
    return next((family for fragment, family in KERNEL_FAMILIES if fragment in kernel), "elementwise")


@dataclass(frozen=True)
class Shape:
    """A forward: `tokens` positions of each of `sequences` sequences at `context` tokens of KV."""

    tokens: int
    sequences: int
    context: int


@dataclass
class Table:
    """One recorded kernel table: per family, launches and seconds in one forward."""

    name: str
    shape: Shape
    launches: dict[str, int]
    seconds: dict[str, float]


@dataclass
class Measurement:
    """A measured figure of a card: a forward's seconds, a prefill chunk's seconds or an offloaded step's."""

    name: str
    seconds: float
    source: str
    shape: Shape | None = None
    tokens: int = 0  # prefill
    budget_gib: float | None = None  # offloaded decode


@dataclass
class CardRecord:
    """What a card's result files hold."""

    gpu: str = ""
    tables: list[Table] = field(default_factory=list)
    measured: list[Measurement] = field(default_factory=list)

    def find(self, name: str) -> Measurement | None:
        return next((m for m in self.measured if m.name == name), None)


def _table(name: str, shape: Shape, kernels: list[dict], total_s: float | None) -> Table:
    """Family totals of a kernel table; with `total_s` (a table recorded under PDL, where a kernel's time includes
    its wait for the one before) less the same wait per launch, so that they sum to it."""
    launches, seconds = dict.fromkeys(FAMILIES, 0), dict.fromkeys(FAMILIES, 0.0)
    for row in kernels:
        family = family_of(row["kernel"])
        if family is not None:
            launches[family] += int(row.get("launches", row.get("calls", 0)))
            seconds[family] += row["us"] * 1e-6
    if total_s is not None:
        wait = (sum(seconds.values()) - total_s) / sum(launches.values())
        seconds = {f: max(s - launches[f] * wait, launches[f] * MIN_LAUNCH_S) for f, s in seconds.items()}
    return Table(name, shape, launches, seconds)


def read_results(paths: list[Path]) -> CardRecord:
    """The tables and measurements of one card's result files (step_ab, spec, resident)."""
    record = CardRecord()
    for path in paths:
        try:
            data = json.loads(path.read_text())
        except (OSError, ValueError) as err:
            raise NinferError(f"cannot read {path}: {err}") from None
        gpu = data.get("gpu", "")
        if record.gpu and gpu != record.gpu:
            raise NinferError(f"{path.name} ran on {gpu}, the other files on {record.gpu}: calibrate one card at a time")
        record.gpu = gpu
        source = path.name
        if "variants" in data:
            _read_step_ab(data, source, record)
        elif "runs" in data:
            _read_spec(data, source, record)
        elif "decode" in data:
            _read_resident(data, source, record)
        else:
            raise NinferError(f"{path.name} is neither a step_ab, spec nor resident result")
    return record


def _read_step_ab(data: dict, source: str, record: CardRecord) -> None:
    context, batch, drafts = data["context"], data["batch"], data["draft_tokens"]
    shapes = {"step": Shape(1, 1, context), "verify": Shape(drafts + 1, 1, context), "batch": Shape(1, batch, context)}
    names = {"step": "decode 1K", "verify": f"verify {drafts} drafts", "batch": f"batch {batch}"}
    for variant in data["variants"]:
        if variant["variant"] == "current":
            if data.get("vram_budget_gib"):
                budget = data["vram_budget_gib"]
                record.measured.append(Measurement(f"decode {budget:g} GiB", variant["step_ms"] * 1e-3, source, budget_gib=budget))
            else:
                for key, shape in shapes.items():
                    record.measured.append(Measurement(names[key], variant[f"{key}_ms"] * 1e-3, source, shape))
        if variant["variant"] == "nopdl" and "kernels" in variant and not data.get("vram_budget_gib"):
            for key, shape in shapes.items():
                record.tables.append(_table(f"{source} nopdl {key}", shape, variant["kernels"][key], None))


def _read_spec(data: dict, source: str, record: CardRecord) -> None:
    for run in data["runs"]:
        if run["mode"] != "resident" or "step_kernels" not in run:
            continue
        tokens = run["draft_tokens"] + 1
        record.tables.append(_table(f"{source} step", Shape(1, 1, SPEC_CONTEXT), run["step_kernels"], run["step_s"]))
        record.tables.append(_table(f"{source} verify {tokens}", Shape(tokens, 1, SPEC_CONTEXT), run["verify_kernels"], run["verify_s"]))


def _read_resident(data: dict, source: str, record: CardRecord) -> None:
    for row in data["decode"]:
        shape = Shape(1, 1, row["context"])
        record.measured.append(Measurement(f"decode {row['context'] // 1024}K", row["ms_per_token"] * 1e-3, source, shape))
    if data.get("decode_kernels"):
        first = data["decode"][0]
        record.tables.append(
            _table(f"{source} decode", Shape(1, 1, first["context"]), data["decode_kernels"], first["ms_per_token"] * 1e-3)
        )
    for row in data.get("batched_decode", []):
        if row["batch"] > 1:
            shape = Shape(1, row["batch"], row["context"])
            record.measured.append(Measurement(f"batch {row['batch']}", row["step_ms"] * 1e-3, source, shape))
    for row in data.get("prefill", []):
        record.measured.append(Measurement(f"prefill {row['tokens']}", row["seconds"], source, tokens=row["tokens"]))


@dataclass(frozen=True)
class Model:
    """The artifact and routing the launch tables are built for (the official inventory, shipped statistics)."""

    dims: ModelDims
    weights: ForwardWeights
    hits: tuple[tuple[float, ...], ...]
    kv_bytes_per_token: int

    @classmethod
    def official(cls) -> "Model":
        inventory = Inventory.from_directory(official_directory())
        dims = ModelDims.from_text_config(inventory.text_config)
        return cls(dims, ForwardWeights.of(inventory), shipped_routing_stats().hits, kv_layer_bytes_per_token(dims, "bf16"))

    def launches(self, shape: Shape) -> list[Launch]:
        touched = touched_experts(self.hits, shape.tokens * shape.sequences)
        return forward_launches(self.dims, self.weights, shape.tokens, shape.sequences, shape.context, touched, self.kv_bytes_per_token)

    def prefill_flops(self, tokens: int, context: int) -> float:
        """A prefill chunk's flops: its products over the active parameters and the attention scores."""
        launches = self.launches(Shape(tokens, 1, context))
        return sum(launch.count * (launch.flops + launch.core_flops) for launch in launches)


def fit_family(samples: list[tuple[list[Launch], float]], profile: DeviceProfile, tensor_share: float) -> tuple[float, float, float]:
    """(latency s, bandwidth share, CUDA-core flops/s per SM) of one family: the least squared log error of its time
    per table; among the fits within NEAR_BEST of the best, the share nearest ASSUMED_SHARE, then the fastest cores."""
    latency = LATENCY_GRID[:, None, None]
    bandwidth = (profile.memory_bandwidth_gbs * 1e9 * SHARE_GRID)[None, :, None]
    cores = (profile.sm_count * SM_FLOPS_GRID)[None, None, :]
    tensor = profile.tensor_tflops * 1e12 * tensor_share
    error = np.zeros((len(LATENCY_GRID), len(SHARE_GRID), len(SM_FLOPS_GRID)))
    for launches, measured in samples:
        predicted = np.zeros_like(error)
        for launch in launches:
            work = np.maximum(np.maximum(launch.bytes / bandwidth, launch.core_flops / cores), launch.flops / tensor)
            predicted += launch.count * (latency + work)
        error += (np.log(predicted) - math.log(measured)) ** 2
    near = error <= error.min() + NEAR_BEST
    shares = near.any(axis=(0, 2))
    share_index = int(np.argmin(np.where(shares, abs(SHARE_GRID - ASSUMED_SHARE), np.inf)))
    flops_index = int(np.flatnonzero(near[:, share_index, :].any(axis=0))[-1])
    latency_index = int(np.argmin(np.where(near[:, share_index, flops_index], error[:, share_index, flops_index], np.inf)))
    return float(LATENCY_GRID[latency_index]), float(SHARE_GRID[share_index]), float(SM_FLOPS_GRID[flops_index])


def _with_longer_contexts(record: CardRecord) -> list[Table]:
    """The kernel tables, and for a one-token table whose file also measured decode at longer contexts a table at
    each: its attention family longer by the measured forward's difference (attention is what context changes)."""
    tables = list(record.tables)
    for table in record.tables:
        source = table.name.split()[0]
        same = [m for m in record.measured if m.source == source and m.shape and m.shape.tokens == m.shape.sequences == 1]
        base = next((m for m in same if m.shape == table.shape), None)
        for longer in (m for m in same if base and m.shape.context > table.shape.context):
            seconds = {**table.seconds, "attention": table.seconds["attention"] + longer.seconds - base.seconds}
            tables.append(Table(f"{table.name} at {longer.shape.context}", longer.shape, table.launches, seconds))
    return tables


def calibrate(record: CardRecord, profile: DeviceProfile, model: Model) -> LaunchConstants:
    """The card's launch constants from its records (see the module docstring)."""
    if not record.tables:
        raise NinferError("no kernel table in the inputs (a step_ab run with a nopdl variant, a spec or a resident result)")
    forwards = [m for m in record.measured if m.shape is not None and m.shape.context <= 1024]
    prefill = next((m for m in record.measured if m.tokens == 4096), None)
    if not forwards or prefill is None:
        raise NinferError("the inputs need a measured decode forward at 1K context and a 4096-token prefill")
    tensor_share = model.prefill_flops(prefill.tokens, prefill.tokens) / (profile.tensor_tflops * 1e12 * prefill.seconds)
    latency, share, sm_flops = {}, {}, {}
    for family in FAMILIES:
        samples = []
        for table in _with_longer_contexts(record):
            launches = [launch for launch in model.launches(table.shape) if launch.family == family]
            if table.seconds[family] > 0 and launches:
                samples.append((launches, table.seconds[family]))
        if not samples:
            raise NinferError(f"no recorded launch of the {family} family in the kernel tables")
        latency[family], share[family], sm_flops[family] = fit_family(samples, profile, tensor_share)
    gapless = LaunchConstants(latency, share, sm_flops, 0.0, tensor_share)
    gap = statistics.median(m.seconds - forward_seconds(model.launches(m.shape), gapless, profile) for m in forwards)
    return LaunchConstants(latency, share, sm_flops, gap, tensor_share)


def toml_table(constants: LaunchConstants, sources: list[str]) -> str:
    """The `[launches]` table, its sources in a comment."""
    lines = ["[launches]", f"# fitted by bench/calibrate_launches.py from {', '.join(sources)}"]
    lines += [f"{key} = {value:.3g}" for key, value in constants.to_table().items()]
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--profile", required=True, help="the card's profile (its memory bandwidth and tensor rate)")
    parser.add_argument("results", nargs="+", type=Path)
    args = parser.parse_args()
    try:
        constants = calibrate(read_results(args.results), load_profile(args.profile), Model.official())
    except NinferError as err:
        print(f"error: {err}; the profile is left as it is", file=sys.stderr)
        raise SystemExit(2) from None
    print(toml_table(constants, [p.name for p in args.results]), end="")


if __name__ == "__main__":
    main()
