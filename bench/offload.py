"""Offload benchmark on one CUDA GPU: decode and prefill with the routed experts split between VRAM
and pinned host memory by the planner, for several VRAM budgets.

    python bench/make_synthetic.py /tmp/q36.ninfer
    python bench/offload.py /tmp/q36.ninfer --budgets 12 15 20 24 --out bench/results/offload_h200.json

The synthetic artifact's router is far more concentrated than the real model's, so routing comes
from a replayed trace (`ExpertStore.replay_routing`, a benchmark hook): `planner.trace.routing_trace`
draws it from the model's shipped per-layer pick counts with the temporal reuse published for this
model class (about 45 % of a token's experts reused by the next token, 80 % within 8), seeded. The
router still computes its weights; only the expert ids are replaced.

Measured in one run, per VRAM budget (GiB; the H200 profile planned at that budget):
* decode tokens/s over `--tokens` greedy steps, run as `generate` runs them (each step takes the
  previous one's argmax on the device and the host reads each token one step behind),
  after `--warmup` steps that capture the graphs and warm the cache: the faster of DECODE_WINDOWS
  consecutive windows (the resident baseline too), its stats and Belady's rate on its trace tokens;
* the step time against `resident step + miss bytes / H2D`, where the resident step is measured in
  the same run with every expert in VRAM (same trace) and H2D is a measured 1 GiB pinned copy; the
  same decode with each of DECODE_VARIANTS' cache settings (fewer promotions; at the first budget);
* hit rate, PCIe bytes and promotions per token (the store's stats), and Belady's optimal hit
  rate on the same trace for the same number of experts in VRAM (`planner.trace.belady_hit_rate`);
* a 4K-token prefill (chunks of the engine's prefill size, trace routing) against its PCIe
  roofline: max(resident 4K prefill time, bytes of the distinct host experts per chunk / H2D); the
  bytes it moved; at the first budget, the same prefill with each of PREFILL_VARIANTS' settings (another
  gather width, 2048-token chunks; each against the resident prefill at its chunk size); per setting one more
  prefill profiled (`profiling.stream_timeline`: busy time per CUDA stream,
  how much the copy and compute streams overlapped, the host's time in synchronizing calls);
* time to ready (Engine.load from a cold page cache) against the time to read the artifact's
  files from disk (cold page cache too), and the load's phases (`Engine.load_seconds`); the imports a
  process's first load also pays (`imports`: the Triton kernels and flash-linear-attention), timed apart;
* the planner's prediction for the same options, and its projections to the RTX 5060 Ti and
  RTX 5090 (the cost model of `planner.cost`);
* whether the offloaded logits equal the all-resident ones on a prompt (bitwise);
* with `--kernel-steps N`, N decode steps' kernels by launch shape (`profiling.kernels_by_launch`, per step),
  resident and at the first budget: which kernels an offloaded step pays more for;
* with `--miss-paths`, decode at the first budget with each miss path (pcie, cpu, auto), each engine
  loaded and timed the same way (`--miss-path-loads N` loads each N times
  in turn and keeps its best), and `auto` against the better pure path; per path the PCIe bytes and the
  host's assignments per step (one sequence: the batched split is measured by `bench/serve.py`);
  per path 32 more steps profiled (`TraceRun.decode_profiled`: wall time against the device's busy time,
  and which host calls the device waited on);
* last, the floor (`accelerate_floor`; needs `accelerate`, `--skip-accelerate` leaves it out):
  transformers' `Qwen3_5MoeForCausalLM` with random bf16 weights, dispatched by accelerate at the
  first budget's (or `--floor-budget`'s) GPU cap as `from_pretrained(device_map="auto",
  max_memory=...)` dispatches it: `infer_auto_device_map` with `max_memory={0: cap, "cpu": free RAM}`,
  then `dispatch_model`. accelerate runs every layer on GPU 0; a layer mapped to "cpu" keeps its
  weights in pageable host memory and copies all of them in for every forward (its 256 experts:
  1.5 GiB). Greedy decode after the same 64-token prompt, `--floor-tokens` timed steps after 2
  warm-up ones, each reading its token; `speedup_vs_accelerate` in each run at that budget. GDN runs
  transformers' PyTorch path, on whatever device a layer's tensors are: flash-linear-attention and
  causal-conv1d are hidden while its model code is imported (`hf_baseline.import_torch_kernels`);
  for one token that path is a few small ops per layer, next to the weights an offloaded layer
  copies in.
  The default measures the full 40-layer model, well inside 5 minutes on the H200 machine: the
  model is built on the GPU (69 GB; transformers' random init takes seconds there, while on the CPU
  its normal_ runs on one thread, about 0.2 G values/s: 3 minutes for the 35 G parameters however
  many cores), then the modules mapped to "cpu" move to host memory (about 50 GiB at 15 GiB, of 128
  GiB) and each of the 7 forwards copies them to the GPU again: seconds each at pageable PCIe
  rates. `--floor-layers A B` measures two reduced depths instead and extrapolates linearly in
  layers (less host memory): a d-layer model's cap is the budget less (1 - d/40) of the bytes of
  the layers the full model keeps on the GPU, so the same fraction of its layers' weights is there,
  up to whole layers (`gpu_layers` per depth against `full_model_gpu_layers`).
Results are rewritten to --out after every run, so a partial run still reports.
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import importlib.util
import json
import os
import time
from contextlib import contextmanager
from functools import partial
from pathlib import Path

import numpy as np
import psutil
import torch

from ninfer_offload.artifact.inventory import Inventory
from ninfer_offload.planner import PlanOptions, plan
from ninfer_offload.planner.routing import shipped_routing_stats
from ninfer_offload.planner.trace import belady_hit_rate, routing_trace
from ninfer_offload.profiles import load_profile
from ninfer_offload.profiles.detect import measure_bandwidths
from ninfer_offload.runtime.engine import Engine
from ninfer_offload.runtime.decoder import queue_greedy_step
from ninfer_offload.runtime.session import Session
from hf_baseline import depth_method, full_depth_seconds, import_torch_kernels, random_model
from profiling import kernels_by_launch, stream_timeline
from provenance import gpu_report_header
import vram

GiB = 2**30
PROMPT_TOKENS = 64
PREFILL_TOKENS = 4096
FLOOR_WARMUP = 2  # accelerate floor: decode steps before timing


def artifact_files(path: Path) -> list[Path]:
    return [path] + sorted(path.parent.glob(path.name + ".part*"))


def drop_page_cache(path: Path) -> None:
    """Evict the artifact's pages from the page cache, so the next read comes from the disk."""
    for name in artifact_files(path):
        fd = os.open(name, os.O_RDONLY)
        try:
            os.fsync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def file_read_seconds(path: Path) -> float:
    """Seconds to read every file of the artifact once from the disk (16 MiB reads)."""
    drop_page_cache(path)
    began = time.perf_counter()
    for name in artifact_files(path):
        with open(name, "rb", buffering=0) as f:
            while f.read(1 << 24):
                pass
    return time.perf_counter() - began


