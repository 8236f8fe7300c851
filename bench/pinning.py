"""Ways of getting the host expert pool page-locked during a load, timed on this machine.

The offloaded load packs every layer's routed-expert records into page-locked host memory (four
packing threads, one buffer per layer). This script times, for the artifact's real per-layer record
sizes, allocating + writing every layer's buffer in four threads, each way in a fresh process:

* ``host_alloc``: ``torch.empty(pin_memory=True)`` (the caching host allocator, cudaHostAlloc), then write;
* ``host_register``: the same allocator told to register (``PYTORCH_CUDA_ALLOC_CONF=pinned_use_cuda_host_register:True,
  pinned_num_register_threads:8``: malloc, pages touched by 8 threads, cudaHostRegister), then write;
* ``host_register_runtime``: the same, switched on after CUDA is initialized (`register_pinned_allocations`, what a load does);
* ``register_after_write``: pageable memory, written, then ``cudaHostRegister``;
* ``register_before_write``: pageable memory, ``cudaHostRegister``, then written.

Each reports wall seconds, GB/s of records, the bytes the allocator really locked (its rounding) and
checks that the device reads the last layer back. Usage:

    python bench/pinning.py /tmp/q36.ninfer --out pinning.json
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import torch

from provenance import gpu_report_header

MODES = ("host_alloc", "host_register", "host_register_runtime", "register_after_write", "register_before_write")
REGISTER_CONF = "pinned_use_cuda_host_register:True,pinned_num_register_threads:8"
THREADS = 4


def layer_bytes(path: Path) -> list[int]:
    """Bytes of each MoE layer's records (text layers) in the artifact at `path`."""
    from ninfer_offload.artifact.dims import ModelDims
    from ninfer_offload.artifact.reader import open_artifact
    from ninfer_offload.runtime.loader import _record_layout

    with open_artifact(path) as artifact:
        config = ModelDims.from_text_config(artifact.components["text"].config)
        return [_record_layout(artifact, f"text/layers/{i}", config)[0].nbytes * config.num_experts for i in range(config.num_layers)]


PORTABLE_MAPPED = 3  # cudaHostRegisterPortable | cudaHostRegisterMapped


def register(tensor: torch.Tensor) -> None:
    err = torch.cuda.cudart().cudaHostRegister(tensor.data_ptr(), tensor.numel() * tensor.element_size(), PORTABLE_MAPPED)
    if int(err) != 0:
        raise RuntimeError(f"cudaHostRegister failed: {err}")


def run_mode(mode: str, sizes: list[int]) -> dict:
    """Allocate and write one buffer per layer the way `mode` says; seconds and what was locked."""
    torch.cuda.init()
    torch.empty(1, device="cuda")
    if mode == "host_register_runtime":
        from ninfer_offload.runtime.memory_check import register_pinned_allocations

        register_pinned_allocations()
    source = np.random.default_rng(0).integers(0, 255, max(sizes), dtype=np.uint8)
    buffers: list[torch.Tensor] = [None] * len(sizes)

    def one(i: int) -> float:
        began = time.perf_counter()
        if mode.startswith("host_"):
            buffer = torch.empty(sizes[i], dtype=torch.uint8, pin_memory=True)
            np.copyto(buffer.numpy(), source[: sizes[i]])
        else:
            buffer = torch.empty(sizes[i], dtype=torch.uint8)
            if mode == "register_before_write":
                register(buffer)
            np.copyto(buffer.numpy(), source[: sizes[i]])
            if mode == "register_after_write":
                register(buffer)
        buffers[i] = buffer
        return time.perf_counter() - began

    began = time.perf_counter()
    with ThreadPoolExecutor(THREADS) as pool:
        thread_seconds = sum(pool.map(one, range(len(sizes))))
    wall = time.perf_counter() - began
    last = buffers[-1]
    assert last.is_pinned(), f"{mode}: the buffer is not page-locked"
    back = last.to("cuda", non_blocking=True)[-(1 << 20) :].cpu().numpy()
    assert np.array_equal(back, source[sizes[-1] - (1 << 20) : sizes[-1]]), f"{mode}: the device read other bytes"
    stats = torch.cuda.host_memory_stats()
    total = sum(sizes)
    return {
        "mode": mode,
        "seconds": wall,
        "thread_seconds": thread_seconds,
        "gb_per_s": total / wall / 1e9,
        "record_bytes": total,
        "allocator_reserved_bytes": int(stats.get("reserved_bytes.current", stats.get("segment.current", 0))),
        "allocator_stats": {k: int(v) for k, v in stats.items() if k.startswith(("allocated_bytes", "reserved_bytes", "num_host_alloc"))},
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("artifact", type=Path)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--commit", default=None)
    parser.add_argument("--mode", choices=MODES, help=argparse.SUPPRESS)  # one mode, in a child process
    args = parser.parse_args()
    sizes = layer_bytes(args.artifact)
    if args.mode:
        print(json.dumps(run_mode(args.mode, sizes)))
        return
    report = gpu_report_header(args.commit) | {"threads": THREADS, "layers": len(sizes), "runs": []}
    for mode in MODES:
        env = os.environ | ({"PYTORCH_CUDA_ALLOC_CONF": REGISTER_CONF} if mode == "host_register" else {})
        child = [sys.executable, __file__, str(args.artifact), "--out", str(args.out), "--mode", mode]
        done = subprocess.run(child, env=env, capture_output=True, text=True)
        if done.returncode:
            run = {"mode": mode, "error": done.stderr.strip().splitlines()[-1:]}
        else:
            run = json.loads(done.stdout.strip().splitlines()[-1])
            run["pytorch_cuda_alloc_conf"] = env.get("PYTORCH_CUDA_ALLOC_CONF", "")
        report["runs"].append(run)
        print(json.dumps(run), flush=True)
    args.out.write_text(json.dumps(report, indent=2) + "\n")


if __name__ == "__main__":
    main()
