"""The `ninfer` command line: one typer app, each command in its own module under `commands/`."""

from __future__ import annotations

import sys

import typer

from ninfer_offload import __version__
from ninfer_offload.errors import NinferError

app = typer.Typer(
    name="ninfer",
    help="Run Qwen3.6-35B-A3B .ninfer artifacts on GPUs too small to hold them.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
)


def _version(value: bool) -> None:
    if value:
        typer.echo(f"ninfer-offload {__version__}")
        raise typer.Exit()


@app.callback()
def main(
    version: bool = typer.Option(False, "--version", callback=_version, is_eager=True, help="Print the version and exit."),
) -> None:
    """ninfer-offload command line."""


def _register() -> None:
    """Attach every command module's command to the app (one line per command)."""
    from ninfer_offload.commands.convert import convert
    from ninfer_offload.commands.generate import generate
    from ninfer_offload.commands.inspect import inspect
    from ninfer_offload.commands.plan import plan
    from ninfer_offload.commands.profile import profile
    from ninfer_offload.commands.serve import serve

    app.command("inspect")(inspect)
    app.command("plan")(plan)
    app.command("profile")(profile)
    app.command("generate")(generate)
    app.command("convert")(convert)
    app.command("serve")(serve)


def entry() -> None:
    """Console-script entry point: user errors print one line and exit with code 2."""
    try:
        app()
    except NinferError as err:
        typer.echo(f"error: {err}", err=True)
        sys.exit(2)
    except KeyboardInterrupt:
        typer.echo("interrupted", err=True)
        sys.exit(130)


_register()
