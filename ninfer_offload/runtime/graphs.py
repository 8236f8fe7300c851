"""Decode steps as CUDA graphs: one per (model, batch bucket, tokens per sequence), captured once per
step runner on first use, all sharing one memory pool. The models are the runner's forwards: the
target (`StepRunner.forward`), the MTP layer drafting (`StepRunner.mtp_forward`) and the target's
hidden states alone for prompt pieces (`StepRunner.hidden`; `prefill`: a short prompt chunk padded
to the smallest of PREFILL_BUCKETS that holds it, or the next pieces of several newcomers' prompts
that a server admits together, each padded to one of `batched_prefill.BATCHED_PREFILL_TOKENS`; padding
rows come after the real ones, their KV rows lie past the sequence's length and are overwritten by
its next tokens, and they leave no GDN state behind: `StepContext.valid`).

A graph reads its inputs (token ids and the step context) from one static packed buffer
(`step_inputs`), the MTP layer also the target hidden states from a static buffer, and writes its
logits and hidden states to static outputs. A batch is padded to its bucket with entries on the
pool's scratch slot, so padding never touches a live sequence, and capture itself runs on scratch
entries only. Every graph records a step of one mode, the plain one (no prefill kernels, nothing
staged: `StepContext.prefill` and `.staged` off); the expert store's step bookkeeping around a replay
reads it so (`ExpertStore.around_step` without a context).
"""

from __future__ import annotations

import torch

from ninfer_offload.runtime.step_inputs import pack_inputs, unpack_inputs


# Token counts a short prompt chunk is padded to. A chunk replayed from a graph costs its kernels' time
# alone; run eagerly, ~900 launches cost ~50 ms of host time (a 24-token prompt on the H200 host: 49 ms
# against 10 ms of kernels). Kept short: each row of a captured step holds split-attention partials
# over the whole capacity (Hq x D fp32 per 256 positions). Captures run on the scratch slot: the last
# bucket is at most its KV rows (`planner.memory.SCRATCH_KV_ROWS`).
PREFILL_BUCKETS = (8, 16, 32)


def batch_buckets(max_batch: int) -> list[int]:
    """Powers of two below `max_batch`, then `max_batch`."""
    buckets = [1]
    while buckets[-1] * 2 < max_batch:
        buckets.append(buckets[-1] * 2)
    return sorted({*buckets, max_batch})


def prefill_bucket(tokens: int) -> int:
    """The captured prefill a chunk of `tokens` tokens pads to."""
    return next(bucket for bucket in PREFILL_BUCKETS if bucket >= tokens)


class StepGraphs:
    """The captured steps of one step runner (`runtime.step_runner.StepRunner`): its forwards, over its state
    pool, in the variant of its expert store's step."""

    def __init__(self, runner):
        self.runner = runner
        self.buckets = batch_buckets(runner.state.sequences)
        self.pool = torch.cuda.graph_pool_handle()
        self.graphs: dict[tuple, tuple[torch.cuda.CUDAGraph, torch.Tensor, torch.Tensor | None, tuple]] = {}

    def run(
        self, tokens: list[int], slots: list[int], starts: list[int], tokens_per_sequence: int,
        device_tokens: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(logits [B * T, vocab], hidden states [B * T, H]) of one target decode step (T tokens per
        sequence; the ids of `device_tokens` [B * T] on the device where given), by graph replay. The
        hidden states are a view of the graph's output: valid until the next replay."""
        logits, hidden = self._replay("target", tokens, slots, starts, tokens_per_sequence, None, device_tokens)
        return logits.clone(), hidden

    def run_mtp(
        self, hidden: torch.Tensor, tokens: list[int], slots: list[int], starts: list[int], tokens_per_sequence: int,
        device_tokens: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(draft logits [B * T, vocab], MTP hidden states [B * T, H]) of one MTP step over target hidden
        states `hidden` [B * T, H] and the tokens that follow them (the ids of `device_tokens` [B * T] on the
        device where given), by graph replay."""
        logits, out = self._replay("mtp", tokens, slots, starts, tokens_per_sequence, hidden, device_tokens)
        return logits.clone(), out.clone()

    def prefill(self, tokens: list[int], slots: list[int], starts: list[int], t: int, valid: list[int]) -> torch.Tensor:
        """Final-normed hidden states [B * t, H] of B prompt pieces of t tokens each (`tokens`, sequence-major; the
        first valid[b] of sequence b's are real, the rest padding) appended to the sequences in `slots` that hold
        `starts` tokens, by replaying the prefill of (batch bucket, t). A view of the graph's output: valid until
        the next replay."""
        batch = len(slots)
        bucket = next(b for b in self.buckets if b >= batch)
        graph, packed, _, hidden = self.capture("prefill", bucket, t)
        pad = bucket - batch
        host = pack_inputs(
            tokens + [0] * (pad * t), slots + [self.runner.state.scratch_slot] * pad, starts + [0] * pad, t,
            self.runner.state.capacity, pinned=True, valid=valid + [t] * pad,
        )
        packed.copy_(host, non_blocking=True)
        graph.replay()
        return hidden[: batch * t]

    def _replay(
        self, model: str, tokens: list[int], slots: list[int], starts: list[int], t: int, hidden: torch.Tensor | None,
        device_tokens: torch.Tensor | None,
    ):
        batch = len(slots)
        bucket = next(b for b in self.buckets if b >= batch)
        graph, packed, hidden_in, (logits, out) = self.capture(model, bucket, t)
        pad = bucket - batch
        state = self.runner.state
        host = pack_inputs(
            tokens + [0] * (pad * t), slots + [state.scratch_slot] * pad, starts + [0] * pad, t, state.capacity, pinned=True
        )
        packed.copy_(host, non_blocking=True)
        if device_tokens is not None:
            packed[: batch * t].copy_(device_tokens)
        if hidden_in is not None:
            hidden_in[: batch * t].copy_(hidden)
        graph.replay()
        return logits[: batch * t], out[: batch * t]

    def capture(self, model: str, bucket: int, t: int) -> tuple[torch.cuda.CUDAGraph, torch.Tensor, torch.Tensor | None, tuple]:
        """The graph of (`model`, `bucket`, `t`) with its static inputs and outputs, captured on first use
        (one per variant of the expert store's step: `ExpertStore.graph_variant`)."""
        runner = self.runner
        key = (model, bucket, t, *runner.store.graph_variant)
        if key in self.graphs:
            return self.graphs[key]
        scratch = runner.state.scratch_slot
        packed = pack_inputs([0] * (bucket * t), [scratch] * bucket, [0] * bucket, t, runner.state.capacity)
        packed = packed.to(runner.device)
        tokens, ctx = unpack_inputs(packed, bucket, t, prefill=False, keep_states=model == "target" and t > 1, host=None)
        hidden_in = None
        if model == "mtp":
            hidden_in = torch.zeros(bucket * t, runner.config.hidden_size, device=runner.device, dtype=runner.dtype)

        def forward():
            if model == "mtp":
                return runner.mtp_forward(hidden_in, tokens, ctx)
            if model == "prefill":
                return runner.hidden(tokens, ctx)
            return runner.forward(tokens, ctx)

        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.no_grad(), torch.cuda.stream(stream):
            forward()  # compiles kernels and settles allocations, on scratch state
        torch.cuda.current_stream().wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.no_grad(), torch.cuda.graph(graph, pool=self.pool):
            outputs = forward()
        self.graphs[key] = (graph, packed, hidden_in, outputs)
        return self.graphs[key]
