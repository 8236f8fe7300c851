"""The `ninfer` command line: one typer app, each command in its own module under `commands/`."""

from __future__ import annotations

import sys

import typer

from ninfer_offload import __version__
from ninfer_offload.errors import NinferError

app = typer.Typer(
    name="ninfer",
    help="Run Qwen3.6-35B-A3B .ninfer artifacts on GPUs too small to hold them.",
    add_completion=False,
    pretty_exceptions_enable=False,
    rich_markup_mode=None,  # click's plain help: typer's rich help gives flags a value type (`--json <bool>`)
)


def _version(value: bool) -> None:
    if value:
        typer.echo(f"ninfer-offload {__version__}")
        raise typer.Exit()


@app.callback(invoke_without_command=True)
def main(
    context: typer.Context,
    version: bool = typer.Option(False, "--version", callback=_version, is_eager=True, help="Print the version and exit."),
) -> None:
    """ninfer-offload command line."""
    if context.invoked_subcommand is None:  # no command: the help, as a usage error
        typer.echo(context.get_help(), err=True)
        raise typer.Exit(2)


def _register() -> None:
    """Attach every command module's command to the app (one line per command)."""
    from ninfer_offload.commands.convert import convert
    from ninfer_offload.commands.generate import generate
    from ninfer_offload.commands.inspect import inspect
    from ninfer_offload.commands.plan import plan
    from ninfer_offload.commands.profile import profile
    from ninfer_offload.commands.serve import serve
    from ninfer_offload.commands.tiny import tiny

    app.command("inspect")(inspect)
    app.command("plan")(plan)
    app.command("profile")(profile)
    app.command("generate")(generate)
    app.command("convert")(convert)
    app.command("serve")(serve)
    app.command("tiny")(tiny)


def usage_error(err: typer.TyperException) -> str:
    """One line for a usage error: typer's message, lower-cased and unwrapped, and where the help is."""
    message = " ".join(err.format_message().split()).rstrip(".")
    context = getattr(err, "ctx", None)
    where = f"; see '{context.command_path} --help'" if context is not None else ""
    return f"{message[:1].lower()}{message[1:]}{where}"


def entry() -> None:
    """Console-script entry point: user errors, usage errors included, print one line and exit with code 2."""
    try:
        code = app(prog_name="ninfer", standalone_mode=False)
    except typer.TyperException as err:  # a missing argument, an unknown option, a value of the wrong type
        typer.echo(f"error: {usage_error(err)}", err=True)
        sys.exit(2)
    except NinferError as err:
        typer.echo(f"error: {err}", err=True)
        sys.exit(2)
    except (KeyboardInterrupt, typer.Abort):
        typer.echo("interrupted", err=True)
        sys.exit(130)
    sys.exit(code if isinstance(code, int) else 0)


_register()
