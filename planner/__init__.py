"""Memory planner and cost model."""
