"""Engine-side latency of what a server does per request, without HTTP, on one load:

    python bench/short_prompts.py /tmp/q36.ninfer --out bench/results/short_prompts_h200.json

* a prompt's prefill, its logits and the first token read on the host (the engine's part of the time to
  first token), per prompt length, with short prompts replayed from captured prefills in pieces (the
  default, `step_runner.GRAPHED_PROMPT_MAX`) and run as one eager chunk (`GRAPHED_PROMPT_MAX = 0`) in the same run;
* greedy decode of B sequences with each step queued before the host reads the previous one's tokens (the
  server's loop), against the same steps queued back to back without reading: ms per step per batch size.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch

from provenance import gpu_report_header


def prompt_ms(engine, length: int, repeats: int) -> float:
    """Best wall time of a fresh session's prefill of `length` tokens, its logits and the argmax read."""
    ids = [(i * 7919) % engine.config.vocab_size for i in range(length)]
    timings = []
    for _ in range(repeats):
        session = engine.session()
        torch.cuda.synchronize()
        began = time.perf_counter()
        int(session.prefill(ids).argmax())
        timings.append(time.perf_counter() - began)
        session.close()
    return min(timings) * 1e3


def decode_loop_ms(engine, batch: int, steps: int) -> dict:
    """ms per greedy step of `batch` sequences: reading each step's tokens behind the next (the server), and not reading."""
    from ninfer_offload.runtime.decoder import queue_greedy_step
    from ninfer_offload.runtime.step_inputs import upload

    sessions = [engine.session() for _ in range(batch)]
    for session in sessions:
        session.prefill([(i * 31) % engine.config.vocab_size for i in range(17)])
    queued = queue_greedy_step(engine, sessions, upload(torch.ones(batch, dtype=torch.int64), engine.device))
    for _ in range(10):
        following = queue_greedy_step(engine, sessions, queued.device)
        queued.read()
        queued = following
    torch.cuda.synchronize()
    began = time.perf_counter()
    for _ in range(steps):
        following = queue_greedy_step(engine, sessions, queued.device)
        queued.read()
        queued = following
    queued.read()
    reading = (time.perf_counter() - began) / steps
    began = time.perf_counter()
    for _ in range(steps):
        engine.step_on_device(sessions, queued.device)
    torch.cuda.synchronize()
    back_to_back = (time.perf_counter() - began) / steps
    for session in sessions:
        session.close()
    return {"batch": batch, "reading_ms": reading * 1e3, "back_to_back_ms": back_to_back * 1e3}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("artifact", type=Path)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--prompts", type=int, nargs="+", default=[8, 17, 32, 40, 64, 100, 128, 200])
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 2, 4, 8])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--commit", default=None, help="commit measured (the device copy has no git metadata)")
    args = parser.parse_args()

    from ninfer_offload.runtime import step_runner
    from ninfer_offload.runtime.engine import Engine

    engine = Engine.load(args.artifact, device="cuda", max_sequences=max(args.batches), spec="none")
    warm_up = engine.warm_up(max(args.prompts))
    report = {**gpu_report_header(args.commit), "warm_up_s": warm_up.seconds, "prompts": [], "batched_decode": []}
    default = step_runner.GRAPHED_PROMPT_MAX
    for length in args.prompts:
        replayed = prompt_ms(engine, length, args.repeats)
        step_runner.GRAPHED_PROMPT_MAX = 0
        eager = prompt_ms(engine, length, args.repeats)
        step_runner.GRAPHED_PROMPT_MAX = default
        report["prompts"].append({"tokens": length, "default_ms": replayed, "one_eager_chunk_ms": eager})
        print(json.dumps(report["prompts"][-1]), flush=True)
    for batch in args.batches:
        report["batched_decode"].append(decode_loop_ms(engine, batch, 60))
        print(json.dumps(report["batched_decode"][-1]), flush=True)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=2) + "\n")


if __name__ == "__main__":
    main()
