"""Speculative decoding benchmark: the cost of verifying K MTP drafts against a one-token step, the
speed at full acceptance, and the projected speed-up at a given acceptance rate.

    python bench/make_synthetic.py /tmp/q36.ninfer
    python bench/spec.py /tmp/q36.ninfer --budgets 15 --out bench/results/spec_h200.json

Per mode (everything resident, then each VRAM budget in GiB planned with `--profile`), after a
64-token prompt:
* `step_s`: one-token decode step (graph replay, logits read back, as a decode loop does), and
  `step_stage_us` / `verify_stage_us`: kernel microseconds by stage of that step and of each
  verification step (`bench/profiling.py`), `step_kernels` / `verify_kernels` their costliest kernels;
* per K = 1..5: `verify_step_ratio`, a (K + 1)-token verification step followed by the commit of
  its first token (the GDN state restore a rejected round pays) over a one-token step timed in turns with
  it (`step_beside_verify_s`: both find an offloaded load's expert cache in the same state, which the
  verifications' reads move; `verify_over_step_s` divides by `step_s` instead, as runs before 2026-12-06
  did: their 15 GiB ratios swung by about 0.05 between runs); `draft_s`, one MTP
  step (`draft_stage_us` / `draft_kernels` its kernels, `draft_runtime` its CUDA runtime calls with
  their host microseconds: where a draft's time goes besides its kernels); `round_s`, a whole
  speculative round at full acceptance, measured in draft-oracle mode (benchmark only: the MTP layer
  runs as usual but its drafts are replaced by the target's own greedy continuation, so every draft
  is accepted; random weights accept almost nothing). In bf16 a verification may break a near-tie of
  the random logits unlike a one-token step (other kernels, equal to rounding): then the generation's
  own output becomes the drafts of the next attempt, until the drafts reproduce it
  (`oracle_attempts`; `oracle_acceptance` of the timed generation);
* the target's routing: random weights route each token to unrelated experts, so a K + 1 token
  verification would read about K + 1 times the experts one token reads; real routing reuses
  experts from token to token. By default (`--routing trace`) every forward is routed by the
  calibrated routing trace (`planner.trace.routing_trace`, 45 % next-token reuse, as
  `bench/offload.py` does), consecutive positions getting consecutive trace tokens;
  `--routing model` keeps the random weights' own routing;
* `plain_s`: seconds per token of plain greedy decoding as `generate` runs it (each step queued on the
  device argmax of the step before, `queue_greedy_step`, the host reading each token one step behind:
  no wait between steps, unlike `step_s`);
* `projected_speedup` at per-draft acceptance `a` (`--acceptance`, the chance that a draft is
  accepted given the previous one was): a round yields E = (1 - a^(K+1)) / (1 - a) tokens, so
  speed-up = E * plain_s / round_s (a rejected round costs about what a full one does);
* `--proposal-head` drafts with the artifact's proposal head (`proposal/head` over `proposal/token_ids`)
  instead of the full output head, `proposal_head` in the report;
* offloaded modes: `verify_store`, the expert store's counts over `--repeats` verifications alone (hit rate, the
  assignments the host computed, record MB read over PCIe per verification: one read per assignment of an expert
  not in VRAM, as the store counts); `--miss-paths pcie cpu` loads each budget once per miss path (mode
  "15 GiB" for pcie, "15 GiB cpu" otherwise).
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import json
import time
from pathlib import Path

import torch

from ninfer_offload.runtime.engine import Engine
from ninfer_offload.runtime.decoder import queue_greedy_step
from ninfer_offload.runtime.sampling import Sampler, SamplingParams
from ninfer_offload.runtime.speculative import MtpSpeculator
from profiling import kernel_breakdown
from provenance import gpu_report_header
from trace_routing import TraceRouting

KERNELS_KEPT = 40  # costliest kernels recorded per step (a verify step has ~30 kinds)
MAX_DRAFTS = 5  # K = 1..MAX_DRAFTS

PROMPT = list(range(1, 65))
GREEDY = SamplingParams(greedy=True)
GiB = 2**30


def synchronized(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def median_seconds(runs: list, repeats: int, device: torch.device) -> list[float]:
    """Median seconds of each of `runs`, timed in turns (the first, the second, ..., the first again), so all see
    the state as it drifts (an offloaded load's expert cache)."""
    times: list[list[float]] = [[] for _ in runs]
    for _ in range(repeats):
        for run, kept in zip(runs, times):
            synchronized(device)
            began = time.perf_counter()
            run()
            synchronized(device)
            kept.append(time.perf_counter() - began)
    return [sorted(kept)[repeats // 2] for kept in times]


class OracleSpeculator(MtpSpeculator):
    """Drafts as usual (same MTP work), then replaces them with the target's greedy continuation. Greedy
    acceptance reads no draft distributions, so none are built (up to 11143c6 a one-hot row of the whole
    vocabulary was made on the host and copied to the device per draft, inside the timed rounds)."""

    continuation: list[int] = []

    def draft(self, k, history):
        drafts, probs = super().draft(k, history)
        start = len(history)
        return (self.continuation[start : start + k] + [0] * k)[:k], probs


def measure(engine: Engine, repeats: int, acceptance: float, tokens: int, trace: bool) -> list[dict]:
    device = engine.device
    routing = TraceRouting(engine, len(PROMPT) + tokens + 64 * repeats * engine.state.step_tokens, len(PROMPT), trace)
    session = engine.session()
    routing.route(0, len(PROMPT))
    session.prefill(PROMPT)

    def step():
        routing.route(session.length, 1)
        int(session.step(7).argmax())

    plain = _plain_greedy(engine, routing, tokens)  # first: it warms an offloaded load's expert cache as the verifications find it
    plain_s = _plain_decode_s(engine, routing, tokens)
    [step_s] = median_seconds([step], repeats, device)
    step_stages, step_kernels, _ = kernel_breakdown(step, 3) if device.type == "cuda" else ({}, [], {})
    runs = []
    for k in range(1, engine.state.step_tokens):
        def verify():
            routing.route(session.length, k + 1)
            logits = engine.step([session], [[7] * (k + 1)])
            int(logits[0, -1].argmax())
            session.commit(1)

        def draft():
            routing.route(session.mtp_length, 1)
            engine.mtp_step([session], torch.zeros(1, engine.config.hidden_size, device=device), [7])
            session.forget_mtp(1)

        step_beside_s, verify_s = median_seconds([step, verify], repeats, device)
        verify_store = store_counts(engine, verify, repeats)
        [draft_s] = median_seconds([draft], repeats, device)
        verify_stages, verify_kernels, _ = kernel_breakdown(verify, 3) if device.type == "cuda" else ({}, [], {})
        draft_stages, draft_kernels, draft_runtime = kernel_breakdown(draft, 3) if device.type == "cuda" else ({}, [], {})
        continuation, attempts = _oracle_continuation(engine, routing, k, plain, tokens)  # (compiles this K's kernels)
        round_s, rounds, _, stats = _oracle_rounds(engine, routing, k, continuation, tokens)
        expected = (1 - acceptance ** (k + 1)) / (1 - acceptance)
        runs.append({
            "draft_tokens": k,
            "step_s": step_s,
            "plain_s": plain_s,
            "step_stage_us": step_stages,
            "step_kernels": step_kernels[:KERNELS_KEPT],
            "verify_s": verify_s,
            "step_beside_verify_s": step_beside_s,
            "verify_step_ratio": verify_s / step_beside_s,
            "verify_over_step_s": verify_s / step_s,
            **({"verify_store": verify_store} if verify_store else {}),
            "verify_stage_us": verify_stages,
            "verify_kernels": verify_kernels[:KERNELS_KEPT],
            "draft_s": draft_s,
            "draft_stage_us": draft_stages,
            "draft_kernels": draft_kernels[:KERNELS_KEPT],
            "draft_runtime": draft_runtime,
            "round_s": round_s,
            "oracle_tok_s": (k + 1) / round_s,
            "oracle_rounds": rounds,
            "oracle_attempts": attempts,
            "oracle_acceptance": stats.accepted / stats.drafted,
            "acceptance": acceptance,
            "expected_tokens_per_round": expected,
            "projected_speedup": expected * plain_s / round_s,
        })
        print(json.dumps(runs[-1]), flush=True)
    session.close()
    return runs


def store_counts(engine: Engine, run, calls: int) -> dict | None:
    """An offloaded store's counts over `calls` calls of `run` (brought up to date, waiting for the device):
    hit rate, host-computed assignments and PCIe record MB per call; None when everything is resident."""
    if not engine.store.offloaded:
        return None
    before = dataclasses.replace(engine.store.stats)
    for _ in range(calls):
        run()
    after = engine.store.stats
    uses = after.uses - before.uses
    return {
        "calls": calls,
        "assignments_per_call": uses / calls,
        "hit_rate": (after.hits - before.hits) / max(uses, 1),
        "cpu_assignments_per_call": (after.cpu_assignments - before.cpu_assignments) / calls,
        "pcie_mb_per_call": (after.pcie_bytes - before.pcie_bytes) / calls / 1e6,
    }


def _plain_greedy(engine: Engine, routing: TraceRouting, tokens: int) -> list[int]:
    """The target's greedy continuation of PROMPT, one step per token, routed as the rounds will be."""
    session = engine.session()
    routing.route(0, len(PROMPT))
    output = [int(session.prefill(PROMPT).argmax())]
    while len(output) < tokens:
        routing.route(session.length, 1)
        output.append(int(session.step(output[-1]).argmax()))
    session.close()
    return output


def _plain_decode_s(engine: Engine, routing: TraceRouting, tokens: int) -> float:
    """Seconds per token of plain greedy decoding after PROMPT as `generate` runs it: each step queued on the device
    argmax of the step before (`queue_greedy_step`) before the host reads the token of the step before it."""
    session = engine.session()
    routing.route(0, len(PROMPT))
    picked = session.prefill(PROMPT).argmax().view(1)
    synchronized(engine.device)
    began = time.perf_counter()
    routing.route(session.length, 1)
    queued = queue_greedy_step(engine, [session], picked)
    for _ in range(tokens - 1):
        routing.route(session.length, 1)
        following = queue_greedy_step(engine, [session], queued.device)
        queued.read()
        queued = following
    queued.read()
    elapsed = time.perf_counter() - began
    session.close()
    return elapsed / tokens


ORACLE_ATTEMPTS = 8


def _oracle_continuation(engine: Engine, routing: TraceRouting, k: int, plain: list[int], tokens: int) -> tuple[list[int], int]:
    """(drafts, attempts): the plain greedy continuation, or where verifications break near-ties another
    way, the output of the last oracle generation, once a generation reproduces its drafts (at most
    ORACLE_ATTEMPTS: each attempt agrees with the one before at least up to where that one diverged)."""
    continuation = plain
    for attempt in range(1, ORACLE_ATTEMPTS + 1):
        output = _oracle_rounds(engine, routing, k, continuation, tokens)[2]
        if output == continuation[: len(output)]:
            break
        continuation = output
    return continuation, attempt


def _oracle_rounds(
    engine: Engine, routing: TraceRouting, k: int, continuation: list[int], tokens: int
) -> tuple[float, int, list[int], object]:
    """(seconds per round, rounds, output, speculation stats) of a greedy generation drafting `continuation`."""
    session = engine.session()
    OracleSpeculator.continuation = continuation
    speculator = OracleSpeculator(session, Sampler(GREEDY), PROMPT, k)
    routing.route(0, len(PROMPT))
    output = [speculator.prefill()]
    synchronized(engine.device)
    began, rounds = time.perf_counter(), 0
    while len(output) < tokens - k - 1:
        routing.route(session.length, k + 1)
        output += speculator.round(output[-1], output)
        rounds += 1
    synchronized(engine.device)
    elapsed = time.perf_counter() - began
    session.close()
    return elapsed / rounds, rounds, output, speculator.stats


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
    parser.add_argument("--routing", choices=("trace", "model"), default="trace", help="route by the calibrated trace or by the weights")
    parser.add_argument("--miss-paths", nargs="+", choices=("pcie", "cpu", "auto"), default=["pcie"],
                        help="each budget once per miss path (`--miss-path` of generate)")
    parser.add_argument("--proposal-head", action="store_true", help="draft with the artifact's proposal head, not the full output head")
    parser.add_argument("--commit", default=None, help="commit measured (the device copy has no git metadata)")
    args = parser.parse_args()
    if args.tokens < MAX_DRAFTS + 3:
        parser.error(f"--tokens must be at least {MAX_DRAFTS + 3}: each K's oracle generation needs a whole round")
    report = {
        **gpu_report_header(args.commit),
        "routing": args.routing,
        "proposal_head": args.proposal_head,
        "runs": [],
    }
    modes = [("resident", {"experts": "resident"})] + [
        (f"{budget:g} GiB" + ("" if path == "pcie" else f" {path}"),
         {"profile": args.profile, "vram_budget": int(budget * GiB), "miss_path": None if path == "pcie" else path})
        for budget in args.budgets for path in args.miss_paths
    ]
    for mode, options in modes:
        engine = Engine.load(
            args.artifact, device=args.device, spec="mtp", draft_tokens=MAX_DRAFTS, proposal_head=args.proposal_head, max_sequences=2,
            **options,
        )
        for run in measure(engine, args.repeats, args.acceptance, args.tokens, args.routing == "trace"):
            report["runs"].append({"mode": mode, **run})
        engine.close()
        del engine
        gc.collect()
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(report, indent=2) + "\n")


if __name__ == "__main__":
    main()
