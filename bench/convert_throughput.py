"""Converter time, memory and output size on checkpoints of the real Qwen3.6-35B-A3B tensor sizes, extrapolated to the full model.

    python bench/convert_throughput.py --layers 2 8 --workdir /tmp/convert-bench [--per-expert 2] [--out FILE]

For each layer count it writes a random bf16 checkpoint (`ninfer_offload.convert.tiny.write_checkpoint`)
with the real model's dimensions and components: `Qwen3_5MoeForConditionalGeneration`, hidden size
2048, 256 routed experts of width 512 (fused banks), vocabulary 248,320, the MTP layer and the
27-block vision tower, but only that many decoder layers (the real 3:1 GDN/attention pattern).
It then runs `python -m ninfer_offload convert --recipe official` on it in a child process and takes
the wall time, the CPU time and the peak resident memory of that process from wait4(2), its peak
anonymous memory (RssAnon in /proc/PID/status, sampled every 50 ms: the resident memory without the
checkpoint pages the kernel maps in while reading, which it can drop again), and the bytes read and
written. `--per-expert N` also converts an N-layer checkpoint with per-expert tensors
(`mlp.experts.{e}.gate_proj.weight`, ...), the other form published checkpoints take.

Two layer counts differ only in decoder layers, so they give the cost of one layer and of everything
else (embedding, head, MTP, vision, startup); the 40-layer estimate is the smaller run plus
(40 - its layers) layers. The full checkpoint's bytes come from the converter's own layout at the
real config. Checkpoints and artifacts are deleted after each run (`--keep` keeps them).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import shutil
import subprocess
import sys
import threading
import time
from math import prod
from pathlib import Path

import torch

from ninfer_offload.artifact.contract import TEXT_CONFIG, TEXT_LAYERS, VISION_CONFIG, official_directory
from ninfer_offload.convert.hf_config import CONDITIONAL
from ninfer_offload.convert.tiny import source_shapes, write_checkpoint
from provenance import git_commit

GB = 1e9


def real_config(layers: int) -> dict:
    """config.json of the real model with `layers` decoder layers."""
    text = {key: value for key, value in TEXT_CONFIG.items() if key != "architectures"}
    text.update(num_hidden_layers=layers, layer_types=TEXT_CONFIG["layer_types"][:layers])
    vision = {**VISION_CONFIG, "in_channels": 3, "out_hidden_size": TEXT_CONFIG["hidden_size"]}
    return {"architectures": [CONDITIONAL], "model_type": "qwen3_5_moe", "text_config": text, "vision_config": vision,
            "tie_word_embeddings": False}


def checkpoint_bytes(config: dict) -> int:
    """bf16 bytes of every tensor the converter reads from a checkpoint with this config."""
    return sum(2 * prod(shape) for shape in source_shapes(config).values())


def directory_bytes(path: Path) -> int:
    return sum(p.stat().st_size for p in path.iterdir() if p.is_file())


def peak_anonymous(pid: int, peak: list[int], done: threading.Event) -> None:
    """Largest RssAnon of process `pid` (bytes) into peak[0], sampled until `done`."""
    status = Path(f"/proc/{pid}/status")
    while not done.wait(0.05):
        try:
            line = next(line for line in status.read_text().splitlines() if line.startswith("RssAnon:"))
        except (OSError, StopIteration):
            continue
        peak[0] = max(peak[0], int(line.split()[1]) * 1024)


def convert_run(source: Path, out: Path) -> dict:
    """Time one `ninfer convert` child process: wall and CPU seconds, peak memory, bytes in and out."""
    command = [sys.executable, "-m", "ninfer_offload", "convert", str(source), str(out), "--recipe", "official", "--no-progress"]
    start = time.perf_counter()
    child = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    peak, done = [0], threading.Event()
    sampler = threading.Thread(target=peak_anonymous, args=(child.pid, peak, done))
    sampler.start()
    _, status, usage = os.wait4(child.pid, 0)
    wall = time.perf_counter() - start
    done.set()
    sampler.join()
    stdout, stderr = child.stdout.read(), child.stderr.read()
    if os.waitstatus_to_exitcode(status) != 0:
        raise SystemExit(f"convert failed: {stderr.strip()}")
    weights = sum(p.stat().st_size for p in source.glob("*.safetensors"))
    written = sum(p.stat().st_size for p in out.parent.glob(f"{out.name}*"))
    return {
        "source_safetensors_bytes": weights,
        "artifact_bytes": written,
        "wall_s": round(wall, 2),
        "cpu_s": round(usage.ru_utime + usage.ru_stime, 2),
        "peak_rss_bytes": usage.ru_maxrss * 1024,
        "peak_anonymous_bytes": peak[0],
        "source_gb_per_s": round(weights / wall / GB, 4),
        "stdout": stdout.strip(),
    }


def measure(workdir: Path, layers: int, layout: str, keep: bool) -> dict:
    source, out = workdir / f"checkpoint-{layout}-{layers}", workdir / f"{layout}-{layers}.ninfer"
    start = time.perf_counter()
    config = real_config(layers)
    write_checkpoint(source, config, layout=layout, shards=4 * layers + 16, seed=0)
    written = time.perf_counter() - start
    result = {"layers": layers, "layout": layout, "checkpoint_write_s": round(written, 1), **convert_run(source, out)}
    print(json.dumps({k: v for k, v in result.items() if k != "stdout"}), flush=True)
    if not keep:
        shutil.rmtree(source)
        for path in workdir.glob(f"{out.name}*"):
            path.unlink()
    return result


def extrapolate(runs: list[dict]) -> dict:
    """The 40-layer model from the two fused runs: per-layer and fixed cost, full-size totals."""
    small, large = sorted((r for r in runs if r["layout"] == "conditional"), key=lambda r: r["layers"])[:2]
    extra = large["layers"] - small["layers"]
    per_layer = {key: (large[key] - small[key]) / extra for key in ("wall_s", "cpu_s", "source_safetensors_bytes", "artifact_bytes")}
    missing = TEXT_LAYERS - small["layers"]
    official = official_directory()

    def full(key: str) -> float:
        return small[key] + missing * per_layer[key]

    return {
        "method": f"{small['layers']}-layer run + {missing} x the per-layer cost ({small['layers']}- and {large['layers']}-layer runs)",
        "per_layer": {key: round(value, 3) for key, value in per_layer.items()},
        "fixed_wall_s": round(small["wall_s"] - small["layers"] * per_layer["wall_s"], 2),
        "full_checkpoint_tensor_bytes": checkpoint_bytes(real_config(TEXT_LAYERS)),
        "full_checkpoint_safetensors_bytes_estimate": int(full("source_safetensors_bytes")),
        "full_artifact_bytes_estimate": int(full("artifact_bytes")),
        "official_artifact_tensor_bytes": sum(o["bytes"] for o in official["objects"] if o["kind"] == "tensor"),
        "full_wall_s_estimate": round(full("wall_s"), 1),
        "full_cpu_s_estimate": round(full("cpu_s"), 1),
        "peak_rss_bytes_max": max(r["peak_rss_bytes"] for r in runs),
        "peak_anonymous_bytes_max": max(r["peak_anonymous_bytes"] for r in runs),
    }


def machine() -> dict:
    cpu = next((line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines()
                if line.startswith("model name")), platform.processor())
    total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    return {"cpu": cpu, "cores": os.cpu_count(), "ram_bytes": total, "platform": platform.platform(), "torch": torch.__version__,
            "python": platform.python_version()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, nargs=2, default=[2, 8], help="two decoder-layer counts (the real model has 40)")
    parser.add_argument("--per-expert", type=int, default=None, help="also convert a per-expert checkpoint of this many layers")
    parser.add_argument("--workdir", type=Path, required=True, help="scratch directory (needs about 2.3 GB per layer)")
    parser.add_argument("--keep", action="store_true", help="keep the checkpoints and artifacts")
    parser.add_argument("--out", type=Path, default=Path(__file__).parent / "results" / "convert_throughput_dev.json")
    args = parser.parse_args()
    args.workdir.mkdir(parents=True, exist_ok=True)
    runs = [measure(args.workdir, layers, "conditional", args.keep) for layers in sorted(args.layers)]
    if args.per_expert:
        runs.append(measure(args.workdir, args.per_expert, "per_expert", args.keep))
    result = {
        "benchmark": "convert_throughput",
        "command": " ".join([Path(sys.executable).name, *sys.argv]),
        "commit": git_commit(),
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "machine": machine(),
        "recipe": "official",
        "runs": runs,
        "extrapolated_40_layers": extrapolate(runs),
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
