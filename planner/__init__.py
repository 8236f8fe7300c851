"""Memory planner and cost model: `plan(inventory, profile, options, routing_stats=None) -> Placement`.

Pure Python (no torch, no GPU): `ninfer plan` runs on a laptop from an artifact's directory or,
with no artifact, from the official inventory the model contract (`artifact.contract`) generates.
"""

from ninfer_offload.planner.options import PlanOptions, parse_size
from ninfer_offload.planner.placement import PLAN_SCHEMA, ComponentPlacement, Placement, Prediction
from ninfer_offload.planner.planner import plan
from ninfer_offload.planner.routing import RoutingStats, load_routing_stats

__all__ = [
    "PLAN_SCHEMA",
    "ComponentPlacement",
    "Placement",
    "PlanOptions",
    "Prediction",
    "RoutingStats",
    "load_routing_stats",
    "parse_size",
    "plan",
]
