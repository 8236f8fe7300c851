"""The serving path run once before a CUDA server listens, so that its first request pays what a later
one does: `Engine.warm_up` compiles the kernels and captures the steps, but the scheduler's own host work
(greedy steps queued one ahead and read behind, a batch's token indexing, the sampler's penalties,
filters and draws, the pinned copies of picked tokens) first runs here, loading its CUDA modules
(lazily loaded on first launch) and allocating its pinned buffers."""

from __future__ import annotations

import asyncio
import logging
import time

from ninfer_offload.runtime.sampling import SamplingParams
from ninfer_offload.serve.scheduler import GenerationRequest, Scheduler

log = logging.getLogger("ninfer.serve")

# A prompt past one captured prefill chunk (replayed in pieces, where the context has room), and a few tokens each.
PROMPT_TOKENS, NEW_TOKENS = 40, 4
GREEDY = SamplingParams(temperature=0.0)
SAMPLED = SamplingParams(temperature=0.7, top_k=40, top_p=0.9, min_p=0.01, presence_penalty=0.1, repetition_penalty=1.1, seed=0)


async def rehearse(scheduler: Scheduler, vocab_size: int, max_context: int) -> float:
    """Run greedy requests side by side (a batched step, up to two) and then a sampled one through
    `scheduler`; the seconds it took. Their sessions are closed when they end, as any request's; one
    that fails is logged (the server still starts: a real request would meet the same error)."""
    began = time.perf_counter()
    loop = asyncio.get_running_loop()
    prompt = [(7 * i + 1) % vocab_size for i in range(max(1, min(PROMPT_TOKENS, max_context - NEW_TOKENS - 1)))]
    side_by_side = min(2, scheduler.max_concurrency)
    for params, count in ((GREEDY, side_by_side), (SAMPLED, 1)):
        request = GenerationRequest(prompt, NEW_TOKENS, params)
        handles = [scheduler.submit(request, loop, request_id=f"warm-up-{i}") for i in range(count)]
        for handle in handles:
            async for _ in handle.tokens():
                pass
            if handle.finished.reason not in ("length", "stop"):
                log.warning("warning: rehearsal request %s ended with %s: %s", handle.id, handle.finished.reason, handle.finished.error)
    return time.perf_counter() - began