def load(path: Path, cold: bool = True, **options) -> tuple[Engine, float]:
    """An engine loaded (from a cold page cache unless `cold` is False), and the seconds until it was ready."""
    if cold:
        drop_page_cache(path)
    began = time.perf_counter()
    engine = Engine.load(path, device="cuda", spec="none", **options)
    torch.cuda.synchronize()
    return engine, time.perf_counter() - began


DECODE_WINDOWS = 2  # timed windows per decode, the fastest counts: single windows of one configuration differed by up to 8 %
# within one process at 9ffd112 (259 against 276 and 281 tok/s), more than most changes measured with them


def window_start(warmup: int, steps: int, window: int) -> int:
    """First trace token of decode window `window` (after the prompt and the warm-up steps)."""
    return PROMPT_TOKENS + warmup + window * steps


class TraceRun:
    """Replays one routing trace through an engine: prompt, decode steps, a 4K prefill."""

    def __init__(self, trace: np.ndarray, device: torch.device):
        self.trace = torch.from_numpy(trace.astype(np.int64)).to(device)  # [tokens, layers, k]
        self.layers = trace.shape[1]

    def rows(self, engine: Engine, start: int, count: int) -> None:
        """Route the next forward's `count` tokens as trace tokens start..start+count-1."""
        routing = self.trace[start : start + count].transpose(0, 1)  # [layers, count, k]
        extra = len(engine.store.layouts) - self.layers  # the MTP layer, if loaded, keeps its own ids
        if extra:
            routing = torch.cat([routing, routing[-extra:]])
        engine.store.replay_routing(routing)

    def decode(self, engine: Engine, warmup: int, steps: int) -> tuple[float, dict, int]:
        """(seconds per step, store stats, window index) of the fastest of DECODE_WINDOWS consecutive windows of
        `steps` greedy steps, after `warmup` ones (window w replays trace tokens from `window_start(warmup, steps, w)`)."""
        session, token = self._prompted(engine)
        token = self._steps(engine, session, token, warmup)
        timed = []
        for _ in range(DECODE_WINDOWS):
            before = engine.store.stats.to_json() if engine.store.offloaded else None
            torch.cuda.synchronize()
            began = time.perf_counter()
            token = self._steps(engine, session, token, steps)
            elapsed = time.perf_counter() - began
            stats = engine.store.stats.to_json() if engine.store.offloaded else None
            timed.append((elapsed / steps, _difference(stats, before)))
        session.close()
        window = min(range(DECODE_WINDOWS), key=lambda w: timed[w][0])
        return *timed[window], window

    def decode_profiled(self, engine: Engine, warmup: int, steps: int, trace: Path | None = None) -> dict:
        """`profiling.stream_timeline` of `steps` greedy steps after `warmup` ones (its Chrome trace kept at
        `trace`, if given): where a step's wall time goes besides the device's work."""
        session, token = self._prompted(engine)
        token = self._steps(engine, session, token, warmup)
        timeline = stream_timeline(partial(self._steps, engine, session, token, steps), trace)
        session.close()
        return {"steps": steps, **timeline}

    def decode_kernels(self, engine: Engine, warmup: int, steps: int) -> list[dict]:
        """`profiling.kernels_by_launch` of `steps` greedy steps after `warmup` ones, microseconds and launches per step."""
        session, token = self._prompted(engine)
        token = self._steps(engine, session, token, warmup)
        rows = kernels_by_launch(partial(self._steps, engine, session, token, steps), repeats=1)
        session.close()
        return [{**row, "us": row["us"] / steps, "launches": row["launches"] / steps} for row in rows]

    def _prompted(self, engine: Engine) -> tuple[Session, int]:
        """A session after its PROMPT_TOKENS-token prompt, and its greedy next token."""
        self.rows(engine, 0, PREFILL_TOKENS)  # sizes the replay buffer for the 4K prefill
        session = engine.session()
        self.rows(engine, 0, PROMPT_TOKENS)
        return session, int(session.prefill(list(range(1, PROMPT_TOKENS + 1))).argmax())

    def _steps(self, engine: Engine, session: Session, token: int, count: int) -> int:
        """`count` greedy steps from `token` (trace tokens after the session's length) as `generate` runs them:
        each step takes the previous step's argmax on the device and is queued before the host reads that
        token (`queue_greedy_step`); the last token."""
        picked, queued = torch.tensor([token], device=engine.device), None
        for _ in range(count):
            self.rows(engine, session.length, 1)
            following = queue_greedy_step(engine, [session], picked if queued is None else queued.device)
            if queued is not None:
                queued.read()
            queued = following
        return token if queued is None else queued.read()[0]

    def prefill(self, engine: Engine, offset: int, repeats: int = 2, tokens: int = PREFILL_TOKENS) -> float:
        """Seconds of a fresh `tokens`-token prefill, forward by forward (`Engine.prefill_span` tokens each: chunks,
        or spans of chunks with host experts; trace tokens from `offset`): the fastest of `repeats`. Single prefills
        vary: after a warm-up one, runs at 4c454ed, 98e0c39 and 2d78901 measured the resident 4K prefill at 14.2K,
        26.8K and 16.4K tok/s, which moved the roofline (the larger of that time and the PCIe time) and so the
        offloaded fraction."""
        ids = list(np.random.default_rng(0).integers(1, 500, tokens))
        best = float("inf")
        for _ in range(repeats):
            session = engine.session()
            torch.cuda.synchronize()
            began = time.perf_counter()
            forward = engine.prefill_span
            for c0 in range(0, tokens, forward):
                self.rows(engine, offset + c0, min(forward, tokens - c0))
                session.prefill(ids[c0 : c0 + forward])
            torch.cuda.synchronize()
            best = min(best, time.perf_counter() - began)
            session.close()
        return best

    def prefill_profiled(self, engine: Engine, offset: int, trace: Path | None = None) -> tuple[float, dict]:
        """`prefill` (the faster of two), and one more prefill under the profiler (`profiling.stream_timeline`;
        its Chrome trace kept at `trace`, if given)."""
        return self.prefill(engine, offset), stream_timeline(partial(self.prefill, engine, offset, repeats=1), trace)


