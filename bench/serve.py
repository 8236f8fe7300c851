"""Server benchmark: N concurrent streaming clients against `ninfer serve`, and `ninfer generate` on the
same artifact and options as the single-stream reference.

    python bench/serve.py /tmp/q36.ninfer --device cuda --clients 1 2 4 8 --out bench/results/serve_h200.json

Each level starts one server (`--max-concurrency` = the number of clients) and sends it a first
request alone (`first_request_ttft_s`: what a user meets right after startup; the server compiles,
captures and rehearses at startup, `server_warm_up_s` from its log), then N clients each stream one greedy
`/v1/completions` request of `--max-tokens` tokens at once (`stream_options.include_usage` gives
the token count), `--bursts` times (the burst whose aggregate is the median gives the level's numbers;
`burst_aggregate_tok_s` lists every burst's), then one more request alone (`steady_ttft_s`; `first_ttft_ratio` = first /
steady), then one alone with a longer prompt the server has not seen (`new_prompt_ttft_s`: what a
kernel or plan built per prompt length costs every new length; `new_prompt_ttft_ratio` = it /
steady; each client's httpx connection pool is made before the clocks start, as an application makes
its client once; `first_request_server_ttft_s` / `steady_server_ttft_s`: the same two as the server logged
them, from arrival at the scheduler). Per client: time to first token (first content chunk) and decode tok/s (tokens after the
first over the time after the first chunk). Reported per level: mean per-client tok/s, aggregate
tok/s (all tokens over the wall time from the first concurrent request to the last end), TTFT p50
and p95, and the server's own log line of each request (`server_requests`: time queued, its TTFT and
decode rate as the engine thread saw them; `server_ttft_p50_s` / `_p95_s` of the N concurrent ones: the
first token, where the client's TTFT waits for the first text, which random weights may not give at once).
Fairness per level, from the same burst: `decode_tok_s_spread` (the fastest client's decode tok/s over the
slowest's: no sequence of the batch starved when near 1; `server_decode_tok_s_spread` the same of the rates the
server logged, from each one's first token, where a client's clock starts at its first text) and
`admission_stall_max_s`, the longest gap between two tokens of a running stream while another request waited
for its first token (its admission and prefill: one prefill piece per step, so about one piece and one step),
beside `inter_token_p50_s`, the median gap of every stream of the burst (`admission_stall_ratio` = stall / it).
Extra server options (`--serve-arg`, repeatable) are passed through, e.g. `--serve-arg=--miss-path=cpu`.
Both decode plainly (`--spec none`) unless such an option says otherwise (`--serve-arg=--spec=mtp`).

Offloaded experts: `--vram-budget 15GiB` plans the server and the `generate` reference at that budget
(`vram_budget_bytes`); `--routing trace` routes every sequence by its own stretch of the offload benchmark's
calibrated routing trace (`runtime.trace_routing`: slot s at position p takes trace token offset[s] + p) instead
of the synthetic model's router, whose picks are far less concentrated than the real model's. The server and
`generate` read it from the environment variable NINFER_BENCH_ROUTING=trace (`commands/bench_routing`; no
option of `ninfer serve` shows it); the server's log line saying so is checked. Per level, with experts
offloaded, the expert cache over the median burst (from /health before and after it, as of the server's last
step boundary): `expert_hit_rate`, `pcie_bytes_per_step` (every forward of the burst, its prompts' pieces
included), `cpu_assignments_per_step` (the assignments the CPU miss path computed), `pcie_bytes_per_token` and
`steps`. Each miss path alone and the split: `--serve-arg=--miss-path=cpu` (every miss on the host),
`--serve-arg=--miss-path=auto` (the split), none (every miss over PCIe).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx

from ninfer_offload.commands.bench_routing import BENCH_ROUTING
from ninfer_offload.planner.options import parse_size
from provenance import gpu_report_header

PROMPT = "Write a long story about a lighthouse keeper who finds a message in a bottle."
NEW_PROMPT = PROMPT + " The bottle is green, the message is old, and the storm has not ended yet."
WARM_UP = re.compile(r"warm-up .* took ([0-9.]+)s: prefills ([0-9.]+)s, decode step captures ([0-9.]+)s")
SERVER_TTFT = re.compile(r" ttft=([0-9.]+)s ")
SERVER_DECODE = re.compile(r" decode=([0-9.]+) tok/s ")
TRACE_ROUTING_LINE = "benchmark routing: each sequence by its own stretch"


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]


class Server:
    """`ninfer serve` in a subprocess, ready once it logs that it serves."""

    def __init__(self, artifact: Path, device: str, concurrency: int, extra: list[str], timeout: float, env: dict):
        self.port = free_port()
        command = [
            sys.executable, "-m", "ninfer_offload", "serve", str(artifact), "--device", device, "--port", str(self.port),
            "--max-concurrency", str(concurrency), "--served-model-name", "bench", "--spec", "none", *extra,
        ]
        self.process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
        self.log: list[str] = []
        deadline = time.monotonic() + timeout
        for line in self.process.stdout:
            self.log.append(line)
            if "Uvicorn running" in line:
                break
            if time.monotonic() > deadline:
                break
        if self.process.poll() is not None or not any("Uvicorn running" in line for line in self.log):
            self.stop()
            raise RuntimeError("the server did not start:\n" + "".join(self.log[-20:]))
        threading.Thread(target=self._drain, daemon=True).start()
        self.url = f"http://127.0.0.1:{self.port}"

    def _drain(self) -> None:
        for line in self.process.stdout:
            self.log.append(line)

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(timeout=60)
            except subprocess.TimeoutExpired:
                self.process.kill()


def stream_once(client: httpx.Client, url: str, max_tokens: int, prompt: str = PROMPT) -> dict:
    """One streaming greedy completion by `client` (made beforehand, as an application makes its client once):
    {began, ttft_s, tokens, decode_tok_s, end, chunks (the arrival time of each chunk with text)}."""
    body = {
        "model": "bench", "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "stream": True,
        "stream_options": {"include_usage": True},
    }
    began = time.perf_counter()
    first = None
    tokens = 0
    chunks = []
    with client.stream("POST", f"{url}/v1/completions", json=body, timeout=None) as response:
        response.raise_for_status()
        for line in response.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if chunk.get("choices") and chunk["choices"][0].get("text"):
                chunks.append(time.perf_counter())
                first = first or chunks[-1]
            if chunk.get("usage"):
                tokens = chunk["usage"]["completion_tokens"]
    end = time.perf_counter()
    first = first or end
    rate = (tokens - 1) / (end - first) if end > first else 0.0
    return {"began": began, "ttft_s": first - began, "tokens": tokens, "decode_tok_s": rate, "end": end, "chunks": chunks}


def fairness(results: list[dict]) -> dict:
    """Whether a burst's streams shared the steps: the spread of their decode rates (max / min), the longest gap
    between two chunks of a running stream while another request waited for its first chunk, and the median gap."""
    rates = [r["decode_tok_s"] for r in results if r["decode_tok_s"] > 0]
    gaps = [b - a for r in results for a, b in zip(r["chunks"], r["chunks"][1:])]
    stall = 0.0
    for newcomer in results:
        admitted = newcomer["began"], newcomer["began"] + newcomer["ttft_s"]
        for running in results:
            if running is not newcomer:
                overlapping = [b - a for a, b in zip(running["chunks"], running["chunks"][1:]) if a < admitted[1] and b > admitted[0]]
                stall = max([stall, *overlapping])
    p50 = percentile(gaps, 0.5) if gaps else None
    return {
        "decode_tok_s_spread": max(rates) / min(rates) if rates else None,
        "admission_stall_max_s": stall,
        "inter_token_p50_s": p50,
        "admission_stall_ratio": stall / p50 if p50 else None,
    }


def expert_counters(url: str) -> dict | None:
    """The server's expert-cache counters (/health), None when its experts are all in VRAM."""
    return httpx.get(f"{url}/health").json().get("experts")


