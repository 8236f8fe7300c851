"""Where a GPU run's time goes: kernel time by stage and by kernel, CUDA runtime calls, and a run's timeline by stream
(torch profiler). `python bench/profiling.py TRACE.json.gz` prints the timeline of a kept trace."""

from __future__ import annotations

from pathlib import Path

import torch

STAGES = (  # kernel-name fragment -> stage of the per-step breakdown (first match wins)
    ("gate_up_swiglu", "routed experts"),
    ("down_gemv", "routed experts"),
    ("down_shared_gemv", "routed experts"),
    ("down_split_gemv", "routed experts"),
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
HOST_CATEGORIES = ("cpu_op", "cuda_runtime", "cuda_driver", "python_function")  # what the host does, in a trace
BETWEEN_CALLS = "(between calls: Python)"


def _merged(intervals: list[tuple[float, float]]) -> list[tuple[float, float]]:
    """`intervals` [(start, end)] merged where they overlap, in order."""
    merged: list[list[float]] = []
    for start, end in sorted(intervals):
        if merged and start <= merged[-1][1]:
            merged[-1][1] = max(merged[-1][1], end)
        else:
            merged.append([start, end])
    return [(start, end) for start, end in merged]


def _union(intervals: list[tuple[float, float]]) -> float:
    """Length covered by at least one of `intervals` [(start, end)]."""
    return sum(end - start for start, end in _merged(intervals))


def _outermost(events: list[dict]) -> list[tuple[float, float, str]]:
    """(start, end, name) of the host events not inside another on their thread, in order of start."""
    threads: dict = {}
    for event in events:
        if event.get("cat") in HOST_CATEGORIES and "dur" in event:
            threads.setdefault(event.get("tid"), []).append(event)
    outermost = []
    for thread in threads.values():
        reach = float("-inf")
        for event in sorted(thread, key=lambda e: (float(e["ts"]), -float(e["dur"]))):
            start, end = float(event["ts"]), float(event["ts"]) + float(event["dur"])
            if start >= reach:
                outermost.append((start, end, event.get("name", "?")))
                reach = end
    return sorted(outermost)


def idle_by_host_call(events: list[dict], busy: list[tuple[float, float]], top: int = 10) -> dict[str, float]:
    """Milliseconds of the device's idle gaps (between the merged `busy` intervals) spent in each outermost
    host call (torch op, CUDA runtime or driver call), the rest as BETWEEN_CALLS (Python between
    calls): the `top` largest. What the host was doing while the device waited for it."""
    calls, spent = _outermost(events), {}
    first = 0
    for (_, gap_start), (gap_end, _) in zip(busy, busy[1:]):
        while first < len(calls) and calls[first][1] <= gap_start:
            first += 1
        covered = 0.0
        for start, end, name in calls[first:]:
            if start >= gap_end:
                break
            overlap = min(end, gap_end) - max(start, gap_start)
            if overlap > 0:
                spent[name] = spent.get(name, 0.0) + overlap
                covered += overlap
        spent[BETWEEN_CALLS] = spent.get(BETWEEN_CALLS, 0.0) + max(0.0, gap_end - gap_start - covered)
    return {name: us / 1e3 for name, us in sorted(spent.items(), key=lambda kv: -kv[1])[:top]}


def launch_leads(events: list[dict]) -> dict[str, float]:
    """Per stream, the median milliseconds from the end of a kernel's or copy's launch call on the host to its
    start on the device (matched by correlation id): near zero when the device waits for the host to launch
    (the host bounds the run), large when the host runs ahead of the device."""
    launched = {
        event["args"]["correlation"]: float(event["ts"]) + float(event.get("dur", 0.0))
        for event in events
        if event.get("cat") in ("cuda_runtime", "cuda_driver") and "correlation" in event.get("args", {})
    }
    leads: dict[int, list[float]] = {}
    for event in events:
        args = event.get("args", {})
        if event.get("cat") in DEVICE_ACTIVITIES and args.get("correlation") in launched:
            leads.setdefault(int(args["stream"]), []).append(float(event["ts"]) - launched[args["correlation"]])
    return {str(stream): sorted(values)[len(values) // 2] / 1e3 for stream, values in sorted(leads.items())}


def timeline_from_trace(events: list[dict]) -> dict:
    """Per-stream busy time, kernels and copies, device busy time, the streams' overlap, the time between
    the first and last device activity when no stream was busy (the device waiting for the host) and what
    the host did meanwhile (`idle_by_host_call`), how far ahead of the device the host launched
    (`launch_leads`), the host's synchronizing calls and its CUDA runtime calls by name (the costliest
    RUNTIME_CALLS), from Chrome-trace events (microsecond `ts`/`dur`, the stream in `args`)."""
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
    busy_spans = _merged(intervals)
    everything = sum(end - start for start, end in busy_spans)
    span = busy_spans[-1][1] - busy_spans[0][0] if busy_spans else 0.0
    busy = {sid: _union(stream["intervals"]) for sid, stream in streams.items()}
    costliest = sorted(runtime.items(), key=lambda kv: -kv[1][1])[:RUNTIME_CALLS]
    return {
        "device_busy_ms": everything / 1e3,
        "device_idle_ms": (span - everything) / 1e3,
        "idle_by_host_call_ms": idle_by_host_call(events, busy_spans),
        "launch_lead_ms": launch_leads(events),
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
    import time

    from torch.profiler import ProfilerActivity, profile

    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        began = time.perf_counter()
        run()
        torch.cuda.synchronize()
        wall = time.perf_counter() - began
    return {"wall_ms": wall * 1e3, **timeline_from_trace(_trace_events(prof, keep))}


def _trace_events(prof, keep: Path | None = None) -> list[dict]:
    """The Chrome-trace events of a finished torch profiler run; `keep`: also write the trace there (gzipped)."""
    import gzip
    import json
    import shutil
    import tempfile

    with tempfile.NamedTemporaryFile(suffix=".json") as trace:
        prof.export_chrome_trace(trace.name)
        events = json.load(open(trace.name)).get("traceEvents", [])
        if keep is not None:
            keep.parent.mkdir(parents=True, exist_ok=True)
            with open(trace.name, "rb") as source, gzip.open(keep, "wb") as target:
                shutil.copyfileobj(source, target)
    return events


def kernels_by_launch(run, repeats: int, top: int = 30) -> list[dict]:
    """The kernels of `repeats` runs of `run()` grouped by name and launch shape (grid, block, registers per
    thread, shared memory: which product or layer op a launch is), microseconds and launches per run, most
    expensive first (torch profiler's Chrome trace; replays of CUDA graphs included)."""
    from torch.profiler import ProfilerActivity, profile

    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(repeats):
            run()
        torch.cuda.synchronize()
    events = _trace_events(prof)
    groups: dict[tuple, list[float]] = {}
    for event in events:
        if event.get("cat") != "kernel":
            continue
        args = event.get("args", {})
        key = (event.get("name", "?")[:80], str(args.get("grid")), str(args.get("block")), args.get("registers per thread"),
               args.get("shared memory"))
        group = groups.setdefault(key, [0, 0.0])
        group[0], group[1] = group[0] + 1, group[1] + float(event.get("dur", 0.0))
    rows = [{"kernel": name, "grid": grid, "block": block, "registers": registers, "shared": shared,
             "launches": launches / repeats, "us": us / repeats}
            for (name, grid, block, registers, shared), (launches, us) in groups.items()]
    return sorted(rows, key=lambda row: -row["us"])[:top]


def main() -> None:
    """`python bench/profiling.py TRACE.json[.gz]`: the timeline of a kept Chrome trace (`stream_timeline(keep=...)`)."""
    import argparse
    import gzip
    import json

    parser = argparse.ArgumentParser(description=main.__doc__)
    parser.add_argument("trace", type=Path)
    path = parser.parse_args().trace
    with (gzip.open(path, "rt") if path.suffix == ".gz" else open(path)) as source:
        events = json.load(source).get("traceEvents", [])
    print(json.dumps(timeline_from_trace(events), indent=1))


if __name__ == "__main__":
    main()
