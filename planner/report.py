"""Rich rendering of placements for `ninfer plan`: one plan in detail, or several side by side.

Tables fit the terminal: below WIDE columns (an 80-column terminal, or output to a pipe) they drop
their vertical rules and the side-by-side figures take their short forms. Every string that comes from
the user, a profile or an artifact (names, sources, reasons, assumptions) is printed as it is: rich's
markup in it (`[engine]`) is escaped.
"""

from __future__ import annotations

from statistics import mean

from rich import box
from rich.console import Console, Group
from rich.markup import escape
from rich.table import Table

from ninfer_offload.planner.cost import general_assumptions
from ninfer_offload.planner.options import SPECULATION_MIN_SPEEDUP
from ninfer_offload.planner.placement import Placement
from ninfer_offload.profiles import DeviceProfile

GiB = 2**30
WIDE = 100  # columns from which tables keep their full borders and long figures


def gib(n: float) -> str:
    return f"{n / GiB:.2f} GiB"


def _rate(value: float | None) -> str:
    return "-" if value is None else f"{value:,.1f}"


def _expert_line(p: Placement, compact: bool = False) -> str:
    counts = [len(ids) for ids in p.resident_experts]
    return f"{min(counts)}/{mean(counts):.0f}/{max(counts)}" if compact else f"{min(counts)} / {mean(counts):.1f} / {max(counts)}"


def _expert_range(p: Placement) -> str:
    counts = [len(ids) for ids in p.resident_experts]
    return f"{min(counts)}-{max(counts)}"


def _table(title: str, compact: bool, **options) -> Table:
    """A titled table; compact ones have no vertical rules and no padding at their edges."""
    if compact:
        options.update(box=box.SIMPLE_HEAD, pad_edge=False)
    return Table(title=title, title_justify="left", **options)


def render_plan(p: Placement, source: str, compact: bool = False) -> Group:
    """Every section of one plan: components, memory, experts, predictions and assumptions."""
    o = p.options
    spec = f"MTP x{o.drafts}" + (" + proposal head" if o.proposal_head else "") if o.speculating else "none"
    head = Table.grid(padding=(0, 2))
    head.add_row("profile", escape(p.profile))
    head.add_row("model", escape(source))
    head.add_row(
        "options",
        f"context {o.max_context}, concurrency {o.concurrency}, KV {o.kv_dtype}, speculation {spec}, "
        f"vision {'on' if o.vision else 'off'}, prefill chunk {o.prefill_chunk}",
    )
    head.add_row("status", "[green]feasible[/]" if p.feasible else f"[red]does not fit[/]: {escape(p.reason)}")
    for note in p.notes:
        head.add_row("note", escape(note))

    components = _table("Weights by component", compact)
    for col in ("component", "stored", "placement", "VRAM", "pinned host"):
        components.add_column(col, justify="left" if col in ("component", "placement") else "right")
    for name, c in p.components.items():
        components.add_row(escape(name), gib(c.bytes), c.placement, gib(c.vram_bytes), gib(c.host_bytes))

    memory = _table("Memory", compact)
    memory.add_column("item")
    memory.add_column("bytes", justify="right")
    weights_vram = sum(c.vram_bytes for c in p.components.values())
    memory.add_row("weights in VRAM", gib(weights_vram))
    for name, size in p.runtime.items():
        memory.add_row(name.replace("_", " "), gib(size))
    memory.add_row("[bold]VRAM used[/]", f"[bold]{gib(p.vram_used_bytes)}[/]")
    memory.add_row("VRAM budget (card)", f"{gib(p.vram_budget_bytes)} ({gib(p.vram_total_bytes)})")
    memory.add_row("VRAM free", gib(p.vram_free_bytes))
    memory.add_row("pinned host used / budget", f"{gib(p.host_pinned_bytes)} / {gib(p.host_budget_bytes)}")
    memory.add_row("host memory of the process", gib(p.host_process_bytes))

    experts = _table("Routed experts (text layers)", compact)
    experts.add_column("item")
    experts.add_column("value", justify="right")
    experts.add_row("resident", f"{p.experts_resident} of {p.experts_total}")
    experts.add_row("per layer min / mean / max", _expert_line(p, compact))
    experts.add_row("routing mass covered", f"{p.routing_mass_resident:.1%}")
    experts.add_row("routing statistics", escape(p.routing_stats))
    experts.add_row("staging slots", str(p.staging_slots))
    experts.add_row("KV capacity (tokens)", f"{p.kv_capacity_tokens:,}")

    parts = [head, components, memory, experts]
    if p.predicted is not None:
        r = p.predicted
        speed = _table("Predicted speed", compact)
        speed.add_column("item")
        speed.add_column("value", justify="right")
        speed.add_row("decode tok/s (batch 1)", _rate(r.decode_tok_s))
        if r.cache_hit_rate is not None:
            speed.add_row("expert cache hit rate", f"{r.cache_hit_rate:.1%}")
        if r.decode_tok_s_batch is not None:
            speed.add_row(f"decode tok/s, {p.options.concurrency} sequences in all", _rate(r.decode_tok_s_batch))
        speed.add_row("decode tok/s with MTP", _rate(r.decode_tok_s_mtp))
        speed.add_row("speculation", _speculation(r))
        speed.add_row("prefill tok/s", _rate(r.prefill_tok_s))
        speed.add_row("VRAM read per token", gib(r.vram_bytes_per_token))
        speed.add_row("PCIe per token", f"{r.pcie_bytes_per_token / 2**20:.1f} MiB")
        parts += [speed, _assumption_table(r.assumptions, compact)]
    return Group(*parts)


