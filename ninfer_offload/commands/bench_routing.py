"""Benchmark routing for `ninfer serve` and `ninfer generate`, not an option users see: with the environment
variable NINFER_BENCH_ROUTING=trace (bench/serve.py sets it), each sequence is routed by its own stretch of the
calibrated routing trace (`runtime.trace_routing`) instead of the model's router."""

from __future__ import annotations

import os

from ninfer_offload.errors import NinferError

BENCH_ROUTING = "NINFER_BENCH_ROUTING"


def apply_bench_routing(engine) -> str | None:
    """Route `engine` (loaded, before its warm-up captures a step) as NINFER_BENCH_ROUTING asks: a line saying so,
    or None when it is unset."""
    value = os.environ.get(BENCH_ROUTING, "")
    if not value:
        return None
    if value != "trace":
        raise NinferError(f"{BENCH_ROUTING} must be 'trace' or unset, got {value!r}")
    from ninfer_offload.runtime.trace_routing import SequenceTraceRouting

    routing = SequenceTraceRouting.for_engine(engine)
    engine.store.route_by_trace(routing)
    return f"benchmark routing: each sequence by its own stretch of a {routing.tokens}-token routing trace ({BENCH_ROUTING}=trace)"
