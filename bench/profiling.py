"""Where a GPU run's time goes: kernel time by stage and by kernel, and CUDA runtime calls (torch profiler)."""

from __future__ import annotations

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


DEVICE_ACTIVITIES = ("kernel", "gpu_memcpy", "gpu_memset")  # profiler activities that occupy a CUDA stream


def _union_ns(intervals: list[tuple[int, int]]) -> int:
    """Nanoseconds covered by at least one of `intervals` [(start, end)]."""
    total, reach = 0, None
    for start, end in sorted(intervals):
        if reach is None or start > reach:
            total, reach = total + end - start, end
        elif end > reach:
            total, reach = total + end - reach, end
    return total


def stream_timeline(run) -> dict:
    """Where one `run()`'s GPU time goes by stream (torch profiler): per CUDA stream the milliseconds it
    was busy (kernels and copies, overlaps within a stream merged), its kernels and copies; the run's
    wall time; how long the device was busy at all, and the streams' busy times beyond that (what they
    overlapped); and the host's time in synchronizing calls."""
    import time

    from torch.profiler import ProfilerActivity, profile

    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        began = time.perf_counter()
        run()
        torch.cuda.synchronize()
        wall = time.perf_counter() - began
    streams: dict[int, dict] = {}
    host_sync_ns = 0
    for event in prof.profiler.kineto_results.events():
        kind = event.activity_type()
        if kind not in DEVICE_ACTIVITIES:
            if "Synchronize" in event.name():
                host_sync_ns += event.duration_ns()
            continue
        stream = streams.setdefault(event.device_resource_id(), {"intervals": [], "kernels": 0, "copies": 0, "copy_ns": 0})
        stream["intervals"].append((event.start_ns(), event.start_ns() + event.duration_ns()))
        if kind == "gpu_memcpy":
            stream["copies"] += 1
            stream["copy_ns"] += event.duration_ns()
        else:
            stream["kernels"] += 1
    everything = [interval for stream in streams.values() for interval in stream["intervals"]]
    busy = {sid: _union_ns(stream["intervals"]) for sid, stream in streams.items()}
    return {
        "wall_ms": wall * 1e3,
        "device_busy_ms": _union_ns(everything) / 1e6,
        "streams_overlap_ms": (sum(busy.values()) - _union_ns(everything)) / 1e6,
        "host_sync_ms": host_sync_ns / 1e6,
        "streams": {
            str(sid): {"busy_ms": busy[sid] / 1e6, "kernels": s["kernels"], "copies": s["copies"], "copy_ms": s["copy_ns"] / 1e6}
            for sid, s in sorted(streams.items(), key=lambda kv: -busy[kv[0]])
        },
    }
