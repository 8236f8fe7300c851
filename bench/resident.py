"""Resident benchmark on one CUDA GPU: decode and prefill speed against the HBM roofline and transformers.

    python bench/make_synthetic.py /tmp/q36.ninfer
    python bench/resident.py /tmp/q36.ninfer --out bench/results/resident_h200.json

Everything resident (all experts in VRAM), bf16 activations, batch 1. Measured in one run:
* device bandwidth: a 4 GiB device-to-device copy (bytes read + written);
* decode tokens/s after each context length (CUDA-graph step, and the eager step for
  comparison); the roofline of that step: bytes it must read (all non-expert text weights but one
  embedding row, the 8 routed experts of every layer, the KV cache rows, the GDN states read and
  written) / device bandwidth; `roofline_fraction` = measured / roofline tokens/s;
* prefill tokens/s for fresh prompts of each length (one `prefill` call), and its FLOP rate against the
  tensor ceiling of the same chunks (`tensor_ceiling`: cuBLAS bf16 GEMMs of the forward's products, measured
  in the run; `prefill[].tensor_fraction`);
* a per-stage breakdown of one captured decode step (torch profiler kernel times by stage);
* batched decode (`--batches`, default 1 and 8): B sequences stepped together as the server steps them,
  step time and aggregate tokens/s against one sequence's (the server's ceiling), the largest
  batch's stages;
* peak VRAM from before the load (torch's peak allocated plus the CUDA context: `vram.py`) against the planner's
  prediction for the same options (`peak_within_plan`);
* transformers' `Qwen3_5MoeForCausalLM` (bf16, same GPU, its default attention and kernels on
  this image), by default the full 40-layer model (66.6 GiB: it fits an H200; `--hf-layers A B`
  measures two reduced depths and extrapolates instead), decode after the same contexts and
  prefill of the same lengths; `speedup_vs_transformers` per point.
Results are rewritten to --out after every stage, so a partial run still reports.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import time
from pathlib import Path

import torch

from ninfer_offload.artifact.inventory import Inventory
from ninfer_offload.model.nvfp4 import Nvfp4Matrix
from ninfer_offload.model.quant import QuantizedMatrix
from ninfer_offload.planner import PlanOptions, plan
from ninfer_offload.profiles import load_profile
from ninfer_offload.runtime.engine import Engine
from hf_baseline import depth_method, full_depth_seconds, random_model
from profiling import kernel_breakdown
from provenance import gpu_report_header
from tensor_ceiling import ceiling, chunk_sizes, prefill_fraction
import vram



def _bytes(value) -> int:
    if isinstance(value, (QuantizedMatrix, Nvfp4Matrix)):
        return value.data.numel()
    if isinstance(value, torch.Tensor):
        return value.numel() * value.element_size()
    if isinstance(value, (tuple, list)):  # e.g. the parts of a stacked product
        return sum(_bytes(v) for v in value)
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return sum(_bytes(getattr(value, f.name)) for f in dataclasses.fields(value) if f.name not in ("config", "experts"))
    return 0


def decode_bytes(engine: Engine, context: int) -> dict:
    """Bytes one decode token must read at `context` tokens of history (the roofline numerator)."""
    text, c = engine.text, engine.config
    weights = sum(_bytes(layer) for layer in text.layers) + _bytes(text.final_norm) + _bytes(text.head)
    embedding_row = _bytes(text.embedding) // c.vocab_size
    experts = sum(c.top_k * layout.nbytes for layout in engine.store.layouts[: len(text.layers)])
    kv = c.num_attention_layers * 2 * (context + 1) * c.num_kv_heads * c.head_dim * engine.dtype.itemsize
    state = c.num_gdn_layers * 2 * c.linear_num_value_heads * c.linear_key_head_dim * c.linear_value_head_dim * 4
    total = weights + embedding_row + experts + kv + state
    return {"total": total, "dense_weights": weights, "routed_experts": experts, "kv_cache": kv, "gdn_state": state}


def device_bandwidth() -> float:
    src = torch.empty(1 << 32, dtype=torch.uint8, device="cuda").random_()
    dst = torch.empty_like(src)
    for _ in range(3):
        dst.copy_(src)
    times = []
    for _ in range(10):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        dst.copy_(src)
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1e-3)
    del src, dst
    torch.cuda.empty_cache()
    return 2 * (1 << 32) / sorted(times)[len(times) // 2]


def timed(fn, repeats: int) -> float:
    """Median seconds of `fn()` (synchronised)."""
    times = []
    for _ in range(repeats):
        torch.cuda.synchronize()
        began = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        times.append(time.perf_counter() - began)
    return sorted(times)[len(times) // 2]


def random_ids(count: int, vocab: int, seed: int) -> list[int]:
    return torch.randint(0, vocab, (count,), generator=torch.Generator().manual_seed(seed)).tolist()


def bench_engine(engine: Engine, contexts: list[int], prefills: list[int], bandwidth: float, report: dict, save) -> None:
    vocab = engine.config.vocab_size
    report["prefill"] = []
    ceilings: dict[int, dict] = {}
    for length in prefills:
        ids = random_ids(length, vocab, length)
        runs = []
        for _ in range(2):  # the first run compiles and autotunes the kernels for this length
            session = engine.session()
            runs.append(timed(lambda: session.prefill(ids), 1))
            session.close()
        seconds = runs[-1]
        for size in chunk_sizes(length, engine.prefill_chunk) - ceilings.keys():
            ceilings[size] = ceiling(engine.config, size, engine.device)
        report["prefill"].append({
            "tokens": length, "seconds": seconds, "tok_s": length / seconds,
            **prefill_fraction(engine.config, length, engine.prefill_chunk, seconds, ceilings),
        })
        report["tensor_ceiling"] = [ceilings[size] for size in sorted(ceilings)]
        save()
    if prefills:  # where the longest prefill's time goes
        ids = random_ids(max(prefills), vocab, max(prefills))

        def prefill_once() -> None:
            session = engine.session()
            session.prefill(ids)
            session.close()

        stages, kernels, runtime = kernel_breakdown(prefill_once, 1)
        report["prefill_stage_us"], report["prefill_kernels"], report["prefill_runtime_calls"] = stages, kernels[:30], runtime
    report["decode"] = []
    session = engine.session()
    done = 0
    for context in contexts:
        ids = random_ids(context - done, vocab, context)
        for c0 in range(0, len(ids), 8192):
            session.prefill(ids[c0 : c0 + 8192])
        done = context
        eager = timed(lambda: session.append([1]), 5)  # a one-token prefill: the same kernels, eager
        steps = 50
        if context == contexts[0]:
            report["graph_vs_eager_max_rel_diff"] = graph_vs_eager(engine, session, ids)
        session.step(1)  # captures the step's graph on first use
        seconds = timed(lambda: [session.step(1) for _ in range(steps)], 3) / steps
        moved = decode_bytes(engine, session.length)
        roofline = bandwidth / moved["total"]
        point = {"context": context, "tok_s": 1 / seconds, "ms_per_token": seconds * 1e3, "eager_tok_s": 1 / eager,
                 "cuda_graph": engine.graphs is not None,
                 "bytes_per_token": moved, "roofline_tok_s": roofline, "roofline_fraction": (1 / seconds) / roofline,
                 "achieved_GBps": moved["total"] / seconds / 1e9}
        if context == contexts[0] and engine.graphs is not None:
            try:
                report["decode_stage_us"], report["decode_kernels"], _ = kernel_breakdown(lambda: session.step(1), 5)
            except Exception as err:
                report.setdefault("errors", []).append(f"profiler: {err!r}")
        report["decode"].append(point)
        done = session.length
        save()
    session.close()


def bench_batches(engine: Engine, batches: list[int], context: int, report: dict, save) -> None:
    """Batched decode as the server runs it: B sequences of `context` tokens, one `step_batch` per step
    (graph per batch bucket): step time, aggregate tok/s and its ratio to one sequence's, and the
    largest batch's kernels by stage."""
    vocab = engine.config.vocab_size
    report["batched_decode"] = []
    for batch in batches:
        sessions = [engine.session() for _ in range(batch)]
        for i, session in enumerate(sessions):
            session.prefill(random_ids(context, vocab, 1000 + i))
        tokens = [1] * batch
        engine.step_batch(sessions, tokens)  # captures this bucket's graph on first use
        steps = 20
        seconds = timed(lambda: [engine.step_batch(sessions, tokens) for _ in range(steps)], 3) / steps
        point = {"batch": batch, "context": context, "step_ms": seconds * 1e3, "aggregate_tok_s": batch / seconds}
        if batch == max(batches) and engine.graphs is not None:
            point["stage_us"], _, _ = kernel_breakdown(lambda: engine.step_batch(sessions, tokens), 3)
        report["batched_decode"].append(point)
        for session in sessions:
            session.close()
        save()
    single = report["batched_decode"][0]["aggregate_tok_s"]
    for point in report["batched_decode"]:
        point["aggregate_vs_first"] = point["aggregate_tok_s"] / single