# The prefill settings the benchmark compares with the engine's: attributes of the store's `PrefillStaging`
# ("staging") or of the engine's step runner ("engine"). A smaller `prefill_chunk` is set on the loaded engine (its plan set
# aside the default chunk's activations, which holds them).
PREFILL_VARIANTS = {
    "gather on 64 programs": ("staging", {"gather_programs": 64}),
    "chunks of 2048 tokens": ("engine", {"prefill_chunk": 2048}),
}
# The decode settings compared with the cache's: most promotions per step boundary (`ExpertCache.limit`). Each
# runs right after the default decode, from the cache it left. (Not 0: the variant replays the same trace
# tokens, so a frozen cache already holds what they use; 5dd43fb measured 0.989 hits that way.)
DECODE_VARIANTS = {"promotions at most 8 per step": {"limit": 8}}
VARIANT_CHUNKS = sorted({s["prefill_chunk"] for target, s in PREFILL_VARIANTS.values() if "prefill_chunk" in s})


@contextmanager
def applied(owner, settings: dict):
    """`owner`'s attributes set to `settings` inside the block, restored after it."""
    defaults = {key: getattr(owner, key) for key in settings}
    for key, value in settings.items():
        setattr(owner, key, value)
    try:
        yield
    finally:
        for key, value in defaults.items():
            setattr(owner, key, value)


