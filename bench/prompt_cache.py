"""The prompt cache on the server's decode loop (`runtime.decoder.Decoder`, no HTTP), one load per placement:

    python bench/prompt_cache.py /tmp/q36.ninfer --out bench/results/prompt_cache_h100.json

* a chat: turn k's prompt is turn k - 1's prompt, its reply and a new message (`--chat-new`: the new tokens of each
  turn; by default an 8K first message, then short and long ones, growing to ~16K tokens);
* an agent: one `--agent-context`-token context, then `--agent-calls` calls each adding its own 2-200-token tail.
Every request runs twice on one engine: with the cache (what the server does) and with `cache_prompt` off (a cold
run, which neither reads nor saves the cache), greedy. Per request: TTFT and decode tok/s (first to last token) of
both, the seconds after the last token until the sequence ended (`end_*_s`: a cached request saves its state there),
the tokens resumed (`cached_tokens`), whether both gave the same tokens, and the cache's device and host bytes after it.
Placements: all experts resident and each `--budgets` GiB. On the CPU (`--device cpu`) it runs on the tiny model.
"""

from __future__ import annotations

import argparse
import json
import random
import time
from pathlib import Path

import torch

from provenance import gpu_report_header

CHAT_NEW = [8192, 150, 2000, 120, 2000, 180, 1500, 100, 1200, 200]  # new tokens per turn: ~16K after 10 turns


def timed(engine, prompt: list[int], max_tokens: int, cache: bool) -> dict:
    """TTFT, decode tok/s (first to last token), the seconds from the last token to the sequence's end (where a
    cached request saves its state), tokens and cached tokens of one greedy request through a fresh decode loop."""
    from ninfer_offload.runtime.decoder import Decoder, GenerationRequest, Token
    from ninfer_offload.runtime.sampling import SamplingParams

    if engine.device.type == "cuda":
        torch.cuda.synchronize(engine.device)
    decoder = Decoder(engine)
    began = time.perf_counter()
    sequence = decoder.add(GenerationRequest(prompt, max_tokens, SamplingParams(greedy=True), cache_prompt=cache))
    tokens, first, last = [], None, None
    while not sequence.ended:
        for event in decoder.step():
            if isinstance(event, Token):
                tokens.append(event.token)
                last = time.perf_counter()
                first = first or last
    if engine.device.type == "cuda":
        torch.cuda.synchronize(engine.device)
    ended = time.perf_counter()
    decode = (len(tokens) - 1) / (last - first) if first and len(tokens) > 1 and last > first else 0.0
    return {
        "ttft_s": (first or ended) - began, "decode_tok_s": decode, "end_s": ended - (last or ended), "tokens": tokens,
        "cached_tokens": sequence.cached_tokens,
    }


def measure(engine, prompt: list[int], max_tokens: int) -> tuple[dict, list[int]]:
    """One request cached and cold: the row of the report and the cached run's tokens."""
    cached = timed(engine, prompt, max_tokens, cache=True)
    cold = timed(engine, prompt, max_tokens, cache=False)
    device, host = engine.prompt_cache.memory()
    row = {
        "prompt_tokens": len(prompt), "cached_tokens": cached["cached_tokens"],
        "ttft_cold_s": cold["ttft_s"], "ttft_cached_s": cached["ttft_s"], "ttft_ratio": cached["ttft_s"] / cold["ttft_s"],
        "decode_cold_tok_s": cold["decode_tok_s"], "decode_cached_tok_s": cached["decode_tok_s"],
        "end_cold_s": cold["end_s"], "end_cached_s": cached["end_s"],
        "same_tokens": cached["tokens"] == cold["tokens"], "cache_device_bytes": device, "cache_host_bytes": host,
    }
    print(json.dumps(row), flush=True)
    return row, cached["tokens"]


def chat(engine, new_tokens: list[int], max_tokens: int, rng: random.Random) -> list[dict]:
    vocab = engine.config.vocab_size
    prompt: list[int] = []
    rows = []
    for new in new_tokens:
        history = len(prompt)
        prompt = prompt + [rng.randrange(vocab) for _ in range(new)]
        row, reply = measure(engine, prompt, max_tokens)
        rows.append({"history_tokens": history, "new_tokens": new, **row})
        prompt = prompt + reply
    return rows


