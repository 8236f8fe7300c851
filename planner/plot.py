"""`ninfer plan --plot`: predicted decode tokens/s against the VRAM budget."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

from ninfer_offload.artifact.inventory import Inventory
from ninfer_offload.planner.options import PlanOptions
from ninfer_offload.planner.planner import plan
from ninfer_offload.planner.routing import RoutingStats
from ninfer_offload.profiles import DeviceProfile

GiB = 2**30


def speed_curve(
    inventory: Inventory, profile: DeviceProfile, options: PlanOptions, routing_stats: RoutingStats | None, points: int = 48
) -> list[tuple[float, float, float | None]]:
    """(budget GiB, decode tok/s, decode tok/s with MTP) for feasible budgets up to the card's VRAM."""
    curve = []
    for i in range(1, points + 1):
        budget = profile.vram_bytes * i // points
        p = plan(inventory, profile, replace(options, vram_budget=budget), routing_stats)
        if p.feasible and p.predicted is not None:
            curve.append((budget / GiB, p.predicted.decode_tok_s, p.predicted.decode_tok_s_mtp))
    return curve


def write_plot(path: Path, curves: dict[str, list[tuple[float, float, float | None]]], title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 5))
    for name, curve in curves.items():
        if not curve:
            continue
        xs = [c[0] for c in curve]
        ax.plot(xs, [c[1] for c in curve], marker=".", label=f"{name}: decode")
        if curve[0][2] is not None:
            ax.plot(xs, [c[2] for c in curve], marker=".", linestyle="--", label=f"{name}: decode with MTP")
    ax.set_xlabel("VRAM budget (GiB)")
    ax.set_ylabel("predicted tokens/s (batch 1)")
    ax.set_title(title)
    ax.grid(True, alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
