"""Speculative decoding benchmark: the cost of verifying K MTP drafts against a one-token step, the
speed at full acceptance, and the projected speed-up at a given acceptance rate.

    python bench/make_synthetic.py /tmp/q36.ninfer
    python bench/spec.py /tmp/q36.ninfer --budgets 15 --out bench/results/spec_h200.json

Per mode (everything resident, then each VRAM budget in GiB planned with `--profile`), after a
64-token prompt:
* `step_s`: one-token decode step (graph replay, logits read back, as a decode loop does);
* per K = 1..5: `verify_step_ratio`, a (K + 1)-token verification step followed by the commit of
  its first token (the GDN state restore a rejected round pays) over `step_s`; `draft_s`, one MTP
  step; `round_s`, a whole speculative round at full acceptance, measured in draft-oracle mode
  (benchmark only: the MTP layer runs as usual but its drafts are replaced by the target's own
  greedy continuation, so every draft is accepted; random weights accept almost nothing);
* `projected_speedup` at per-draft acceptance `a` (`--acceptance`, the chance that a draft is
  accepted given the previous one was): a round yields E = (1 - a^(K+1)) / (1 - a) tokens, so
  speed-up = E * step_s / round_s (a rejected round costs about what a full one does).
"""

from __future__ import annotations

import argparse
import gc
import json
import time
from pathlib import Path

import torch

from ninfer_offload.runtime.engine import Engine
from ninfer_offload.runtime.generate import generate
from ninfer_offload.runtime.sampling import Sampler, SamplingParams
from ninfer_offload.runtime.speculative import MtpSpeculator
from provenance import gpu_report_header

PROMPT = list(range(1, 65))
GREEDY = SamplingParams(greedy=True)
GiB = 2**30


def synchronized(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def median_seconds(run, repeats: int, device: torch.device) -> float:
    times = []
    for _ in range(repeats):
        synchronized(device)
        began = time.perf_counter()
        run()
        synchronized(device)
        times.append(time.perf_counter() - began)
    return sorted(times)[len(times) // 2]


class OracleSpeculator(MtpSpeculator):
    """Drafts as usual (same MTP work), then replaces them with the target's greedy continuation."""

    continuation: list[int] = []

    def draft(self, k, history):
        drafts, _ = super().draft(k, history)
        start = len(history)
        drafts = (self.continuation[start : start + k] + [0] * k)[:k]
        vocab = self.engine.config.vocab_size
        return drafts, [torch.nn.functional.one_hot(torch.tensor(d), vocab).float().to(self.engine.device) for d in drafts]


def measure(engine: Engine, repeats: int, acceptance: float, tokens: int) -> list[dict]:
    device = engine.device
    session = engine.session()
    session.prefill(PROMPT)
    step_s = median_seconds(lambda: int(session.step(7).argmax()), repeats, device)
    runs = []
    plain = _plain_greedy(engine, tokens)
    for k in range(1, engine.state.step_tokens):
        def verify():
            logits = engine.step([session], [[7] * (k + 1)])
            int(logits[0, -1].argmax())
            session.commit(1)

        verify_s = median_seconds(verify, repeats, device)
        draft_s = median_seconds(lambda: session.mtp(torch.zeros(1, engine.config.hidden_size, device=device), [7]), repeats, device)
        _oracle_rounds(engine, k, plain, tokens)  # the first generation compiles the kernels of this K
        round_s, rounds = _oracle_rounds(engine, k, plain, tokens)
        expected = (1 - acceptance ** (k + 1)) / (1 - acceptance)
        runs.append({
            "draft_tokens": k,
            "step_s": step_s,
            "verify_s": verify_s,
            "verify_step_ratio": verify_s / step_s,
            "draft_s": draft_s,
            "round_s": round_s,
            "oracle_tok_s": (k + 1) / round_s,
            "oracle_rounds": rounds,
            "acceptance": acceptance,
            "expected_tokens_per_round": expected,
            "projected_speedup": expected * step_s / round_s,
        })
        print(json.dumps(runs[-1]), flush=True)
    session.close()
    return runs


def _plain_greedy(engine: Engine, tokens: int) -> list[int]:
    spec, engine.spec_tokens = engine.spec_tokens, 0
    try:
        return generate(engine, PROMPT, tokens, GREEDY).run().token_ids
    finally:
        engine.spec_tokens = spec


def _oracle_rounds(engine: Engine, k: int, continuation: list[int], tokens: int) -> tuple[float, int]:
    """(seconds per round, rounds) of a greedy generation whose drafts are the true continuation."""
    session = engine.session()
    OracleSpeculator.continuation = continuation
    speculator = OracleSpeculator(session, Sampler(GREEDY), PROMPT, k)
    output = [speculator.prefill()]
    synchronized(engine.device)
    began, rounds = time.perf_counter(), 0
    while len(output) < tokens - k - 1:
        output += speculator.round(output[-1], output)
        rounds += 1
    synchronized(engine.device)
    elapsed = time.perf_counter() - began
    assert output[: len(continuation)] == continuation[: len(output)], "oracle drafts must reproduce the greedy output"
    session.close()
    return elapsed / rounds, rounds


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("artifact", type=Path)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--budgets", type=float, nargs="*", default=[15], help="VRAM budgets in GiB (besides all resident)")
    parser.add_argument("--profile", default="h200")
    parser.add_argument("--acceptance", type=float, default=0.72, help="per-draft acceptance for the projection")
    parser.add_argument("--tokens", type=int, default=96, help="greedy tokens of the oracle generation")
    parser.add_argument("--repeats", type=int, default=21)
    parser.add_argument("--commit", default=None, help="commit measured (the device copy has no git metadata)")
    args = parser.parse_args()
    report = {
        **gpu_report_header(args.commit),
        "runs": [],
    }
    modes = [("resident", {"experts": "resident"})] + [
        (f"{budget:g} GiB", {"profile": args.profile, "vram_budget": int(budget * GiB)}) for budget in args.budgets
    ]
    for mode, options in modes:
        engine = Engine.load(args.artifact, device=args.device, spec="mtp", draft_tokens=5, max_sequences=2, **options)
        for run in measure(engine, args.repeats, args.acceptance, args.tokens):
            report["runs"].append({"mode": mode, **run})
        engine.close()
        del engine
        gc.collect()
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(report, indent=2) + "\n")


if __name__ == "__main__":
    main()