def agent(engine, context: int, calls: int, tails: tuple[int, int], max_tokens: int, rng: random.Random) -> list[dict]:
    vocab = engine.config.vocab_size
    shared = [rng.randrange(vocab) for _ in range(context)]
    rows = []
    for _ in range(calls):
        tail = rng.randint(*tails)
        row, _ = measure(engine, shared + [rng.randrange(vocab) for _ in range(tail)], max_tokens)
        rows.append({"tail_tokens": tail, **row})
    return rows


def summary(chat_rows: list[dict], agent_rows: list[dict], limits: tuple[int, int]) -> dict:
    """The targets' numbers: TTFT ratios of long-history short turns (8K+ history, <= 200 new tokens; the agent's calls
    after the first two), decode speed cached / cold, hit rate, the most memory each tier held against its bound."""
    rows = chat_rows + agent_rows
    short_turns = [r["ttft_ratio"] for r in chat_rows if r["history_tokens"] >= 8192 and r["new_tokens"] <= 200]
    decode = [r["decode_cached_tok_s"] / r["decode_cold_tok_s"] for r in rows if r["decode_cold_tok_s"]]
    return {
        "chat_short_turn_ttft_ratio_max": max(short_turns, default=None),
        "agent_ttft_ratio_max": max((r["ttft_ratio"] for r in agent_rows[2:]), default=None),
        "decode_speed_ratio_min": min(decode, default=None),
        "hit_rate": sum(r["cached_tokens"] for r in rows) / sum(r["prompt_tokens"] for r in rows),
        "all_same_tokens": all(r["same_tokens"] for r in rows),
        "cache_device_bytes_max": max(r["cache_device_bytes"] for r in rows), "cache_device_limit": limits[0],
        "cache_host_bytes_max": max(r["cache_host_bytes"] for r in rows), "cache_host_limit": limits[1],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("artifact", type=Path)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--budgets", type=float, nargs="*", default=[15], help="VRAM budgets in GiB (besides all resident)")
    parser.add_argument("--profile", default="auto", help="the card the budgets are planned for")
    parser.add_argument("--chat-new", type=int, nargs="+", default=CHAT_NEW, help="new prompt tokens of each chat turn")
    parser.add_argument("--agent-context", type=int, default=20480)
    parser.add_argument("--agent-calls", type=int, default=20)
    parser.add_argument("--agent-tails", type=int, nargs=2, default=[2, 200], help="shortest and longest tail of a call")
    parser.add_argument("--max-tokens", type=int, default=32, help="tokens generated per request")
    parser.add_argument("--prompt-cache-vram", default=None, help="device tier (default: the load's)")
    parser.add_argument("--prompt-cache-host", default=None, help="host tier (default: the load's)")
    parser.add_argument("--every", type=int, default=None, help="tokens between saved positions (default: the load's)")
    parser.add_argument("--max-context", type=int, default=32768)
    parser.add_argument("--commit", default=None, help="commit measured (the device copy has no git metadata)")
    args = parser.parse_args()

    from ninfer_offload.runtime.engine import Engine

    placements = [("resident", {"experts": "resident"})]
    if args.device != "cpu":
        placements += [(f"{budget:g}GiB", {"vram_budget": f"{budget:g}GiB", "profile": args.profile}) for budget in args.budgets]
    report = {**gpu_report_header(args.commit), "artifact": str(args.artifact), "args": {k: str(v) for k, v in vars(args).items()}}
    report["loads"] = []
    for name, placement in placements:
        engine = Engine.load(
            args.artifact, device=args.device, max_sequences=1, max_context=args.max_context, prompt_cache=True,
            prompt_cache_vram=args.prompt_cache_vram, prompt_cache_host=args.prompt_cache_host, prompt_cache_every=args.every,
            **placement,
        )
        engine.warm_up()
        rng = random.Random(0)
        cache = engine.prompt_cache
        chat_rows = chat(engine, args.chat_new, args.max_tokens, rng)
        agent_rows = agent(engine, args.agent_context, args.agent_calls, tuple(args.agent_tails), args.max_tokens, rng)
        load = {
            "placement": name, "placement_report": engine.placement_report(), "save_every": cache.every,
            "summary": summary(chat_rows, agent_rows, (cache.device_bytes, cache.host_bytes)), "cache": cache.stats(),
            "chat": chat_rows, "agent": agent_rows,
        }
        print(json.dumps({"placement": name, **load["summary"]}), flush=True)
        report["loads"].append(load)
        engine.close()
        del engine, cache
        if args.device != "cpu":
            torch.cuda.empty_cache()
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=2) + "\n")


if __name__ == "__main__":
    main()
