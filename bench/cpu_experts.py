"""Benchmark: CPU routed-expert throughput (numba kernels) against host memory bandwidth.

Full-size Qwen3.6-35B-A3B expert records (hidden 2048, intermediate 512, official formats: Q4
gate/up, Q5 down; 1.77 MB each), one layer's worth (256 records, larger than any L3), random
valid codes. For each thread count it measures, in the same run:
  * host bandwidth: a numba parallel streaming read of the record buffer (GB/s);
  * single expert: one token through one expert per call, cycling through the layer (cold records);
  * layer: one token through 8 distinct experts per call (a decode step's routed work of a layer);
  * independent processes: one single-threaded process per core timing the layer call at the
    same moment, summed (the cores' decode ceiling without any parallel-region cost);
each with the activations split into 3 parts (float32 engines) and 2 parts (bf16 engines, the
GPU case), and reports GB/s of expert records consumed (median call) and its fraction of the
measured host bandwidth (best streaming read).

    python bench/cpu_experts.py --label dev        # writes bench/results/cpu_experts_dev.json
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import subprocess
import sys
import time
from pathlib import Path

import numba
import numpy as np
from numba import njit, prange

from ninfer_offload.artifact.records import ExpertRecordLayout
from ninfer_offload.kernels.cpu import experts as ce
from provenance import git_commit

HIDDEN, INTER, EXPERTS, TOP_K = 2048, 512, 256, 8


@njit(parallel=True, nogil=True, cache=True)
def _stream_read(words):
    """Sum of every 64-bit word, read once in parallel contiguous chunks (a host bandwidth probe)."""
    chunks = 1024
    per = words.shape[0] // chunks
    partial = np.zeros(chunks, dtype=np.uint64)
    for c in prange(chunks):
        chunk = words[c * per : (c + 1) * per]
        acc = np.uint64(0)
        for i in range(chunk.shape[0]):
            acc += chunk[i]
        partial[c] = acc
    return partial.sum()


def make_layer(rng: np.random.Generator) -> tuple[ExpertRecordLayout, np.ndarray, np.ndarray]:
    """256 full-size records with random codes and small finite scales."""
    layout = ExpertRecordLayout.create("q4_g64_fp16", "q5_g64_fp16", HIDDEN, INTER)
    records = rng.integers(0, 256, EXPERTS * layout.nbytes, dtype=np.uint8)
    scale_words = np.float16(0.01).view(np.uint16)
    for e in range(EXPERTS):
        at = e * layout.nbytes
        for geo, offset in ((layout.gate_up, layout.gate_up_offset), (layout.down, layout.down_offset)):
            start = at + offset + geo.scale_offset
            records[start : start + geo.scale_bytes].view(np.uint16)[:] = scale_words
    return layout, records, np.arange(EXPERTS, dtype=np.int64) * layout.nbytes


def host_bandwidth(records: np.ndarray, seconds: float) -> float:
    words = records.view(np.uint64)
    _stream_read(words)
    best = 0.0
    deadline = time.perf_counter() + seconds
    while time.perf_counter() < deadline:
        start = time.perf_counter()
        _stream_read(words)
        best = max(best, words.nbytes / (time.perf_counter() - start))
    return best


def expert_throughput(plan, records, offsets, experts_per_call: int, parts: int, seconds: float, rng) -> tuple[float, float]:
    """(GB/s of records consumed, ms per call) for one token through `experts_per_call` experts,
    from the median call (robust to other processes on a shared machine)."""
    x = rng.standard_normal((1, HIDDEN)).astype(np.float32)
    weights = np.full((1, experts_per_call), 1.0 / experts_per_call, dtype=np.float32)
    order = rng.permutation(EXPERTS)
    ce.routed_experts_cpu(plan, records, offsets, x, order[None, :experts_per_call], weights, activation_parts=parts)
    times = []
    deadline = time.perf_counter() + seconds
    while time.perf_counter() < deadline:
        first = (len(times) * experts_per_call) % (EXPERTS - experts_per_call)
        start = time.perf_counter()
        ce.routed_experts_cpu(plan, records, offsets, x, order[None, first : first + experts_per_call], weights, activation_parts=parts)
        times.append(time.perf_counter() - start)
    median = float(np.median(times))
    return experts_per_call * plan.layout.nbytes / median / 1e9, 1e3 * median


def independent_processes(cores: int, parts: int, seconds: float) -> float:
    """Summed GB/s of `cores` single-threaded benchmark processes (one pinned to each core) timing
    the layer call at the same moment: what the cores can decode with no parallel-region cost,
    i.e. the compute ceiling of the all-thread point."""
    env = {**os.environ, "NUMBA_NUM_THREADS": "1"}
    command = [sys.executable, __file__, "--seconds", str(seconds), "--parts", str(parts), "--worker"]
    workers = [
        subprocess.Popen([*command, str(cpu)], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env)
        for cpu in sorted(os.sched_getaffinity(0))[:cores]
    ]
    for worker in workers:  # each has built its layer and compiled: start them together
        if worker.stdout.readline().strip() != "ready":
            raise SystemExit("an independent benchmark process failed to start")
    for worker in workers:
        worker.stdin.write("go\n")
        worker.stdin.flush()
    return sum(float(worker.communicate()[0]) for worker in workers)


def worker_process(cpu: int, parts: int, seconds: float) -> None:
    """One of `independent_processes`: pinned to `cpu`, one numba thread, its own layer."""
    os.sched_setaffinity(0, {cpu})
    rng = np.random.default_rng(cpu)
    ce.warm_up()
    layout, records, offsets = make_layer(rng)
    plan = ce.RecordKernelPlan.create(layout)
    expert_throughput(plan, records, offsets, TOP_K, parts, 0.1, rng)
    print("ready", flush=True)
    sys.stdin.readline()
    print(expert_throughput(plan, records, offsets, TOP_K, parts, seconds, rng)[0], flush=True)


def small_call_us(rng) -> float:
    """Median wall time of a call on a tiny expert: the fixed cost of one kernel call."""
    layout = ExpertRecordLayout.create("q4_g64_fp16", "q5_g64_fp16", 128, 64)
    plan = ce.RecordKernelPlan.create(layout)
    records = np.zeros(layout.nbytes, dtype=np.uint8)
    x = rng.standard_normal((1, 128)).astype(np.float32)
    ids, w = np.zeros((1, 1), np.int64), np.ones((1, 1), np.float32)
    times = []
    for _ in range(200):
        start = time.perf_counter()
        ce.routed_experts_cpu(plan, records, np.zeros(1, np.int64), x, ids, w)
        times.append(time.perf_counter() - start)
    return 1e6 * float(np.median(times))


def point(threads: int, kind: str, per_call: int, parts: int, gbs: float, bandwidth: float, ms: float | None = None) -> dict:
    """One result row (printed as it is made)."""
    print(
        f"threads {threads:3d}  parts {parts}  {kind:22s} {gbs:7.2f} GB/s  host {bandwidth:7.2f} GB/s  "
        f"fraction {gbs / bandwidth:.2f}",
        flush=True,
    )
    row = {"threads": threads, "kind": kind, "experts_per_call": per_call, "activation_parts": parts, "weights_gbs": round(gbs, 3)}
    if ms is not None:
        row["ms_per_call"] = round(ms, 4)
    return {**row, "host_bandwidth_gbs": round(bandwidth, 3), "host_bandwidth_fraction": round(gbs / bandwidth, 4)}


def cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor()


def cpu_topology() -> dict:
    """A few `lscpu` fields (threads per core tells hyper-threads from cores)."""
    wanted = ("Model name", "Socket(s)", "Core(s) per socket", "Thread(s) per core", "L3 cache", "Flags")
    try:
        text = subprocess.run(["lscpu"], capture_output=True, text=True, check=True).stdout
    except (OSError, subprocess.CalledProcessError):
        return {}
    fields = dict(line.split(":", 1) for line in text.splitlines() if ":" in line)
    topology = {key: fields[key].strip() for key in wanted if key in fields}
    if "Flags" in topology:  # only the vector extensions that matter here
        topology["Flags"] = " ".join(f for f in topology["Flags"].split() if f.startswith(("avx", "fma", "f16c")))
    return topology


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--label", default=platform.node() or "host", help="result file suffix")
    parser.add_argument("--seconds", type=float, default=1.0, help="measurement time per point")
    parser.add_argument("--threads", type=int, nargs="+", default=None, help="thread counts (default: 1, 2, 4, 8 and all)")
    parser.add_argument(
        "--parts", type=int, nargs="+", default=[ce.EXACT_PARTS, ce.SIXTEEN_BIT_PARTS],
        help="activation parts to measure (3: float32 engines, 2: bf16 engines)",
    )
    parser.add_argument("--out", type=Path, default=None)
    parser.add_argument("--worker", type=int, default=None, help=argparse.SUPPRESS)  # see independent_processes
    args = parser.parse_args()
    if args.worker is not None:
        worker_process(args.worker, args.parts[0], args.seconds)
        return

    rng = np.random.default_rng(0)
    ce.warm_up()
    layout, records, offsets = make_layer(rng)
    plan = ce.RecordKernelPlan.create(layout)
    cores = numba.config.NUMBA_NUM_THREADS
    counts = sorted({c for c in args.threads or (1, 2, 4, 8, cores) if 1 <= c <= cores})
    points = []
    for threads in counts:
        numba.set_num_threads(threads)
        bandwidth = host_bandwidth(records, args.seconds) / 1e9
        for parts in args.parts:
            for kind, per_call in (("single_expert", 1), ("layer_8_experts", TOP_K)):
                gbs, ms = expert_throughput(plan, records, offsets, per_call, parts, args.seconds, rng)
                points.append(point(threads, kind, per_call, parts, gbs, bandwidth, ms))
    numba.set_num_threads(cores)
    bandwidth = next((p["host_bandwidth_gbs"] for p in points if p["threads"] == cores), host_bandwidth(records, args.seconds) / 1e9)
    for parts in args.parts:
        points.append(point(cores, "independent_processes", TOP_K, parts, independent_processes(cores, parts, args.seconds), bandwidth))
    result = {
        "benchmark": "cpu_experts",
        "command": " ".join([Path(sys.executable).name, *sys.argv]),
        "commit": git_commit(),
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "machine": {
            "cpu": cpu_name(),
            "cores": cores,
            "os_cpu_count": os.cpu_count(),
            "platform": platform.platform(),
            "numba": numba.__version__,
            "threading_layer": numba.threading_layer(),
            "lscpu": cpu_topology(),
            "load_average_1min": os.getloadavg()[0],
        },
        "record": {"hidden": HIDDEN, "intermediate": INTER, "gate_up": "q4_g64_fp16", "down": "q5_g64_fp16", "bytes": layout.nbytes},
        "layer_bytes": int(records.nbytes),
        "small_call_us": round(small_call_us(rng), 2),
        "points": points,
    }
    out = args.out or Path(__file__).parent / "results" / f"cpu_experts_{args.label}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
