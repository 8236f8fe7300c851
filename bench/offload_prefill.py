"""The offloaded 4K prefill under staging settings, on one CUDA GPU, in one load: a short companion of
`bench/offload.py` (same trace, same prefill) for comparing `PrefillStaging` settings quickly.

    python bench/make_synthetic.py /tmp/q36.ninfer
    python bench/offload_prefill.py /tmp/q36.ninfer --budget 15 --out bench/results/offload_prefill_h200.json

It needs the same packages as the engine on the GPU (flash-linear-attention above all: without it the GDN
layers take a slow path and the prefill is compute-bound, which hides what staging does); `bench/gpu_suite.sh`
installs them (`BENCHES=offload_prefill`).

Per setting (SETTINGS: attributes of the store's `PrefillStaging`): 4K prefill tok/s (the faster of two,
after one warm-up prefill), the bytes it moved over PCIe, and its fraction of the PCIe part of the
roofline (the distinct host experts' bytes per chunk over a measured H2D copy). At 15 GiB that part binds:
the resident 4K prefill measured 41.6K tok/s (98 ms) against 123 ms of PCIe time at 7014fe6.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import numpy as np
import torch

from ninfer_offload.planner.routing import shipped_routing_stats
from ninfer_offload.planner.trace import routing_trace
from ninfer_offload.profiles.detect import measure_bandwidths
from offload import GiB, PREFILL_TOKENS, TraceRun, applied, load, prefill_pcie_bytes
from provenance import gpu_report_header

SETTINGS = {
    "expected uses >= 1, gather on 16 programs (the defaults)": {},
    "expected uses >= 2": {"ahead_min_uses": 2.0},
    "gather on 8 programs": {"gather_programs": 8},
    "gather on 32 programs": {"gather_programs": 32},
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("artifact", type=Path)
    parser.add_argument("--budget", type=float, default=15.0, help="VRAM budget, GiB (the H200 profile planned at it)")
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--commit", default=None)
    args = parser.parse_args()
    trace = routing_trace(np.array(shipped_routing_stats().hits), 8, 2 * PREFILL_TOKENS, args.seed)
    h2d = measure_bandwidths()["h2d_bandwidth_gbs"] * 1e9
    engine, _ = load(args.artifact, cold=False, profile="h200", vram_budget=int(args.budget * GiB))
    runner = TraceRun(trace, torch.device("cuda"))
    runner.rows(engine, 0, PREFILL_TOKENS)  # sizes the replay buffer
    pcie = prefill_pcie_bytes(engine, trace, PREFILL_TOKENS)
    report = {**gpu_report_header(args.commit), "h2d_bandwidth_gbs": h2d / 1e9, "vram_budget_bytes": int(args.budget * GiB),
              "prefill_chunk": engine.prefill_chunk, "prefill_pcie_bytes": pcie, "placement": engine.placement_report(), "settings": []}
    runner.prefill(engine, PREFILL_TOKENS, repeats=1)  # compiles and tunes the prefill kernels
    for name, settings in SETTINGS.items():
        with applied(engine.store.staging, settings):
            moved = engine.store.stats.pcie_bytes
            seconds = runner.prefill(engine, PREFILL_TOKENS)
            moved = (engine.store.stats.pcie_bytes - moved) // 2
        fraction = pcie / h2d / seconds
        report["settings"].append({
            "setting": name, "values": settings, "prefill_4k_tok_s": PREFILL_TOKENS / seconds, "prefill_moved_bytes": moved,
            "pcie_roofline_fraction": fraction,
        })
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(report, indent=2) + "\n")
        print(f"{name}: {PREFILL_TOKENS / seconds:,.0f} tok/s, moved {moved / 1e9:.2f} GB, {fraction:.3f} of PCIe time", flush=True)
    engine.close()


if __name__ == "__main__":
    main()