def step_time_ratio(seconds: float, resident_step: float, pcie_bytes_per_token: float, h2d: float) -> float:
    """An offloaded decode step of `seconds` against the resident step plus its miss bytes over H2D."""
    return seconds / (resident_step + pcie_bytes_per_token / h2d)


def roofline_fraction(seconds: float, resident_tok_s: float, pcie_bytes: int, h2d: float, tokens: int = PREFILL_TOKENS) -> float:
    """A prefill of `tokens` tokens in `seconds` against its roofline: the larger of the resident prefill's time and the
    PCIe time."""
    return max(tokens / resident_tok_s, pcie_bytes / h2d) / seconds


def resident_prefill_by_chunk(runner: TraceRun, resident: Engine, offset: int, default_s: float) -> dict[int, float]:
    """Resident 4K prefill tok/s at the engine's chunk size (`default_s` seconds) and at each of VARIANT_CHUNKS."""
    by_chunk = {resident.prefill_chunk: PREFILL_TOKENS / default_s}
    for chunk in VARIANT_CHUNKS:
        with applied(resident.runner, {"prefill_chunk": chunk}):
            by_chunk[chunk] = PREFILL_TOKENS / runner.prefill(resident, offset)
    return by_chunk


def prefill_variants(
    runner: TraceRun, engine: Engine, trace: np.ndarray, offset: int, resident_by_chunk: dict, h2d: float, traces: Path | None
) -> list[dict]:
    """The 4K prefill (`TraceRun.prefill_profiled`) with each of PREFILL_VARIANTS' settings, its distinct host
    bytes per chunk and its fraction of the roofline (the resident prefill at the same chunk size); the
    profiled prefills' Chrome traces under `traces`, if given."""
    results = []
    for name, (target, settings) in PREFILL_VARIANTS.items():
        with applied(engine.store.staging if target == "staging" else engine.runner, settings):
            keep = traces / f"{'_'.join(name.split())}.json.gz" if traces is not None else None
            seconds, streams = runner.prefill_profiled(engine, offset, keep)
            pcie = prefill_pcie_bytes(engine, trace, offset)
            fraction = roofline_fraction(seconds, resident_by_chunk[engine.prefill_chunk], pcie, h2d)
        results.append({
            "variant": name, "settings": {key: str(value) for key, value in settings.items()},
            "prefill_4k_tok_s": PREFILL_TOKENS / seconds, "prefill_pcie_bytes": pcie, "prefill_roofline_fraction": fraction,
            "streams": streams,
        })
        print(f"prefill, {name}: {PREFILL_TOKENS / seconds:,.0f} tok/s", flush=True)
    return results


def decode_variants(runner: TraceRun, engine: Engine, warmup: int, steps: int, resident_step: float, h2d: float) -> list[dict]:
    """Decode (`TraceRun.decode`) with each of DECODE_VARIANTS' cache settings: tok/s, the step time ratio, hit rate, PCIe
    bytes and promotions per token."""
    results = []
    for name, settings in DECODE_VARIANTS.items():
        with applied(engine.store.cache, settings):
            seconds, stats, _ = runner.decode(engine, warmup, steps)
        results.append({
            "variant": name, "settings": settings, "decode_tok_s": 1 / seconds,
            "step_time_ratio": step_time_ratio(seconds, resident_step, stats["pcie_bytes_per_token"], h2d), "hit_rate": stats["hit_rate"],
            "pcie_bytes_per_token": stats["pcie_bytes_per_token"], "promotions_per_token": stats["promotions_per_token"],
        })
        print(f"decode, {name}: {1 / seconds:.1f} tok/s, hit rate {stats['hit_rate']:.3f}", flush=True)
    return results


def _difference(after: dict | None, before: dict | None) -> dict:
    if after is None:
        return {
            "hit_rate": 1.0, "pcie_bytes_per_token": 0, "promotions_per_token": 0.0, "tokens": 0, "cpu_assignments": 0,
            "pcie_bytes_per_step": 0, "cpu_assignments_per_step": 0.0,
        }
    tokens, steps = after["tokens"] - before["tokens"], max(after["steps"] - before["steps"], 1)
    uses = after["uses"] - before["uses"]
    return {
        "hit_rate": (after["hits"] - before["hits"]) / uses if uses else 1.0,
        "pcie_bytes_per_token": (after["pcie_bytes"] - before["pcie_bytes"]) / max(tokens, 1),
        "promotions_per_token": (after["promotions"] - before["promotions"]) / max(tokens, 1),
        "tokens": tokens,
        "cpu_assignments": after["cpu_assignments"] - before["cpu_assignments"],
        "pcie_bytes_per_step": (after["pcie_bytes"] - before["pcie_bytes"]) / steps,
        "cpu_assignments_per_step": (after["cpu_assignments"] - before["cpu_assignments"]) / steps,
    }


