"""A/B of decode-step variants on one resident load: a one-token step, a verification of K drafts and a
batched step, with module-level kernel settings changed per variant (graphs recaptured for each).

    python bench/make_synthetic.py /tmp/q36.ninfer
    python bench/step_ab.py /tmp/q36.ninfer --out ab.json \\
        --variant no_tensor_cores quant_linear.MMA_MIN_ROWS=2**40 --variant unfolded moe.FOLD_SHARED_EXPERT=False

Every variant, the baseline (`current`, the settings as shipped) first, is measured on the same sessions
(`--batch` sequences of `--context` tokens; the first also steps alone and verifies): `step_ms` (one
token), `verify_ms` (K + 1 tokens, then the commit of the first, as a rejected round pays),
`batch_ms` (each the median of `--repeats` timed runs, all of them in `step_ms_runs` etc.: their spread is the noise
a difference must exceed), and their ratios to the variant's own one-token step; with `--profile`, each run's kernels by launch
shape (which product a launch is: `profiling.kernels_by_launch`). A setting is `MODULE.NAME=EXPRESSION` (`kernel_settings`),
MODULE one of `ninfer_offload.kernels`' modules, EXPRESSION evaluated with those modules in scope
(e.g. `moe.GEMV_TILES=quant_linear.GemvTiles(8,2048,4,3)`); each is restored after its variant. The verification feeds one token
K + 1 times, so with the random weights' own routing its tokens share their experts; `--routing trace` routes every
forward by the calibrated trace instead (`trace_routing.TraceRouting`, as `bench/spec.py` does: a verification then
reads ~2.4x one token's experts, a batch's consecutive trace tokens reuse some). `--vram-budget 15` plans the load
for a 15 GiB card (experts past it in host memory, the adaptive cache moving them between steps): the cache's state
drifts from variant to variant, so repeat the baseline as the last variant to see how far.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch

from ninfer_offload.runtime.engine import Engine
from kernel_settings import describe, kernel_modules, parse_setting
from profiling import kernels_by_launch
from provenance import gpu_report_header
from trace_routing import TraceRouting


def run_ms(run, steps: int, repeats: int) -> list[float]:
    """Milliseconds per call of `run`, averaged over `steps` calls, for each of `repeats` timed runs."""
    times = []
    for _ in range(repeats):
        torch.cuda.synchronize()
        began = time.perf_counter()
        for _ in range(steps):
            run()
        torch.cuda.synchronize()
        times.append((time.perf_counter() - began) / steps * 1e3)
    return times


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("artifact", type=Path)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--variant", nargs="+", action="append", default=[], metavar=("NAME", "SETTING"),
                        help="a variant's name and its MODULE.NAME=EXPRESSION settings (repeatable)")
    parser.add_argument("--context", type=int, default=1024)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--draft-tokens", type=int, default=3)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--repeats", type=int, default=3, help="timed runs of --steps calls each; the median is reported, all in *_runs")
    parser.add_argument("--profile", action="store_true",
                        help="also record each variant's kernels by launch shape (profiling.kernels_by_launch)")
    parser.add_argument("--routing", choices=("model", "trace"), default="model",
                        help="the random weights' own routing, or the calibrated trace's (consecutive positions, consecutive trace tokens)")
    parser.add_argument("--vram-budget", type=float, default=None, metavar="GIB",
                        help="plan the load for this VRAM budget (experts past it in host memory); default: everything resident")
    parser.add_argument("--device-profile", default="h200", help="the planner's device profile of a --vram-budget load")
    parser.add_argument("--commit", default=None)
    args = parser.parse_args()
    scope = kernel_modules()
    variants = [("current", [])] + [(v[0], [parse_setting(s, scope) for s in v[1:]]) for v in args.variant]
    report = {**gpu_report_header(args.commit), "context": args.context, "batch": args.batch, "draft_tokens": args.draft_tokens,
              "routing": args.routing, "vram_budget_gib": args.vram_budget, "variants": []}
    profiled = 5 if args.profile else 0  # runs of each kind under the profiler
    grown = len(variants) * 3 * (args.repeats * args.steps + 1 + profiled)  # tokens the variants add to the first session (one per run)
    placement = {} if args.vram_budget is None else {"profile": args.device_profile, "vram_budget": int(args.vram_budget * 2**30)}
    engine = Engine.load(args.artifact, device="cuda", max_context=args.context + grown + 64, max_sequences=args.batch,
                         mtp=True, draft_tokens=args.draft_tokens, spec="none", **placement)
    vocab = engine.config.vocab_size
    sessions = [engine.session() for _ in range(args.batch)]
    for i, session in enumerate(sessions):
        session.prefill(torch.randint(0, vocab, (args.context,), generator=torch.Generator().manual_seed(i)).tolist())
    first, k = sessions[0], args.draft_tokens
    routing = TraceRouting(engine, engine.max_context, max(args.batch, k + 1), args.routing == "trace")

    def step():
        routing.route(first.length, 1)
        first.step(7)

    def verify():
        routing.route(first.length, k + 1)
        engine.step([first], [[7] * (k + 1)])
        first.commit(1)

    def batch():
        routing.route(sessions[-1].length, args.batch)
        engine.step_batch(sessions, [1] * args.batch)

    for name, settings in variants:
        saved = [(module, attr, getattr(module, attr)) for module, attr, _ in settings]
        for module, attr, value in settings:
            setattr(module, attr, value)
        engine.graphs.graphs.clear()  # recaptured with this variant's settings
        for run in (step, verify, batch):
            run()
        point = {"variant": name, "settings": describe(settings)}
        for kind, run in (("step", step), ("verify", verify), ("batch", batch)):
            runs = run_ms(run, args.steps, args.repeats)
            point[f"{kind}_ms"], point[f"{kind}_ms_runs"] = sorted(runs)[len(runs) // 2], runs
        point["verify_step_ratio"] = point["verify_ms"] / point["step_ms"]
        point["batch_step_ratio"] = point["batch_ms"] / point["step_ms"]
        if args.profile:
            runs = (("step", step), ("verify", verify), ("batch", batch))
            point["kernels"] = {name: kernels_by_launch(run, profiled) for name, run in runs}
        report["variants"].append(point)
        args.out.write_text(json.dumps(report, indent=1))
        print(json.dumps({key: value for key, value in point.items() if key != "kernels" and not key.endswith("_runs")}), flush=True)
        for module, attr, value in saved:
            setattr(module, attr, value)


if __name__ == "__main__":
    main()
