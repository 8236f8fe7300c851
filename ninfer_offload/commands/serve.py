"""`ninfer serve ARTIFACT`: a local OpenAI-compatible server (FastAPI + uvicorn) for one model."""

from __future__ import annotations

import errno
import gc
import logging
import os
import signal
import socket
import sys
import time
from pathlib import Path

import typer

from ninfer_offload.commands.bench_routing import apply_bench_routing
from ninfer_offload.commands.load_options import PLACEMENT, PROMPT_CACHE, SPECULATION, load_options
from ninfer_offload.errors import NinferError
from ninfer_offload.planner.request import LoadRequest

log = logging.getLogger("ninfer.serve")


def _configure_logging(level: str) -> None:
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter("%(asctime)s ninfer %(message)s", "%H:%M:%S"))
    log.addHandler(handler)
    log.setLevel(level.upper())
    log.propagate = False


class _Stopped(BaseException):
    """SIGTERM arrived before the server took over the signals (during the model load); a BaseException, like
    KeyboardInterrupt, so that no `except Exception` on the way swallows it."""


def _raise_stopped(signum: int, frame) -> None:
    raise _Stopped


def _check_can_listen(host: str, port: int) -> None:
    """A one-line error before the model loads when HOST:PORT cannot be bound: an address that is not this
    machine's (or no address at all), a busy port."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as uvicorn does
        try:
            probe.bind((host, port))
        except socket.gaierror as err:
            reason = f"no such address or host name ({err.strerror})"
            raise NinferError(f"cannot listen on {host}:{port}: {reason}; give another --host") from None
        except (TypeError, UnicodeError):  # a name the resolver cannot even encode
            raise NinferError(f"cannot listen on {host!r}: not a valid host name; give another --host") from None
        except OSError as err:
            if err.errno == errno.EADDRNOTAVAIL:
                remedy = "it is not an address of this machine; give another --host"
            else:
                remedy = "choose another --port (0 picks a free one)"
            raise NinferError(f"cannot listen on {host}:{port}: {err.strerror or err}; {remedy}") from None


def _frontend(artifact: Path, template: str | None):
    """The model's text frontend, read from the artifact before the slow load: a model without a chat template
    (and no --chat-template) is refused there."""
    from ninfer_offload.artifact.reader import open_artifact
    from ninfer_offload.frontend import Frontend

    with open_artifact(artifact) as opened:
        frontend = Frontend.from_artifact(opened, chat_template=template)
    if frontend.template is None:
        raise NinferError("the model has no chat template; pass one with --chat-template FILE")
    return frontend


@load_options(*PLACEMENT, *SPECULATION, *PROMPT_CACHE, "max_context", "kv_dtype", prompt_cache=True)
def serve(
    artifact: Path = typer.Argument(..., help="The .ninfer model file to serve."),
    host: str = typer.Option("127.0.0.1", help="Address to bind; the default accepts local clients only."),
    port: int = typer.Option(8080, min=0, max=65535, help="TCP port (0 picks a free one)."),
    device: str = typer.Option("cpu", help="Compute device: cpu or cuda[:N]."),
    max_concurrency: int = typer.Option(4, min=1, help="Sequences decoded together in one batched forward pass."),
    max_queue: int = typer.Option(64, min=0, help="Requests allowed to wait for a slot; beyond it: 429."),
    prefill_chunk: int | None = typer.Option(
        None, min=1,
        help="Prompt tokens per prefill step (default: 512 beside running streams, a whole chunk with host experts; the "
        "load's chunks, or spans of chunks with host experts, for a prompt alone).",
    ),
    api_key: str | None = typer.Option(None, envvar="NINFER_API_KEY", help="Require 'Authorization: Bearer KEY' on /v1 routes."),
    allowed_host: list[str] | None = typer.Option(
        None, "--allowed-host",
        help="Also accept this Host header name (repeatable); on a loopback address only localhost, 127.0.0.1 and [::1] are.",
    ),
    allowed_origin: list[str] | None = typer.Option(
        None, "--allowed-origin",
        help="Also accept POSTs from web pages of this origin, e.g. http://app.lan:3000 (repeatable; * for any).",
    ),
    served_model_name: str | None = typer.Option(None, help="Model id clients must send (default: the file name without .ninfer)."),
    chat_template: Path | None = typer.Option(None, help="Jinja chat template file replacing the model's."),
    shutdown_timeout: float = typer.Option(30.0, min=0, help="Seconds in-flight requests get to finish on SIGINT/SIGTERM."),
    log_level: str = typer.Option("info", help="debug, info, warning or error."),
    *,
    load: dict,
) -> None:
    """Serve ARTIFACT with OpenAI-compatible routes: /v1/chat/completions, /v1/completions, /v1/models, /health."""
    if api_key is None and os.environ.get("NINFER_API_KEY") == "":
        api_key = ""  # typer reads an empty variable as unset, which would serve without a key
    if api_key is not None and not api_key.strip():
        raise NinferError("the API key is empty (--api-key or NINFER_API_KEY): give a key, or leave both unset to serve without one")
    if log_level.lower() not in ("debug", "info", "warning", "error"):
        raise NinferError(f"--log-level must be debug, info, warning or error, got {log_level!r}")
    if not artifact.is_file():
        from ninfer_offload.artifact.reader import not_an_artifact_file

        raise not_an_artifact_file(artifact)
    template = None
    if chat_template is not None:
        try:
            template = chat_template.read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as err:
            raise NinferError(f"cannot read chat template {chat_template}: {err}") from None

    from ninfer_offload.serve.guards import LOOPBACK_NAMES, is_loopback

    _configure_logging(log_level)
    if not is_loopback(host) and api_key is None:
        log.warning(
            "warning: %s is not a loopback address and no --api-key is set: anyone who can reach this port can use the model", host
        )
    extra_hosts = list(allowed_host or [])
    allowed_hosts = [*LOOPBACK_NAMES, *extra_hosts] if is_loopback(host) or extra_hosts else None
    _check_can_listen(host, port)
    options = dict(
        max_concurrency=max_concurrency, max_queue=max_queue, prefill_chunk=prefill_chunk, api_key=api_key,
        allowed_hosts=allowed_hosts, allowed_origins=list(allowed_origin or []),
    )
    previous = signal.signal(signal.SIGTERM, _raise_stopped)  # until the server takes the signals over
    try:
        request = LoadRequest(**load, max_sequences=max_concurrency)
        _load_and_serve(artifact, device, template, request, served_model_name, options, host, port, log_level, shutdown_timeout)
    except _Stopped:
        log.info("stopped by SIGTERM before serving")
    finally:
        signal.signal(signal.SIGTERM, previous)


def _load_and_serve(
    artifact: Path, device: str, template: str | None, request: LoadRequest, served_model_name: str | None, options: dict,
    host: str, port: int, log_level: str, shutdown_timeout: float,
) -> None:
    """Load the model and serve it until a signal stops the server (`options`: `create_app`'s)."""
    from ninfer_offload.runtime.engine import Engine
    from ninfer_offload.serve.app import create_app
    from ninfer_offload.serve.server import graceful_server

    frontend = _frontend(artifact, template)
    log.info("loading %s on %s", artifact, device)
    start = time.perf_counter()
    engine = Engine.load(artifact, request, device=device, progress=True)
    config = engine.config
    log.info(
        "loaded %s in %.1fs: %d layers, %d experts (top-%d), vocab %d, %s %s, context %d tokens",
        artifact, time.perf_counter() - start, config.num_layers, config.num_experts, config.top_k,
        config.vocab_size, engine.device, str(engine.dtype).removeprefix("torch."), engine.max_context,
    )
    log.info(engine.placement_report())
    routing = apply_bench_routing(engine)
    if routing is not None:
        log.info(routing)
    if engine.needs_warm_up:
        log.info("warming up: compiling the kernels and capturing the decode steps")
        warm_up = engine.warm_up(options["prefill_chunk"])
        log.info(
            "warm-up (kernels compiled, decode steps captured) took %.1fs: prefills %.1fs, decode step captures %.1fs",
            warm_up.seconds, warm_up.prefills, warm_up.captures,
        )
    else:
        log.info("no warm-up on %s: its eager ops compile nothing and capture no steps", engine.device)
    # The loaded engine's ~450,000 Python objects out of the garbage collector's reach for the process's life: a full
    # collection over them took 120-150 ms on an H100 machine's host, a pause inside whichever request would trigger it.
    gc.collect()
    gc.freeze()
    name = served_model_name or artifact.name.removesuffix(".ninfer")
    app = create_app(engine, frontend, name, engine.max_context, **options)
    cache = engine.prompt_cache
    log.info(
        "serving model '%s' at /v1 (%d concurrent sequences, queue %d, %s%s%s)",
        name, options["max_concurrency"], options["max_queue"], engine.speculation.describe(),
        f", prompt cache {cache.device_bytes / 2**30:.2f} GiB on {engine.device.type} + {cache.host_bytes / 2**30:.2f} GiB host"
        if cache is not None else "",
        ", API key required" if options["api_key"] else "",
    )
    graceful_server(app, host, port, log_level.lower(), shutdown_timeout).run()
