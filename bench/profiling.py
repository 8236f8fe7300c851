"""Where a GPU run's time goes: kernel time by stage and by kernel, and CUDA runtime calls (torch profiler)."""

from __future__ import annotations

from pathlib import Path

import torch

STAGES = (  # kernel-name fragment -> stage of the per-step breakdown (first match wins)
    ("gate_up_swiglu", "routed experts"),
    ("down_gemv", "routed experts"),
    ("down_shared_gemv", "routed experts"),
    ("_down_kernel", "routed experts"),
    ("quantized_gemv", "quantized linear"),
    ("shared_expert_gemv", "quantized linear"),
    ("quantized_matmul", "quantized linear"),
    ("dense_gemv", "dense linear"),
    ("decode_partial", "attention"),
    ("decode_merge", "attention"),
    ("gdn_recurrent", "gdn recurrent"),
    ("conv_update", "gdn conv"),
    ("rmsnorm", "rmsnorm"),
    ("softmax_topk", "router"),
    ("gemv", "dense linear (cuBLAS)"),
    ("gemm", "dense linear (cuBLAS)"),
    ("nvjet", "dense linear (cuBLAS)"),
    ("sort", "routing plan"),
    ("scatter", "routing plan"),
    ("index", "indexing/copies"),
    ("copy", "indexing/copies"),
)


def kernel_breakdown(run, repeats: int) -> tuple[dict, list[dict], dict]:
    """Per-stage GPU microseconds of one `run()`, its kernels by name (calls and microseconds per run,
    most expensive first) and its CUDA runtime calls by name (launches, synchronizations, copies:
    calls and host microseconds per run), from torch profiler records over `repeats` runs."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(repeats):
            run()
        torch.cuda.synchronize()
    stages: dict[str, float] = {}
    kernels, runtime = [], {}
    for event in prof.key_averages():
        if event.key.startswith("cuda"):
            runtime[event.key] = {"calls": event.count / repeats, "us": event.cpu_time_total / repeats}
            continue
        micros = getattr(event, "self_device_time_total", None) or getattr(event, "self_cuda_time_total", 0)
        if not micros or event.cpu_time_total > 0:  # kernels only: host ops carry their kernels' time too
            continue
        name = event.key.lower()
        stage = next((s for frag, s in STAGES if frag in name), "other elementwise")
        stages[stage] = stages.get(stage, 0.0) + micros / repeats
        kernels.append({"kernel": event.key[:120], "calls": event.count / repeats, "us": micros / repeats})
    kernels.sort(key=lambda k: -k["us"])
    return dict(sorted(stages.items(), key=lambda kv: -kv[1])), kernels, dict(sorted(runtime.items(), key=lambda kv: -kv[1]["us"]))


DEVICE_ACTIVITIES = ("kernel", "gpu_memcpy", "gpu_memset")  # trace categories that occupy a CUDA stream
RUNTIME_CALLS = 8  # the costliest CUDA runtime calls a timeline names


def _union(intervals: list[tuple[float, float]]) -> float:
    """Length covered by at least one of `intervals` [(start, end)]."""
    total, reach = 0.0, None
    for start, end in sorted(intervals):
        if reach is None or start > reach:
            total, reach = total + end - start, end
        elif end > reach:
            total, reach = total + end - reach, end
    return total


def timeline_from_trace(events: list[dict]) -> dict:
    """Per-stream busy time, kernels and copies, device busy time, the streams' overlap, the time between
    the first and last device activity when no stream was busy (the device waiting for the host), the
    host's synchronizing calls and its CUDA runtime calls by name (the costliest RUNTIME_CALLS), from
    Chrome-trace events (microsecond `ts`/`dur`, the stream in `args`)."""
    streams: dict[int, dict] = {}
    host_sync_us = 0.0
    runtime: dict[str, list[float]] = {}
    for event in events:
        kind, duration = event.get("cat"), float(event.get("dur", 0.0))
        if kind not in DEVICE_ACTIVITIES:
            if kind in ("cuda_runtime", "cuda_driver"):
                calls = runtime.setdefault(event.get("name", "?"), [0, 0.0])
                calls[0], calls[1] = calls[0] + 1, calls[1] + duration
                if "Synchronize" in event.get("name", ""):
                    host_sync_us += duration
            continue
        stream = streams.setdefault(int(event["args"]["stream"]), {"intervals": [], "kernels": 0, "copies": 0, "copy_us": 0.0})
        stream["intervals"].append((float(event["ts"]), float(event["ts"]) + duration))
        if kind == "gpu_memcpy":
            stream["copies"] += 1
            stream["copy_us"] += duration
        else:
            stream["kernels"] += 1
    intervals = [interval for stream in streams.values() for interval in stream["intervals"]]
    everything = _union(intervals)
    span = max(end for _, end in intervals) - min(start for start, _ in intervals) if intervals else 0.0
    busy = {sid: _union(stream["intervals"]) for sid, stream in streams.items()}
    costliest = sorted(runtime.items(), key=lambda kv: -kv[1][1])[:RUNTIME_CALLS]
    return {
        "device_busy_ms": everything / 1e3,
        "device_idle_ms": (span - everything) / 1e3,
        "streams_overlap_ms": (sum(busy.values()) - everything) / 1e3,
        "host_sync_ms": host_sync_us / 1e3,
        "runtime_calls": {name: {"calls": calls, "ms": us / 1e3} for name, (calls, us) in costliest},
        "streams": {
            str(sid): {"busy_ms": busy[sid] / 1e3, "kernels": s["kernels"], "copies": s["copies"], "copy_ms": s["copy_us"] / 1e3}
            for sid, s in sorted(streams.items(), key=lambda kv: -busy[kv[0]])
        },
    }


def stream_timeline(run, keep: Path | None = None) -> dict:
    """Where one `run()`'s GPU time goes by stream (torch profiler, read back from its Chrome trace):
    the run's wall time and `timeline_from_trace` of its events; `keep`: also write the trace there
    (gzipped JSON, for chrome://tracing or Perfetto)."""
    import gzip
    import json
    import shutil
    import tempfile
    import time

    from torch.profiler import ProfilerActivity, profile

    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        began = time.perf_counter()
        run()
        torch.cuda.synchronize()
        wall = time.perf_counter() - began
    with tempfile.NamedTemporaryFile(suffix=".json") as trace:
        prof.export_chrome_trace(trace.name)
        events = json.load(open(trace.name)).get("traceEvents", [])
        if keep is not None:
            keep.parent.mkdir(parents=True, exist_ok=True)
            with open(trace.name, "rb") as source, gzip.open(keep, "wb") as target:
                shutil.copyfileobj(source, target)
    return {"wall_ms": wall * 1e3, **timeline_from_trace(events)}