def prefill_pcie_bytes(engine: Engine, trace: np.ndarray, offset: int, tokens: int = PREFILL_TOKENS) -> int:
    """Bytes of the distinct experts not in VRAM that each forward of a `tokens`-token prefill needs (a chunk, or a span
    of chunks with host experts: `Engine.prefill_span`), summed over forwards."""
    in_vram = engine.store.cache.in_vram if engine.store.offloaded else engine.store.pinned
    total, forward = 0, engine.prefill_span
    for c0 in range(0, tokens, forward):
        chunk = trace[offset + c0 : offset + c0 + min(forward, tokens - c0)]
        for layer in range(trace.shape[1]):
            needed = np.unique(chunk[:, layer])
            total += int((~in_vram[layer, needed]).sum()) * engine.store.layouts[layer].nbytes
    return total


def logits_equal(engine: Engine, reference: torch.Tensor, ids: list[int]) -> bool:
    engine.store.replayed = None
    return bool(torch.equal(engine.logits(ids), reference))


def planned_decode(engine: Engine, inventory: Inventory, profile: str, miss_path: str) -> float | None:
    """The planner's decode tokens/s for the engine's plan with `miss_path`."""
    placement = engine.expert_plan.plan
    if placement is None:
        return None
    options = dataclasses.replace(placement.options, miss_path=miss_path)
    return plan(inventory, load_profile(profile), options).predicted.decode_tok_s


def release(engine: Engine) -> None:
    engine.close()
    del engine
    gc.collect()
    torch.cuda.empty_cache()
    getattr(torch._C, "_host_emptyCache", lambda: None)()  # give the pinned pool back to the OS


def auto_device_map(model: torch.nn.Module, gpu_bytes: int | None) -> dict:
    """accelerate's device map of `model` for `gpu_bytes` of GPU 0 (None: no GPU) and the free host memory."""
    from accelerate import infer_auto_device_map

    max_memory = {"cpu": psutil.virtual_memory().available} | ({} if gpu_bytes is None else {0: gpu_bytes})
    return infer_auto_device_map(model, max_memory=max_memory, no_split_module_classes=list(model._no_split_modules), dtype=torch.bfloat16)


def full_model_gpu_layers(config: dict, budget: int) -> dict[str, int]:
    """Name -> bytes of the decoder layers accelerate puts on GPU 0 for the full model at `budget` (sized on the meta device)."""
    from accelerate.utils import compute_module_sizes

    model = random_model(config, config["num_hidden_layers"], "meta")
    sizes = compute_module_sizes(model, dtype=torch.bfloat16)
    return {name: sizes[name] for name, where in auto_device_map(model, budget).items() if where == 0 and name.startswith("model.layers.")}


def offloaded_model(config: dict, depth: int, gpu_bytes: int | None, device: str) -> torch.nn.Module:
    """The `depth`-layer model dispatched by accelerate for `gpu_bytes` of GPU 0 (None, device "cpu": all on the CPU)."""
    from accelerate import dispatch_model

    model = random_model(config, depth, device)
    device_map = auto_device_map(model, gpu_bytes)
    for name, where in device_map.items():
        if where == "cpu":  # dispatch_model offloads the weights where they lie: host memory, as from_pretrained leaves them
            model.get_submodule(name).to("cpu")
    if device == "cuda":
        torch.cuda.empty_cache()
    return dispatch_model(model, device_map, skip_keys=list(model._skip_keys_device_placement))


@torch.no_grad()
def greedy_step_seconds(model: torch.nn.Module, device: str, warmup: int, steps: int) -> float:
    """Seconds per greedy step of `model` after a PROMPT_TOKENS-token prompt and `warmup` steps (each step reads its token)."""
    from transformers import DynamicCache

    cache = DynamicCache(config=model.config)

    def forward(ids: list[int]) -> int:
        logits = model(torch.tensor([ids], device=device), past_key_values=cache, use_cache=True).logits
        return int(logits[0, -1].argmax())

    token = forward(list(range(1, PROMPT_TOKENS + 1)))
    for _ in range(warmup):
        token = forward([token])
    if device == "cuda":
        torch.cuda.synchronize()
    began = time.perf_counter()
    for _ in range(steps):
        token = forward([token])
    return (time.perf_counter() - began) / steps


