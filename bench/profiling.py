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