def cache_over(before: dict | None, after: dict | None) -> dict:
    """Hit rate and PCIe bytes of the forwards between two readings of the counters."""
    if before is None or after is None:
        return {}
    delta = {key: after[key] - before[key] for key in ("uses", "hits", "pcie_bytes", "tokens", "steps", "cpu_assignments")}
    return {
        "expert_hit_rate": delta["hits"] / delta["uses"] if delta["uses"] else None,
        "pcie_bytes_per_step": delta["pcie_bytes"] / delta["steps"] if delta["steps"] else None,
        "cpu_assignments_per_step": delta["cpu_assignments"] / delta["steps"] if delta["steps"] else None,
        "pcie_bytes_per_token": delta["pcie_bytes"] / delta["tokens"] if delta["tokens"] else None,
        "steps": delta["steps"],
    }


def burst(pools: list[httpx.Client], url: str, max_tokens: int) -> tuple[list[dict], float, dict]:
    """Each pool's client streams one request at once: (their results, the wall time from the first start to the last end,
    the expert cache over the burst)."""
    results: list[dict] = [{} for _ in pools]

    def client(i: int) -> None:
        results[i] = stream_once(pools[i], url, max_tokens)

    threads = [threading.Thread(target=client, args=(i,)) for i in range(len(pools))]
    counters = expert_counters(url)
    began = time.perf_counter()
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    wall = max(r["end"] for r in results) - began
    return results, wall, cache_over(counters, expert_counters(url))


