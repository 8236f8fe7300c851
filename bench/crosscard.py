"""Check the per-launch cost model across two GPUs: calibrate on one card's results, predict the other's with only
its machine facts (memory bandwidth, tensor rate, PCIe link from its profile), compare with its measurements.

    python bench/crosscard.py --from h100 FILES... --to h200 FILES... --out bench/results/crosscard_h100_to_h200_<commit>.json

The files are `bench/calibrate_launches.py`'s inputs (step_ab, spec, resident results). Cases, where the target's
files measure them: one-token decode at 1K and 32K, 3-draft verification, a batch-8 step, a 4K prefill chunk
(its flops at the calibrated share of tensor throughput) and decode at 15 GiB with trace routing (the target's
resident step as predicted plus the source's measured offload time, scaled by the PCIe links' ratio).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from calibrate_launches import CardRecord, Model, calibrate, read_results
from provenance import git_commit

from ninfer_offload.errors import NinferError
from ninfer_offload.planner.launch_cost import forward_seconds
from ninfer_offload.profiles import DeviceProfile, load_profile

FORWARD_CASES = ("decode 1K", "decode 32K", "verify 3 drafts", "batch 8")
OFFLOAD_CASE = "decode 15 GiB"
RESIDENT_STEP = "decode 1K"


def cases(source: CardRecord, source_profile: DeviceProfile, target: CardRecord, target_profile: DeviceProfile) -> list[dict]:
    """The predicted and measured seconds of every case the target's records measure."""
    model = Model.official()
    constants = calibrate(source, source_profile, model)
    rows = []

    def add(name: str, predicted: float, measured_from: str) -> None:
        measured = target.find(name)
        rows.append({"name": name, "predicted": predicted, "measured": measured.seconds, "unit": "s",
                     "error": predicted / measured.seconds - 1.0, "measured_from": measured_from})

    for name in FORWARD_CASES:
        measured = target.find(name)
        if measured is not None:
            add(name, forward_seconds(model.launches(measured.shape), constants, target_profile), measured.source)
    prefill = next((m for m in target.measured if m.tokens == 4096), None)
    if prefill is not None:
        flops = model.prefill_flops(prefill.tokens, prefill.tokens)
        add(prefill.name, flops / (target_profile.tensor_tflops * 1e12 * constants.prefill_tensor_share), prefill.source)
    offloaded, source_offloaded = target.find(OFFLOAD_CASE), source.find(OFFLOAD_CASE)
    resident, source_resident = target.find(RESIDENT_STEP), source.find(RESIDENT_STEP)
    if offloaded and source_offloaded and resident and source_resident:
        step = forward_seconds(model.launches(resident.shape), constants, target_profile)
        misses = (source_offloaded.seconds - source_resident.seconds) * source_profile.h2d_bandwidth_gbs / target_profile.h2d_bandwidth_gbs
        add(OFFLOAD_CASE, step + misses, offloaded.source)
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--from", dest="source", nargs="+", required=True, help="PROFILE then the calibration card's result files")
    parser.add_argument("--to", dest="target", nargs="+", required=True, help="PROFILE then the predicted card's result files")
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--commit", default=None)
    args = parser.parse_args()
    try:
        source_profile, target_profile = load_profile(args.source[0]), load_profile(args.target[0])
        source_files, target_files = [Path(p) for p in args.source[1:]], [Path(p) for p in args.target[1:]]
        rows = cases(read_results(source_files), source_profile, read_results(target_files), target_profile)
    except NinferError as err:
        print(f"error: {err}", file=sys.stderr)
        raise SystemExit(2) from None
    report = {
        "command": " ".join(["python", f"bench/{Path(sys.argv[0]).name}", *sys.argv[1:]]),
        "commit": args.commit or git_commit(),
        "calibrated_on": source_profile.name,
        "predicted_for": target_profile.name,
        "calibrated_from": [p.name for p in source_files],
        "measured_from": [p.name for p in target_files],
        "note": "the results were recorded at the commits their names carry, not at this file's commit: the model "
        "is checked on the committed runs; pass fresh same-commit files to check it again",
        "cases": rows,
    }
    for row in rows:
        print(f"{row['name']:16s} predicted {row['predicted'] * 1e3:8.2f} ms, measured {row['measured'] * 1e3:8.2f} ms, "
              f"error {row['error']:+.1%}")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=1) + "\n")


if __name__ == "__main__":
    main()
