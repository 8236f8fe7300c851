"""Which Triton kernels a served engine first launches after its warm-up, and what they cost:

    python bench/warm_up_coverage.py /tmp/q36.ninfer --out bench/results/warm_up_coverage_h200.json

Loads the engine as `ninfer serve --max-concurrency N` does, runs its warm-up, then drives the server's
scheduler (no HTTP) through: one request, a burst of N requests at once (the batched prefill of their
prompts), and batched prefills of several (sequences, tokens) shapes. Each phase runs twice and reports both
wall times and the kernels that were not in the process's kernel cache when first launched (Triton's
`jit_cache_hook`: a compile, or a load from the on-disk cache). Anything listed under a first run is a gap in
the warm-up: a request pays for it.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import time
from pathlib import Path

import torch
from triton import knobs

from provenance import gpu_report_header

PROMPT_TOKENS = 40


class FirstLaunches:
    """Kernel names Triton compiled or loaded since the last `take()`."""

    def __init__(self) -> None:
        self.names: dict[str, list[str]] = {}
        knobs.runtime.jit_cache_hook = self._hook

    def _hook(self, *args, **kwargs) -> bool:
        fn = kwargs.get("fn")
        name = getattr(fn, "name", repr(fn))
        self.names.setdefault(name, []).append(str(kwargs.get("repr", ""))[-600:])  # the specialised arguments
        return False  # go on with the compile

    def take(self) -> dict[str, list[str]]:
        names, self.names = self.names, {}
        return names


def serve_requests(scheduler, prompts: list[list[int]], max_tokens: int) -> list[int]:
    """Submit every prompt at once (greedy) and wait for all of them; completion lengths."""
    from ninfer_offload.runtime.sampling import SamplingParams
    from ninfer_offload.runtime.decoder import GenerationRequest

    async def run() -> list[int]:
        loop = asyncio.get_running_loop()
        params = SamplingParams(temperature=0.0)
        handles = [scheduler.submit(GenerationRequest(p, max_tokens, params), loop) for p in prompts]

        async def drain(handle) -> int:
            return sum([1 async for _ in handle.tokens()])

        return await asyncio.gather(*(drain(h) for h in handles))

    return asyncio.run(run())


def phase(name: str, launches: FirstLaunches, action) -> dict:
    """`action` twice: wall seconds of each run and the kernels first launched in each."""
    runs = []
    for _ in range(2):
        torch.cuda.synchronize()
        began = time.perf_counter()
        action()
        torch.cuda.synchronize()
        runs.append({"seconds": time.perf_counter() - began, "first_launches": launches.take()})
    print(json.dumps({"phase": name, **{f"run{i}": r for i, r in enumerate(runs)}}), flush=True)
    return {"phase": name, "runs": runs}


def main() -> None:
    from ninfer_offload.runtime.engine import Engine
    from ninfer_offload.serve.scheduler import Scheduler

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("artifact", type=Path)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--commit")
    parser.add_argument("--concurrency", type=int, default=8)
    parser.add_argument("--max-tokens", type=int, default=16)
    parser.add_argument("--shapes", nargs="*", default=["4x16", "5x16", "8x32", "6x64", "7x32"], help="batched prefills, SEQUENCESxTOKENS")
    args = parser.parse_args()

    began = time.perf_counter()
    engine = Engine.load(args.artifact, device="cuda", max_sequences=args.concurrency)
    loaded = time.perf_counter()
    warm = engine.warm_up(engine.prefill_chunk)
    launches = FirstLaunches()
    scheduler = Scheduler(engine, max_concurrency=args.concurrency, prefill_chunk=engine.prefill_chunk)
    scheduler.start()
    vocab = engine.config.vocab_size
    prompt = [(i * 7919 + 11) % vocab for i in range(PROMPT_TOKENS)]
    phases = [
        phase("one request", launches, lambda: serve_requests(scheduler, [prompt], args.max_tokens)),
        phase(
            f"{args.concurrency} requests at once", launches,
            lambda: serve_requests(scheduler, [[(t + s) % vocab for t in prompt] for s in range(args.concurrency)], args.max_tokens),
        ),
    ]
    scheduler.stop()

    def batched(b: int, t: int) -> None:
        sessions = [engine.session() for _ in range(b)]
        try:
            engine.prefill_batch(sessions, [[(i * 31 + s) % vocab for i in range(t)] for s in range(b)])
        finally:
            for session in sessions:
                session.close()

    for shape in args.shapes:
        b, t = (int(v) for v in shape.split("x"))
        phases.append(phase(f"batched prefill {b} x {t}", launches, lambda b=b, t=t: batched(b, t)))
    report = {
        **gpu_report_header(args.commit),
        "load_s": loaded - began,
        "warm_up_prefill_s": warm.prefills,
        "warm_up_capture_s": warm.captures,
        "phases": phases,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=2) + "\n")


if __name__ == "__main__":
    main()
