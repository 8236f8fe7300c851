"""Decode steps as CUDA graphs: one per (batch bucket, tokens per sequence), captured once per engine
on first use, all sharing one memory pool.

A graph reads its inputs (token ids and the step context) from one static packed buffer
(`step_inputs`) and writes its logits and hidden states to static outputs. A batch is padded to its bucket with
entries on the pool's scratch slot, so padding never touches a live sequence, and capture itself
runs on scratch entries only.
"""

from __future__ import annotations

import torch

from ninfer_offload.runtime.step_inputs import pack_inputs, unpack_inputs


def batch_buckets(max_batch: int) -> list[int]:
    """Powers of two below `max_batch`, then `max_batch`."""
    buckets = [1]
    while buckets[-1] * 2 < max_batch:
        buckets.append(buckets[-1] * 2)
    return sorted({*buckets, max_batch})


class StepGraphs:
    """The captured decode steps of one engine."""

    def __init__(self, engine):
        self.engine = engine
        self.buckets = batch_buckets(engine.state.sequences)
        self.pool = torch.cuda.graph_pool_handle()
        self.graphs: dict[tuple[int, int], tuple[torch.cuda.CUDAGraph, torch.Tensor, tuple[torch.Tensor, torch.Tensor]]] = {}

    def run(self, tokens: list[int], slots: list[int], starts: list[int], tokens_per_sequence: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(logits [B * T, vocab], hidden states [B * T, H]) of one decode step (T tokens per sequence), by graph
        replay. The hidden states are a view of the graph's output: valid until the next replay."""
        batch, t = len(slots), tokens_per_sequence
        bucket = next(b for b in self.buckets if b >= batch)
        graph, packed, (logits, hidden) = self.graphs.get((bucket, t)) or self._capture(bucket, t)
        pad = bucket - batch
        scratch = self.engine.state.scratch_slot
        host = pack_inputs(
            tokens + [0] * (pad * t), slots + [scratch] * pad, starts + [0] * pad, t, self.engine.state.capacity
        )
        packed.copy_(host, non_blocking=True)
        graph.replay()
        return logits[: batch * t].clone(), hidden[: batch * t]

    def _capture(self, bucket: int, t: int) -> tuple[torch.cuda.CUDAGraph, torch.Tensor, tuple[torch.Tensor, torch.Tensor]]:
        engine = self.engine
        scratch = engine.state.scratch_slot
        packed = pack_inputs([0] * (bucket * t), [scratch] * bucket, [0] * bucket, t, engine.state.capacity)
        packed = packed.to(engine.device)
        tokens, ctx = unpack_inputs(packed, bucket, t, prefill=False, keep_states=t > 1, host=None)
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.no_grad(), torch.cuda.stream(stream):
            engine.forward(tokens, ctx)  # compiles kernels and settles allocations, on scratch state
        torch.cuda.current_stream().wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.no_grad(), torch.cuda.graph(graph, pool=self.pool):
            outputs = engine.forward(tokens, ctx)
        self.graphs[(bucket, t)] = (graph, packed, outputs)
        return graph, packed, outputs
