"""The offloaded 4K prefill under staging settings, on one CUDA GPU, in one load: a short companion of
`bench/offload.py` (same trace, same prefill) for comparing `PrefillStaging` settings quickly.

    python bench/make_synthetic.py /tmp/q36.ninfer
    python bench/offload_prefill.py /tmp/q36.ninfer --budget 15 --prompts 4096 32768 --out bench/results/offload_prefill_h200.json

It needs the same packages as the engine on the GPU (flash-linear-attention above all: without it the GDN
layers take a slow path and the prefill is compute-bound, which hides what staging does); `bench/gpu_suite.sh`
installs them (`BENCHES=offload_prefill`).

Per prompt length (`--prompts`, default 4K and 32K): the offloaded prefill's tok/s against the resident one's on the same
trace tokens (`resident_ratio`) and against its roofline. Per setting (SETTINGS: attributes of the store's
`PrefillStaging`), at the first prompt length: prefill tok/s (the faster of two,
after one warm-up prefill), the bytes it moved over PCIe, and its fraction of the PCIe part of the
roofline (the distinct host experts' bytes per chunk over a measured H2D copy) and of the whole roofline (the
larger of that and the resident prefill's time, measured first in the same run: `--skip-resident` leaves it
out). At 15 GiB the PCIe part binds (the resident 4K prefill 104 ms against 123 ms of PCIe time at 2ce62ca); at
20 GiB the resident time does (104 ms against 30 ms). The default setting's prefill is also profiled once, its GPU
time by stream in `default_streams`.
"""

from __future__ import annotations

import argparse
import json
from functools import partial
from pathlib import Path

import numpy as np
import torch

from ninfer_offload.planner.routing import shipped_routing_stats
from ninfer_offload.planner.trace import routing_trace
from ninfer_offload.profiles.detect import measure_bandwidths
from offload import GiB, PREFILL_TOKENS, TraceRun, applied, load, prefill_pcie_bytes, release, roofline_fraction
from profiling import stream_timeline
from provenance import gpu_report_header

SETTINGS = {
    "expected uses >= 1, gather on 16 programs (the defaults)": {},
    "expected uses >= 2": {"ahead_min_uses": 2.0},
    "gather on 8 programs": {"gather_programs": 8},
    "gather on 32 programs": {"gather_programs": 32},
    "every host expert the buffer holds (expected uses >= 0)": {"ahead_min_uses": 0.0},
    "no staging (the kernels read host experts over PCIe)": {"ahead_min_uses": float("inf")},
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("artifact", type=Path)
    parser.add_argument("--budget", type=float, default=15.0, help="VRAM budget, GiB (planned for --profile at it)")
    parser.add_argument("--profile", default="auto", help="the card the budget is planned on (default: this GPU's, `--profile auto`)")
    parser.add_argument("--prompts", type=int, nargs="+", default=[PREFILL_TOKENS, 32768], help="prompt lengths; the settings at the first")
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--commit", default=None)
    parser.add_argument("--skip-resident", action="store_true", help="no resident prefill (the whole roofline is then not reported)")
    args = parser.parse_args()
    longest = max(args.prompts)
    trace = routing_trace(np.array(shipped_routing_stats().hits), 8, 2 * longest, args.seed)
    h2d = measure_bandwidths()["h2d_bandwidth_gbs"] * 1e9
    runner = TraceRun(trace, torch.device("cuda"))
    options = {"profile": args.profile, "max_context": longest + 512}
    resident = {} if args.skip_resident else resident_prefill_seconds(args.artifact, runner, args.prompts, options)
    engine, _ = load(args.artifact, cold=False, vram_budget=int(args.budget * GiB), **options)
    report = {**gpu_report_header(args.commit), "h2d_bandwidth_gbs": h2d / 1e9, "vram_budget_bytes": int(args.budget * GiB),
              "profile": args.profile, "prefill_chunk": engine.prefill_chunk, "prefill_span": engine.prefill_span,
              "placement": engine.placement_report(), "prompts": [], "settings": []}

    def save() -> None:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(report, indent=2) + "\n")

    for tokens in args.prompts:
        runner.rows(engine, 0, min(tokens, engine.prefill_span))  # sizes the replay buffer
        runner.prefill(engine, tokens, repeats=1, tokens=tokens)  # compiles and tunes the prefill kernels
        seconds = runner.prefill(engine, tokens, tokens=tokens)
        pcie = prefill_pcie_bytes(engine, trace, tokens, tokens)
        point = {"tokens": tokens, "tok_s": tokens / seconds, "pcie_bytes": pcie, "pcie_roofline_fraction": pcie / h2d / seconds}
        if tokens in resident:
            resident_tok_s = tokens / resident[tokens]
            point |= {"resident_tok_s": resident_tok_s, "resident_ratio": point["tok_s"] / resident_tok_s,
                      "roofline_fraction": roofline_fraction(seconds, resident_tok_s, pcie, h2d, tokens)}
        report["prompts"].append(point)
        save()
        print(f"{tokens}-token prefill at {args.budget:g} GiB: {point['tok_s']:,.0f} tok/s, "
              f"{point['pcie_roofline_fraction']:.3f} of PCIe time, x{point.get('resident_ratio', float('nan')):.2f} resident", flush=True)
    tokens = args.prompts[0]
    pcie = prefill_pcie_bytes(engine, trace, tokens, tokens)
    for name, settings in SETTINGS.items():
        with applied(engine.store.staging, settings):
            moved = engine.store.stats.pcie_bytes
            seconds = runner.prefill(engine, tokens, tokens=tokens)
            moved = (engine.store.stats.pcie_bytes - moved) // 2
            if not settings:
                report["default_streams"] = stream_timeline(partial(runner.prefill, engine, tokens, repeats=1, tokens=tokens))
        fraction = pcie / h2d / seconds
        report["settings"].append({
            "setting": name, "values": {k: str(v) for k, v in settings.items()}, "tokens": tokens, "prefill_tok_s": tokens / seconds,
            "prefill_moved_bytes": moved, "pcie_roofline_fraction": fraction,
            "roofline_fraction": roofline_fraction(seconds, tokens / resident[tokens], pcie, h2d, tokens) if tokens in resident else None,
        })
        save()
        print(f"{name}: {tokens / seconds:,.0f} tok/s, moved {moved / 1e9:.2f} GB, {fraction:.3f} of PCIe time", flush=True)
    engine.close()


def resident_prefill_seconds(artifact: Path, runner: TraceRun, prompts: list[int], options: dict) -> dict[int, float]:
    """The all-resident engine's prefill of each prompt length on the same trace tokens (after a warm-up one)."""
    resident, _ = load(artifact, cold=False, **options)
    seconds = {}
    for tokens in prompts:
        runner.rows(resident, 0, min(tokens, resident.prefill_chunk))
        runner.prefill(resident, tokens, repeats=1, tokens=tokens)
        seconds[tokens] = runner.prefill(resident, tokens, tokens=tokens)
    release(resident)
    return seconds


if __name__ == "__main__":
    main()