def _speculation(prediction) -> str:
    """The decision `--spec auto` takes on this plan, with the projected speed-up behind it."""
    speedup = prediction.speculation_speedup
    if speedup is None:
        return "off (not planned)"
    verdict = "on" if prediction.speculates else "off"
    return f"{verdict}: x{speedup:.2f} projected (on from x{SPECULATION_MIN_SPEEDUP:g})"


def _hit_rate(p: Placement) -> str:
    rate = p.predicted.cache_hit_rate if p.predicted is not None else None
    return "-" if rate is None else f"{rate:.1%}"


def render_comparison(plans: list[Placement], profiles: list[DeviceProfile], compact: bool = False) -> Group:
    """Key figures of several plans, one column per profile, then the shared assumptions."""
    by_name = {profile.name: profile for profile in profiles}
    table = _table("Plans side by side", compact)
    table.add_column("")
    for p in plans:
        table.add_column(escape(p.profile), justify="right")
    size = (lambda n: f"{n / GiB:.1f}") if compact else gib  # compact: GiB in the label
    unit = " GiB" if compact else ""
    rows = [
        ("feasible", lambda p: "yes" if p.feasible else "no"),
        ("memory bandwidth GB/s", lambda p: f"{by_name[p.profile].memory_bandwidth_gbs:g}"),
        ("pinned H2D GB/s", lambda p: f"{by_name[p.profile].h2d_bandwidth_gbs:g}"),
        ("tensor TFLOPS", lambda p: f"{by_name[p.profile].tensor_tflops:g}"),
        ("VRAM budget" + unit, lambda p: size(p.vram_budget_bytes)),
        ("VRAM used" + unit, lambda p: size(p.vram_used_bytes)),
        ("pinned host" + unit, lambda p: size(p.host_pinned_bytes)),
        ("host memory" + unit, lambda p: size(p.host_process_bytes)),
        ("experts resident", lambda p: f"{p.experts_resident}" if compact else f"{p.experts_resident}/{p.experts_total}"),
        ("per layer min-max", _expert_range) if compact else ("per layer min/mean/max", _expert_line),
        ("routing mass covered", lambda p: f"{p.routing_mass_resident:.1%}"),
        ("cache hit rate", _hit_rate),
        ("token embedding", lambda p: p.components["token_embedding"].placement),
        ("staging slots", lambda p: str(p.staging_slots)),
        ("KV capacity (tokens)", lambda p: f"{p.kv_capacity_tokens:,}"),
        ("decode tok/s", lambda p: _rate(p.predicted.decode_tok_s if p.predicted else None)),
        ("decode tok/s MTP", lambda p: _rate(p.predicted.decode_tok_s_mtp if p.predicted else None)),
        ("prefill tok/s", lambda p: _rate(p.predicted.prefill_tok_s if p.predicted else None)),
    ]
    for label, cell in rows:
        table.add_row(label, *(cell(p) for p in plans))
    for p in plans:
        if not p.feasible:
            table.caption = (table.caption + "\n" if table.caption else "") + escape(f"{p.profile}: {p.reason}")
    options = plans[0].options
    lines = [
        # where each card's engine timings and launch constants come from
        *dict.fromkeys(line for p in plans if p.predicted for line in p.predicted.assumptions[:2]),
        *general_assumptions(options, plans[0].routing_stats),
    ]
    return Group(table, _assumption_table(lines, compact))


def _assumption_table(lines, compact: bool) -> Table:
    table = _table("Assumptions", compact, show_header=False)
    table.add_column("assumption")
    for line in lines:
        table.add_row(escape(f"- {line}"))
    return table


def print_plans(plans: list[Placement], profiles: list[DeviceProfile], source: str) -> None:
    """One plan in detail, or several side by side, at the width of the terminal (80 columns in a pipe)."""
    console = Console()
    compact = console.width < WIDE
    console.print(render_comparison(plans, profiles, compact) if len(plans) > 1 else render_plan(plans[0], source, compact))
