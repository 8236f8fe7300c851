"""`ninfer inspect ARTIFACT [--json] [--verify]`: what a `.ninfer` file holds, from its directory alone.

Without `--verify` only the header and JSON directory are read (no payload byte is touched);
`--verify` decodes every tensor and checks code/scale validity with a progress bar on stderr, then
checks what a load needs (`commands.loadable`): the resources parse and every binding the loader
reads resolves with its shape.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import typer
from rich.console import Console
from rich.progress import BarColumn, DownloadColumn, Progress, TextColumn, TimeRemainingColumn
from rich.table import Table

from ninfer_offload.artifact.errors import ArtifactError
from ninfer_offload.artifact.inventory import EXECUTED, Inventory
from ninfer_offload.artifact.reader import Artifact, open_artifact
from ninfer_offload.artifact.verify import verify_artifact

ROUTED_ROLES = ("routed_gate_up", "routed_down")


def summarize(artifact: Artifact) -> dict:
    """The inspect report as plain JSON-ready data."""
    inventory = Inventory.from_artifact(artifact)
    counts = inventory.count_by_format()
    by_role = inventory.bytes_by_role()
    routed = sum(by_role.get(r, 0) for r in ROUTED_ROLES)
    resources = {}
    for cid, comp in artifact.components.items():
        for role, oid in comp.resources.items():
            resources[oid] = {"component": cid, "role": role, "bytes": artifact.object(oid).bytes}
    for obj in artifact.objects:
        if obj.kind == "resource" and obj.id not in resources:
            resources[obj.id] = {"component": None, "role": None, "bytes": obj.bytes}
    return {
        "path": str(artifact.path),
        "container_version": artifact.version,
        "artifact_id": artifact.artifact_id.hex() if artifact.artifact_id else None,
        "model_id": artifact.model_id,
        "files": [{"path": f.path, "payload_bytes": f.payload_bytes} for f in artifact.files],
        "payload_bytes": artifact.payload_bytes,
        "objects": {"total": len(artifact.objects), "tensors": len(inventory.tensors), "resources": len(inventory.resources)},
        "components": {
            cid: {"config": c.config, "target": c.target, "resources": c.resources, "proposal": c.proposal, "run": cid in EXECUTED}
            for cid, c in artifact.components.items()
        },
        "bytes_by_format": {f: {"objects": counts[f], "bytes": b} for f, b in sorted(inventory.bytes_by_format().items())},
        "bytes_by_component": dict(sorted(inventory.bytes_by_component().items())),
        "bytes_by_role": dict(sorted(by_role.items())),
        "routed_expert_bytes": routed,
        "other_tensor_bytes": inventory.total_bytes - routed,
        "expert_banks": [
            {
                "component": b.component, "layer": b.layer, "experts": b.num_experts, "bank_bytes": b.bank_bytes,
                "record_bytes": b.expert_bytes,
            }
            for b in inventory.banks
        ],
        "bindings": len(artifact.bindings),
        "uses": len(artifact.uses),
        "resources": resources,
        "metadata": artifact.metadata,
        "provenance": artifact.provenance,
    }


def _gib(n: int) -> str:
    return f"{n / 2**30:.3f} GiB"


def _bytes_table(title: str, rows: dict[str, int], total: int) -> Table:
    table = Table(title=title, title_justify="left")
    table.add_column(title.split()[-1])
    table.add_column("bytes", justify="right")
    table.add_column("size", justify="right")
    table.add_column("share", justify="right")
    for key, value in sorted(rows.items(), key=lambda kv: -kv[1]):
        table.add_row(key, f"{value:,}", _gib(value), f"{100 * value / max(total, 1):.1f}%")
    return table


def _print_report(console: Console, report: dict) -> None:
    ident = report["artifact_id"] or f"model_id {report['model_id']}"
    console.print(f"[bold]{report['path']}[/bold]: container v{report['container_version']} ({ident})", soft_wrap=True)
    files = report["files"]
    console.print(
        f"files: {len(files)} (entry{f' + {len(files) - 1} parts' if len(files) > 1 else ''}), "
        f"payload {report['payload_bytes']:,} bytes ({_gib(report['payload_bytes'])})",
        soft_wrap=True,
    )
    obj = report["objects"]
    console.print(
        f"objects: {obj['total']} ({obj['tensors']} tensors, {obj['resources']} resources), "
        f"bindings: {report['bindings']}, uses: {report['uses']}",
        soft_wrap=True,
    )
    comps = Table(title="components", title_justify="left")
    for col in ("component", "run", "target", "proposal", "config"):
        comps.add_column(col, overflow="fold")
    for cid, c in report["components"].items():
        proposal = json.dumps(c["proposal"]) if c["proposal"] else "-"
        run = "yes" if c["run"] else "no (carried, unused)"
        comps.add_row(cid, run, c["target"] or "-", proposal, json.dumps(c["config"], separators=(",", ":")))
    console.print(comps)
    fmt = Table(title="bytes by format", title_justify="left")
    for col, just in (("format", "left"), ("objects", "right"), ("bytes", "right"), ("size", "right")):
        fmt.add_column(col, justify=just)
    for name, row in report["bytes_by_format"].items():
        fmt.add_row(name, str(row["objects"]), f"{row['bytes']:,}", _gib(row["bytes"]))
    console.print(fmt)
    tensor_total = report["routed_expert_bytes"] + report["other_tensor_bytes"]
    console.print(_bytes_table("bytes by component", report["bytes_by_component"], tensor_total))
    console.print(_bytes_table("bytes by role", report["bytes_by_role"], tensor_total))
    console.print(
        f"routed experts: {report['routed_expert_bytes']:,} bytes ({_gib(report['routed_expert_bytes'])}) in "
        f"{len(report['expert_banks'])} banks; everything else: {report['other_tensor_bytes']:,} bytes "
        f"({_gib(report['other_tensor_bytes'])})",
        soft_wrap=True,
    )
    if report["resources"]:
        res = Table(title="resources", title_justify="left")
        for col, just in (("object", "left"), ("component", "left"), ("role", "left"), ("bytes", "right")):
            res.add_column(col, justify=just)
        for oid, r in report["resources"].items():
            res.add_row(oid, r["component"] or "-", r["role"] or "-", f"{r['bytes']:,}")
        console.print(res)


def _verify(artifact: Artifact) -> dict[str, list[str]]:
    total = sum(o.bytes for o in artifact.objects)
    columns = (TextColumn("verify"), BarColumn(), DownloadColumn(), TimeRemainingColumn())
    console = Console(stderr=True)
    with Progress(*columns, console=console, transient=True, disable=not console.is_terminal) as bar:
        task = bar.add_task("verify", total=total)
        return verify_artifact(artifact, lambda n: bar.advance(task, n))


def _print_verify(console: Console, checked: dict, tensors: int) -> None:
    for oid, found in checked["problems"].items():
        console.print(f"[red]invalid[/red] {oid}: {'; '.join(found)}", soft_wrap=True)
    if not checked["problems"]:
        console.print(f"verify: all {tensors} tensors decode with valid codes and scales", soft_wrap=True)
    for problem in checked["load_problems"]:
        console.print(f"[red]cannot load[/red] {problem}", soft_wrap=True)
    if not checked["load_problems"]:
        console.print("verify: the resources parse and every binding the loader reads resolves with its shape", soft_wrap=True)


def _raise_problems(checked: dict) -> None:
    bad = checked["problems"]
    if bad:
        first = next(iter(bad))
        raise ArtifactError(f"verify found invalid payload in {len(bad)} objects (first: {first!r}: {bad[first][0]})")
    if checked["load_problems"]:
        raise ArtifactError(f"verify: generate and serve would refuse this artifact: {checked['load_problems'][0]}")


def inspect(
    artifact: Path = typer.Argument(..., help="The .ninfer entry file."),
    as_json: bool = typer.Option(False, "--json", help="Print the report as one JSON document."),
    verify: bool = typer.Option(
        False, "--verify", help="Decode every tensor and check code/scale validity, then check what a load needs."
    ),
) -> None:
    """Show an artifact's container version, components, objects and bytes by format, component and role."""
    console = Console()
    with open_artifact(artifact) as art:
        report = summarize(art)
        if verify:
            from ninfer_offload.commands.loadable import load_problems, resource_problems

            problems = _verify(art)
            loading = resource_problems(art) + load_problems(art, progress=sys.stderr.isatty())
            report["verify"] = {"tensors": report["objects"]["tensors"], "problems": problems, "load_problems": loading}
    if as_json:
        typer.echo(json.dumps(report, indent=1))
    else:
        _print_report(console, report)
        if verify:
            _print_verify(console, report["verify"], report["objects"]["tensors"])
    if verify:
        _raise_problems(report["verify"])