def graph_vs_eager(engine: Engine, session, prompt: list[int]) -> float:
    """Largest relative logits difference between the session's steps (captured where graphs apply)
    and eager one-token forwards of a twin session."""
    twin = engine.session()
    for c0 in range(0, len(prompt), 8192):
        twin.prefill(prompt[c0 : c0 + 8192])
    for _ in range(session.length - twin.length):
        twin.append([1])
    worst = 0.0
    for token in (7, 300, 4242):
        a, b = session.step(token), twin.append([token])[0][0].float()
        worst = max(worst, float((a - b).norm() / b.norm()))
    twin.close()
    return worst


def planner_prediction(engine: Engine, max_context: int) -> dict:
    options = PlanOptions(
        max_context=max_context, concurrency=engine.state.sequences, kv_dtype="bf16", speculative="none", proposal_head=False
    )
    placement = plan(Inventory.from_artifact(engine.artifact), load_profile("h200"), options)
    return {"vram_used_bytes": placement.vram_used_bytes, "runtime": placement.runtime, "feasible": placement.feasible,
            "options": options.to_json(), "predicted_decode_tok_s": placement.predicted.decode_tok_s if placement.predicted else None}


def bench_transformers(config: dict, layers: tuple[int, ...], contexts: list[int], prefills: list[int], report: dict, save) -> None:
    """transformers' model at its full depth (one entry in `layers`), or at two reduced depths with the
    full-depth times extrapolated from the per-layer difference (for GPUs the full model does not fit)."""
    full_layers = config["num_hidden_layers"]
    measured: dict[int, dict] = {}
    for depth in layers:
        model = random_model(config, depth, "cuda")
        result: dict = {"prefill_s": {}, "decode_s": {}, "attn_implementation": model.config._attn_implementation}
        with torch.no_grad():
            for length in prefills:
                ids = torch.randint(0, 1000, (1, length), device="cuda")
                model(ids)  # compiles / autotunes for this length
                result["prefill_s"][length] = timed(lambda: model(ids), 1)
            for context in contexts:
                ids = torch.randint(0, 1000, (1, context), device="cuda")
                out = model(ids, use_cache=True)
                cache = out.past_key_values
                token = torch.ones(1, 1, dtype=torch.long, device="cuda")

                def step():
                    nonlocal cache
                    cache = model(token, past_key_values=cache, use_cache=True).past_key_values

                for _ in range(3):
                    step()
                result["decode_s"][context] = timed(step, 7)
                del out, cache
                torch.cuda.empty_cache()
        measured[depth] = result
        model = None  # frees the model; rebound rather than deleted, since the closures above refer to the name
        torch.cuda.empty_cache()
        report["transformers_measured"] = {str(d): r for d, r in measured.items()}
        save()

    def extrapolate(key: str, point: int) -> float:
        return full_depth_seconds({d: measured[d][key][point] for d in layers}, full_layers)

    report["transformers"] = {
        "method": depth_method(layers, full_layers),
        "decode": [{"context": c, "tok_s": 1 / extrapolate("decode_s", c)} for c in contexts],
        "prefill": [{"tokens": n, "tok_s": n / extrapolate("prefill_s", n)} for n in prefills],
    }
    save()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("artifact", type=Path)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--contexts", type=int, nargs="+", default=[1024, 8192, 32768])
    parser.add_argument("--prefills", type=int, nargs="+", default=[512, 4096, 16384])
    parser.add_argument(
        "--hf-layers", type=int, nargs="+", default=None,
        help="transformers depths: none = the full model (fits an H200); two = extrapolate from them (smaller GPUs)",
    )
    parser.add_argument("--batches", type=int, nargs="*", default=[1, 8], help="batched decode: sequences per step (none: skip)")
    parser.add_argument("--skip-transformers", action="store_true")
    parser.add_argument("--commit", default=None)
    args = parser.parse_args()
    report: dict = gpu_report_header(args.commit)

    def save() -> None:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(report, indent=1, default=str))

    bandwidth = device_bandwidth()
    report["device_bandwidth_GBps"] = bandwidth / 1e9
    max_context = max(args.contexts + args.prefills) + 512
    began = time.perf_counter()
    sequences = max([2, *args.batches])
    vram.start()
    engine = Engine.load(args.artifact, device="cuda", max_context=max_context, max_sequences=sequences, spec="none")
    report["load_seconds"] = time.perf_counter() - began
    report["vram_after_load_bytes"] = torch.cuda.memory_allocated()
    report["planner"] = planner_prediction(engine, max_context)
    save()
    bench_engine(engine, args.contexts, args.prefills, bandwidth, report, save)
    if args.batches:
        bench_batches(engine, args.batches, min(args.contexts), report, save)
    report |= vram.against_plan(report["planner"]["vram_used_bytes"])
    save()
    config = engine.artifact.components["text"].config
    engine.close()
    del engine
    torch.cuda.empty_cache()
    if not args.skip_transformers:
        depths = tuple(args.hf_layers) if args.hf_layers else (config["num_hidden_layers"],)
        if len(depths) not in (1, 2) or (len(depths) == 1 and depths[0] != config["num_hidden_layers"]):
            raise SystemExit("--hf-layers takes two reduced depths (or leave it out for the full model)")
        bench_transformers(config, depths, args.contexts, args.prefills, report, save)
        hf = {p["context"]: p["tok_s"] for p in report["transformers"]["decode"]}
        for point in report["decode"]:
            point["speedup_vs_transformers"] = point["tok_s"] / hf[point["context"]]
        hf_prefill = {p["tokens"]: p["tok_s"] for p in report["transformers"]["prefill"]}
        for point in report["prefill"]:
            point["speedup_vs_transformers"] = point["tok_s"] / hf_prefill[point["tokens"]]
        save()
    for point in report["decode"]:
        print(f"decode @{point['context']:6d}: {point['tok_s']:7.1f} tok/s (eager {point['eager_tok_s']:.1f}), roofline "
              f"{point['roofline_tok_s']:.0f} -> {100 * point['roofline_fraction']:.1f}%, "
              f"x{point.get('speedup_vs_transformers', float('nan')):.1f} vs transformers")
    for point in report["prefill"]:
        print(f"prefill {point['tokens']:6d}: {point['tok_s']:9.0f} tok/s, {point['tflops']:.0f} TFLOPS = "
              f"{point['tensor_fraction']:.2f} of the {point['tensor_ceiling_tflops']:.0f} TFLOPS cuBLAS ceiling, "
              f"x{point.get('speedup_vs_transformers', float('nan')):.1f} vs transformers")
    for point in report.get("batched_decode", []):
        print(f"batch {point['batch']}: step {point['step_ms']:.2f} ms, {point['aggregate_tok_s']:.0f} tok/s "
              f"({point['aggregate_vs_first']:.2f}x the first)")
    print("stages (us/step):", json.dumps(report.get("decode_stage_us", {})))
    runtime = report.get("prefill_runtime_calls", {})
    print("prefill runtime calls:", json.dumps({name: [round(v["calls"]), round(v["us"])] for name, v in runtime.items()}))
    print("prefill kernels (us):", json.dumps([(k["kernel"][:60], round(k["us"])) for k in report.get("prefill_kernels", [])[:12]]))
    print(f"peak VRAM {report['peak_vram_bytes'] / 2**30:.2f} GiB, planner {report['planner']['vram_used_bytes'] / 2**30:.2f} GiB")


if __name__ == "__main__":
    main()