def level(server: Server, clients: int, max_tokens: int, bursts: int) -> dict:
    pools = [httpx.Client() for _ in range(clients)]  # each client's connection pool, made before any clock starts
    first = stream_once(pools[0], server.url, max_tokens)  # the server's first request: what a user meets after startup
    runs = [burst(pools, server.url, max_tokens) for _ in range(bursts)]
    aggregates = [sum(r["tokens"] for r in results) / wall for results, wall, _ in runs]
    median = sorted(range(bursts), key=aggregates.__getitem__)[bursts // 2]  # the burst whose aggregate is the median
    results = runs[median][0]
    ttfts = [r["ttft_s"] for r in results]
    steady = stream_once(pools[0], server.url, max_tokens)  # one more request alone, for the first request's comparison
    new = stream_once(pools[0], server.url, max_tokens, NEW_PROMPT)
    for pool in pools:
        pool.close()
    time.sleep(0.2)  # the last request's log line
    warm_up = next((m.groups() for line in server.log if (m := WARM_UP.search(line))), (None, None, None))
    listening = next(i for i, line in enumerate(server.log) if "Uvicorn running" in line)
    requests = [line.split(" ninfer ", 1)[-1].strip() for line in server.log[listening:] if " prompt=" in line]
    logged = [float(m.group(1)) if (m := SERVER_TTFT.search(line)) else None for line in requests]
    after = 1 + bursts * clients  # the first request's line, then each burst's (logged as they end)
    in_median = slice(1 + median * clients, 1 + (median + 1) * clients)
    server_ttfts = [t for t in logged[in_median] if t is not None]
    server_rates = [float(m.group(1)) for line in requests[in_median] if (m := SERVER_DECODE.search(line))]
    return {
        "clients": clients,
        "server_warm_up_s": warm_up[0] and float(warm_up[0]),
        "server_warm_up_prefill_s": warm_up[1] and float(warm_up[1]),
        "server_warm_up_capture_s": warm_up[2] and float(warm_up[2]),
        "first_request_ttft_s": first["ttft_s"],
        "first_request_tok_s": first["decode_tok_s"],
        "steady_ttft_s": steady["ttft_s"],
        "first_ttft_ratio": first["ttft_s"] / steady["ttft_s"],
        "first_request_server_ttft_s": logged[0] if logged else None,
        "steady_server_ttft_s": logged[after] if len(logged) > after else None,
        "new_prompt_ttft_s": new["ttft_s"],
        "new_prompt_ttft_ratio": new["ttft_s"] / steady["ttft_s"],
        "per_client_tok_s": sum(r["decode_tok_s"] for r in results) / clients,
        "aggregate_tok_s": aggregates[median],
        "burst_aggregate_tok_s": aggregates,
        "ttft_p50_s": percentile(ttfts, 0.5),
        "ttft_p95_s": percentile(ttfts, 0.95),
        "tokens": [r["tokens"] for r in results],
        "server_ttft_p50_s": percentile(server_ttfts, 0.5) if server_ttfts else None,
        "server_ttft_p95_s": percentile(server_ttfts, 0.95) if server_ttfts else None,
        "server_requests": requests,
        **fairness(results),
        "server_decode_tok_s_spread": max(server_rates) / min(server_rates) if server_rates and min(server_rates) > 0 else None,
        **runs[median][2],
    }


def generate_tok_s(artifact: Path, device: str, max_tokens: int, extra: list[str], env: dict) -> float:
    """Decode tok/s of `ninfer generate --json` with the same artifact, device and placement options."""
    shared = r"--(experts|profile|vram-budget|cache-policy|miss-path|spec|draft-tokens|proposal-head|max-context)"
    placement = [arg for arg in extra if re.match(shared, arg)]
    run = subprocess.run(
        [sys.executable, "-m", "ninfer_offload", "generate", str(artifact), "--device", device, "--prompt", PROMPT, "--greedy",
         "--max-tokens", str(max_tokens), "--json", "--spec", "none", *placement],
        capture_output=True, text=True, check=True, env=env,
    )
    return json.loads(run.stdout)["decode_tokens_per_s"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("artifact", type=Path)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--clients", type=int, nargs="+", default=[1, 2, 4, 8])
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--bursts", type=int, default=3, help="bursts of concurrent requests per level; the median's numbers are reported")
    parser.add_argument("--serve-arg", action="append", default=[], help="extra `ninfer serve` option (repeatable)")
    parser.add_argument("--vram-budget", default=None, help="plan the server and the generate reference at this VRAM budget (e.g. 15GiB)")
    parser.add_argument(
        "--routing", choices=["model", "trace"], default="model",
        help="experts picked by the model's router, or per sequence by the calibrated routing trace",
    )
    parser.add_argument("--startup-timeout", type=float, default=600)
    parser.add_argument("--commit", default=None, help="commit measured (the device copy has no git metadata)")
    args = parser.parse_args()
    budget = parse_size(args.vram_budget) if args.vram_budget is not None else None
    extra = args.serve_arg + ([f"--vram-budget={budget}B"] if budget is not None else [])
    env = {key: value for key, value in os.environ.items() if key != BENCH_ROUTING}
    if args.routing == "trace":
        env[BENCH_ROUTING] = "trace"

    report = {
        **gpu_report_header(args.commit),
        "vram_budget_bytes": budget,
        "routing": args.routing,
        "generate_tok_s": generate_tok_s(args.artifact, args.device, args.max_tokens, extra, env),
        "levels": [],
    }
    for clients in args.clients:
        server = Server(args.artifact, args.device, clients, extra, args.startup_timeout, env)
        try:
            if (args.routing == "trace") != any(TRACE_ROUTING_LINE in line for line in server.log):
                raise RuntimeError(f"the server's log does not say it routes as --routing {args.routing} asks")
            report["levels"].append(level(server, clients, args.max_tokens, args.bursts))
        finally:
            server.stop()
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(report, indent=2) + "\n")
        print(json.dumps(report["levels"][-1]), flush=True)


if __name__ == "__main__":
    main()