def accelerate_floor(config: dict, budget: int, depths: tuple[int, ...], steps: int, device: str = "cuda") -> dict:
    """Decode tokens/s of transformers + accelerate offload at `budget` bytes of GPU 0 (the module docstring's floor)."""
    import accelerate
    import transformers

    full = config["num_hidden_layers"]
    # accelerate fills GPU 0 in module order with room kept for the largest layer it copies in; the
    # embedding, the head and that room do not shrink with depth, only the layers' share does: a
    # d-layer model's cap is the budget less (1 - d/full) of the bytes of the layers the full model
    # keeps on GPU 0, so d/full of those bytes remain, the full model's fraction of its layers' weights.
    full_gpu = full_model_gpu_layers(config, budget) if device == "cuda" else {}
    share = sum(full_gpu.values())
    measured = {}
    for depth in depths:
        cap = budget - round(share * (1 - depth / full))
        model = offloaded_model(config, depth, cap if device == "cuda" else None, device)
        on_gpu = sum(next(layer.parameters()).device.type == "cuda" for layer in model.model.layers)
        if device == "cuda":
            torch.cuda.reset_peak_memory_stats()
        seconds = greedy_step_seconds(model, device, FLOOR_WARMUP, steps)
        peak = torch.cuda.max_memory_allocated() if device == "cuda" else 0
        measured[depth] = {"gpu_cap_bytes": cap, "gpu_layers": on_gpu, "step_s": seconds, "peak_vram_bytes": peak}
        del model
        gc.collect()
        if device == "cuda":
            torch.cuda.empty_cache()
    step = full_depth_seconds({d: m["step_s"] for d, m in measured.items()}, full)
    return {
        "vram_budget_bytes": budget,
        "depths": list(depths),
        "method": depth_method(depths, full),
        "extrapolated": depths != (full,),
        "decode_tok_s": 1 / step,
        "tokens": steps,
        "warmup": FLOOR_WARMUP,
        "prompt_tokens": PROMPT_TOKENS,
        "full_model_gpu_layers": len(full_gpu),
        "measured": {str(d): m for d, m in measured.items()},
        "gdn": "transformers' PyTorch path (flash-linear-attention and causal-conv1d hidden)",
        "transformers": transformers.__version__,
        "accelerate": accelerate.__version__,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("artifact", type=Path)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--budgets", type=float, nargs="+", default=[12, 15, 20, 24], help="VRAM budgets in GiB")
    parser.add_argument("--tokens", type=int, default=256, help="timed decode steps per run")
    parser.add_argument("--warmup", type=int, default=256, help="decode steps before timing (the cache and Belady warm up on them)")
    parser.add_argument("--seed", type=int, default=0, help="trace seed")
    parser.add_argument("--policy", default="decayed")
    parser.add_argument("--profile", default="h200", help="profile the budgets are planned with")
    parser.add_argument(
        "--miss-paths", nargs="*", default=[], choices=["pcie", "cpu", "auto"],
        help="also decode with these miss paths at the first budget, each loaded the same way (pcie: again, beside the others)",
    )
    parser.add_argument(
        "--miss-path-loads", type=int, default=1,
        help="load each miss path this many times, in turn (pcie cpu auto pcie cpu auto ...); each path's best load counts",
    )
    parser.add_argument("--skip-accelerate", action="store_true", help="leave out the transformers + accelerate offload floor")
    parser.add_argument("--floor-budget", type=float, default=None, help="GiB of GPU 0 for the floor (default: the first budget)")
    parser.add_argument(
        "--floor-layers", type=int, nargs=2, default=None, metavar=("A", "B"),
        help="floor at two reduced depths, extrapolated to the full model (default: the full model)",
    )
    parser.add_argument("--floor-tokens", type=int, default=4, help="timed decode steps of the floor")
    parser.add_argument("--commit", default=None, help="commit measured (the device copy has no git metadata)")
    parser.add_argument("--trace-dir", type=Path, default=None, help="keep the profiled prefills' Chrome traces here (gzipped)")
    parser.add_argument(
        "--kernel-steps", type=int, default=0,
        help="also profile this many decode steps' kernels by launch shape, resident and at the first budget (`decode_kernels`)",
    )
    args = parser.parse_args()
    if args.floor_layers and args.floor_layers[0] == args.floor_layers[1]:
        parser.error("--floor-layers takes two different depths")
    missing = [name for name in ("accelerate", "transformers") if not args.skip_accelerate and importlib.util.find_spec(name) is None]
    if missing:  # now rather than after the engine runs
        parser.error(f"the accelerate floor needs {' and '.join(missing)} (or pass --skip-accelerate)")

    hits = np.array(shipped_routing_stats().hits)
    prefill_offset = window_start(args.warmup, args.tokens, DECODE_WINDOWS)  # the prefills' trace tokens follow the decode's
    length = prefill_offset + PREFILL_TOKENS
    trace = routing_trace(hits, 8, length, args.seed)
    device = torch.device("cuda")
    bandwidths = measure_bandwidths()
    h2d = bandwidths["h2d_bandwidth_gbs"] * 1e9
    report = {
        **gpu_report_header(args.commit),
        "h2d_bandwidth_gbs": bandwidths["h2d_bandwidth_gbs"],
        "device_copy_gbs": bandwidths["device_copy_gbs"],
        "trace": {"seed": args.seed, "tokens": length, "generator": "planner.trace.routing_trace (shipped counts)"},
        "policy": args.policy,
        "pytorch_cuda_alloc_conf": os.environ.get("PYTORCH_CUDA_ALLOC_CONF"),  # e.g. pinned_use_cuda_host_register (pinning speed)
        "file_read_s": file_read_seconds(args.artifact),
        "runs": [],
        "miss_paths": [],
    }

    def save() -> None:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(report, indent=2) + "\n")

    runner = TraceRun(trace, device)
    check_ids = list(range(3, 3 + 24))
    began = time.perf_counter()  # what the first load of a process also imports: the Triton kernels, flash-linear-attention
    from ninfer_offload.kernels.backend import TritonBackend

    report["imports"] = {"flash_linear_attention": TritonBackend().fla, "seconds": time.perf_counter() - began}
    resident, resident_ready = load(args.artifact, experts="resident")
    reference = resident.logits(check_ids)
    config = resident.artifact.components["text"].config
    step, _, _ = runner.decode(resident, args.warmup, args.tokens)
    runner.prefill(resident, prefill_offset)  # compiles and tunes the prefill kernels
    traces = args.trace_dir
    prefill, resident_streams = runner.prefill_profiled(resident, prefill_offset, traces and traces / "resident.json.gz")
    resident_by_chunk = resident_prefill_by_chunk(runner, resident, prefill_offset, prefill)
    report["resident"] = {
        "decode_tok_s": 1 / step, "step_s": step, "prefill_4k_tok_s": PREFILL_TOKENS / prefill, "time_to_ready_s": resident_ready,
        "load_seconds": resident.load_seconds,
        "prefill_streams": resident_streams, "prefill_4k_tok_s_by_chunk": {str(c): v for c, v in resident_by_chunk.items()},
        "decode_kernels": runner.decode_kernels(resident, args.warmup, args.kernel_steps) if args.kernel_steps else None,
    }
    save()
    release(resident)
    del resident
    inventory = None
    for budget_gib in args.budgets:
        budget = int(budget_gib * GiB)
        vram.start()
        engine, ready = load(args.artifact, profile=args.profile, vram_budget=budget, cache_policy=args.policy)
        equal = logits_equal(engine, reference, check_ids)
        seconds, stats, window = runner.decode(engine, args.warmup, args.tokens)
        start = window_start(args.warmup, args.tokens, window)  # Belady warms up on what came before, as the cache does
        first = budget_gib == args.budgets[0]  # the variants and profiles: at the first budget only
        decodes = decode_variants(runner, engine, args.warmup, args.tokens, report["resident"]["step_s"], h2d) if first else []
        capacity = sum(map(len, engine.expert_plan.placement.pinned[: trace.shape[1]])) + engine.store.cache_slots
        pcie = prefill_pcie_bytes(engine, trace, prefill_offset)
        moved = engine.store.stats.pcie_bytes
        budget_traces = traces and traces / f"{budget_gib:g}gib"
        if first:
            prefill_s, streams = runner.prefill_profiled(engine, prefill_offset, budget_traces and budget_traces / "default.json.gz")
        else:
            prefill_s, streams = runner.prefill(engine, prefill_offset, repeats=3), None  # (no warm-up prefill before)
        moved = (engine.store.stats.pcie_bytes - moved) // 3  # three prefills either way
        staged = first and engine.store.staging is not None
        variants = prefill_variants(runner, engine, trace, prefill_offset, resident_by_chunk, h2d, budget_traces) if staged else []
        inventory = inventory or Inventory.from_artifact(engine.artifact)
        placement = engine.expert_plan.plan
        options = placement.options if placement is not None else PlanOptions(speculative="none", max_context=engine.max_context)
        projections = {
            name: plan(inventory, load_profile(name), options).predicted.decode_tok_s for name in ("rtx5060ti", "rtx5090")
        }
        run = {
            "vram_budget_bytes": budget,
            "routing": "trace",
            "experts_in_vram": capacity,
            "cache_slots": engine.store.cache_slots,
            "decode_tok_s": 1 / seconds,
            "step_s": seconds,
            "step_time_ratio": step_time_ratio(seconds, report["resident"]["step_s"], stats["pcie_bytes_per_token"], h2d),
            "hit_rate": stats["hit_rate"],
            "belady_hit_rate": belady_hit_rate(trace[: start + args.tokens], capacity, engine.config.num_experts, start),
            "pcie_bytes_per_token": stats["pcie_bytes_per_token"],
            "promotions_per_token": stats["promotions_per_token"],
            "decode_variants": decodes,  # the same decode with other cache settings, for comparison
            "decode_kernels": runner.decode_kernels(engine, args.warmup, args.kernel_steps) if first and args.kernel_steps else None,
            "planner_decode_tok_s": placement.predicted.decode_tok_s if placement is not None else None,
            "planner_prefill_tok_s": placement.predicted.prefill_tok_s if placement is not None else None,
            "prefill_4k_tok_s": PREFILL_TOKENS / prefill_s,
            "prefill_pcie_bytes": pcie,
            "prefill_moved_bytes": moved,  # what the engine read over PCIe per prefill: staged records, reads
            "prefill_streams": streams,  # one more prefill, profiled: busy time per stream, their overlap, host syncs
            "prefill_roofline_fraction": roofline_fraction(prefill_s, report["resident"]["prefill_4k_tok_s"], pcie, h2d),
            "prefill_variants": variants,  # the same prefill with other staging settings, for comparison
            "time_to_ready_s": ready,
            "time_to_ready_ratio": ready / report["file_read_s"],
            "load_seconds": engine.load_seconds,  # the load's phases (`LoadedModel.load_seconds`)
            "vram_allocated_bytes": torch.cuda.memory_allocated(),
            **vram.against_plan(placement.vram_used_bytes if placement is not None else None),
            "projected_decode_tok_s": projections,
            "logits_equal_resident": equal,
            "placement": engine.placement_report(),
        }
        report["runs"].append(run)
        save()
        print(
            f"{budget_gib:g} GiB: decode {run['decode_tok_s']:.1f} tok/s (planner {run['planner_decode_tok_s']:.1f}), step ratio "
            f"{run['step_time_ratio']:.3f}, hits {run['hit_rate']:.3f} (Belady {run['belady_hit_rate']:.3f}), 4K prefill "
            f"{run['prefill_4k_tok_s']:,.0f} tok/s ({run['prefill_roofline_fraction']:.3f} of its roofline), ready "
            f"{run['time_to_ready_ratio']:.2f}x the file read", flush=True,
        )
        release(engine)
    pcie = next(run["decode_tok_s"] for run in report["runs"]) if report["runs"] else None
    for miss_path in args.miss_paths * args.miss_path_loads:  # the first budget's steps; "auto" runs its trials in the warm-up
        # (its time to ready is not reported: no need to read the file from the disk again), decoded like the budget runs.
        engine, _ = load(
            args.artifact, cold=False, profile=args.profile, vram_budget=int(args.budgets[0] * GiB),
            miss_path=None if miss_path == "pcie" else miss_path,
        )
        seconds, stats, _ = runner.decode(engine, args.warmup, args.tokens)
        keep = args.trace_dir / "miss_paths" / f"{miss_path}_decode.json.gz" if args.trace_dir is not None else None
        streams = runner.decode_profiled(engine, 8, 32, keep)
        report["miss_paths"].append({
            "vram_budget_bytes": int(args.budgets[0] * GiB), "miss_path": miss_path, "decode_tok_s": 1 / seconds,
            "pcie_decode_tok_s": pcie, "hit_rate": stats["hit_rate"], "pcie_bytes_per_token": stats["pcie_bytes_per_token"],
            "cpu_assignments_per_token": stats["cpu_assignments"] / max(stats["tokens"], 1), "graphs": engine.graphs is not None,
            "pcie_bytes_per_step": stats["pcie_bytes_per_step"], "cpu_assignments_per_step": stats["cpu_assignments_per_step"],
            "planner_decode_tok_s": planned_decode(engine, inventory or Inventory.from_artifact(engine.artifact), args.profile, miss_path),
            "cpu": engine.store.stats.miss_path, "decode_streams": streams,
        })
        save()
        print(f"miss path {miss_path}: decode {1 / seconds:.1f} tok/s", flush=True)
        release(engine)
    by_path: dict[str, float] = {}  # each path's best load (loads of one engine differ by up to 7 %: 23eb0a6)
    for entry in report["miss_paths"]:
        by_path[entry["miss_path"]] = max(by_path.get(entry["miss_path"], 0.0), entry["decode_tok_s"])
    pcie = by_path.get("pcie", pcie)  # loaded and timed like the others, when measured among them
    if "auto" in by_path and pcie is not None:  # "auto" must not be slower than the better pure path
        best = max(pcie, by_path.get("cpu", 0.0))
        report["auto_vs_best_pure_path"] = by_path["auto"] / best
        save()
    if not args.skip_accelerate:
        import_torch_kernels()  # transformers is imported only now, after the engine runs
        budget = int((args.floor_budget or args.budgets[0]) * GiB)
        depths = tuple(args.floor_layers or (config["num_hidden_layers"],))
        floor = report["accelerate_floor"] = accelerate_floor(config, budget, depths, args.floor_tokens)
        for run in report["runs"]:
            if run["vram_budget_bytes"] == budget:
                run["speedup_vs_accelerate"] = run["decode_tok_s"] / floor["decode_tok_s"]
        save()
        speedups = ", ".join(f"x{run['speedup_vs_accelerate']:.0f}" for run in report["runs"] if "speedup_vs_accelerate" in run)
        print(f"accelerate floor @{budget / GiB:g} GiB: {floor['decode_tok_s']:.3f} tok/s ({floor['method']}), "
              f"engine {speedups or 'not run at this budget'}", flush=True)


if __name__ == "__main__":
    main()
