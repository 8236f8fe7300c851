"""`ninfer plan --plot`: predicted decode tokens/s against the VRAM budget, the chosen budget marked."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

from ninfer_offload.artifact.inventory import Inventory
from ninfer_offload.planner.options import PlanOptions
from ninfer_offload.planner.placement import Placement
from ninfer_offload.planner.routing import RoutingStats
from ninfer_offload.planner.speculation import plan_load
from ninfer_offload.profiles import DeviceProfile

GiB = 2**30


def speed_curve(
    inventory: Inventory,
    profile: DeviceProfile,
    options: PlanOptions,
    routing_stats: RoutingStats | None,
    points: int = 48,
    auto: bool = False,
) -> list[tuple[float, float, float | None]]:
    """(budget GiB, decode tok/s, decode tok/s with MTP) for feasible budgets up to the card's VRAM, each planned as
    `ninfer plan` plans it (`auto`: `--spec auto`)."""
    curve = []
    for i in range(1, points + 1):
        budget = profile.vram_bytes * i // points
        p = plan_load(inventory, profile, replace(options, vram_budget=budget), routing_stats, auto)
        if p.feasible and p.predicted is not None:
            curve.append((budget / GiB, p.predicted.decode_tok_s, p.predicted.decode_tok_s_mtp))
    return curve


def speed_figure(curves: dict[str, list[tuple[float, float, float | None]]], plans: list[Placement], title: str):
    """The matplotlib figure: each profile's curves, and a dotted line at the budget of its plan
    (with the plan's predicted decode speed marked on it when it fits)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 5))
    for p in plans:
        curve = curves.get(p.profile, [])
        color = None
        if curve:
            xs = [c[0] for c in curve]
            (line,) = ax.plot(xs, [c[1] for c in curve], marker=".", label=f"{p.profile}: decode")
            color = line.get_color()
            if curve[0][2] is not None:
                ax.plot(xs, [c[2] for c in curve], marker=".", linestyle="--", color=color, label=f"{p.profile}: decode with MTP")
        budget = p.vram_budget_bytes / GiB
        ax.axvline(budget, linestyle=":", color=color or "gray", label=f"{p.profile}: chosen budget {budget:.1f} GiB")
        if p.feasible and p.predicted is not None:
            ax.plot([budget], [p.predicted.decode_tok_s], marker="o", markersize=8, color=color or "gray")
    ax.set_xlabel("VRAM budget (GiB)")
    ax.set_ylabel("predicted tokens/s (batch 1)")
    ax.set_title(title)
    ax.grid(True, alpha=0.3)
    ax.legend()
    fig.tight_layout()
    return fig


def write_plot(path: Path, curves: dict[str, list[tuple[float, float, float | None]]], plans: list[Placement], title: str) -> None:
    """Write `speed_figure` to a PNG."""
    import matplotlib.pyplot as plt

    fig = speed_figure(curves, plans, title)
    fig.savefig(path, dpi=120)
    plt.close(fig)
