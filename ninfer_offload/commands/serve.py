"""`ninfer serve ARTIFACT`: a local OpenAI-compatible server (FastAPI + uvicorn) for one model."""

from __future__ import annotations

import logging
import os
import socket
import sys
import time
from pathlib import Path

import typer

from ninfer_offload.errors import NinferError

log = logging.getLogger("ninfer.serve")


def _configure_logging(level: str) -> None:
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter("%(asctime)s ninfer %(message)s", "%H:%M:%S"))
    log.addHandler(handler)
    log.setLevel(level.upper())
    log.propagate = False


def _plan_summary(engine, profile: str, max_concurrency: int, prefill_chunk: int) -> str:
    """One line from the memory planner for this artifact, device profile and serving options."""
    from ninfer_offload.artifact.inventory import Inventory
    from ninfer_offload.planner import PlanOptions, plan
    from ninfer_offload.profiles import load_profile

    options = PlanOptions(max_context=engine.max_context, concurrency=max_concurrency, speculative="none", prefill_chunk=prefill_chunk)
    placement = plan(Inventory.from_artifact(engine.artifact), load_profile(profile), options)
    gib = 2**30
    verdict = "fits" if placement.feasible else f"does not fit ({placement.reason})"
    speed = f", predicted decode {placement.predicted.decode_tok_s:.1f} tok/s" if placement.predicted else ""
    return (
        f"plan on {placement.profile}: {verdict}; VRAM {placement.vram_used_bytes / gib:.2f} of "
        f"{placement.vram_budget_bytes / gib:.2f} GiB, {placement.experts_resident}/{placement.experts_total} "
        f"experts resident, {placement.host_pinned_bytes / gib:.2f} GiB pinned host, "
        f"KV for {placement.kv_capacity_tokens} tokens{speed}"
    )


def _check_can_listen(host: str, port: int) -> None:
    """A one-line error before the model loads when HOST:PORT cannot be bound (a busy port)."""
    if port == 0:
        return
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as uvicorn does
        try:
            probe.bind((host, port))
        except OSError as err:
            reason = err.strerror or err
            raise NinferError(f"cannot listen on {host}:{port}: {reason}; choose another --port (0 picks a free one)") from None


def serve(
    artifact: Path = typer.Argument(..., help="The .ninfer model file to serve."),
    host: str = typer.Option("127.0.0.1", help="Address to bind; the default accepts local clients only."),
    port: int = typer.Option(8080, min=0, max=65535, help="TCP port (0 picks a free one)."),
    device: str = typer.Option("cpu", help="Compute device: cpu or cuda[:N]."),
    experts: str = typer.Option("resident", help="Routed experts: resident (on the device) or host (staged per use)."),
    miss_path: str = typer.Option(
        "staged", "--miss-path",
        help="With --experts host: staged (copied to the device), cpu (computed on the host) or auto (both, split by measured rates).",
    ),
    profile: str | None = typer.Option(
        None, help="Device profile (name, TOML file or auto) for the startup plan summary; default auto on CUDA."
    ),
    max_concurrency: int = typer.Option(4, min=1, help="Sequences decoded together in one batched forward pass."),
    max_queue: int = typer.Option(64, min=0, help="Requests allowed to wait for a slot; beyond it: 429."),
    max_context: int | None = typer.Option(None, min=1, help="Tokens per sequence, prompt + completion (default: min(model's, 32768))."),
    prefill_chunk: int = typer.Option(512, min=1, help="Prompt tokens per prefill step, interleaved with the others' decode."),
    api_key: str | None = typer.Option(None, envvar="NINFER_API_KEY", help="Require 'Authorization: Bearer KEY' on /v1 routes."),
    allowed_host: list[str] | None = typer.Option(
        None, "--allowed-host",
        help="Also accept this Host header name (repeatable); on a loopback address only localhost, 127.0.0.1 and [::1] are.",
    ),
    served_model_name: str | None = typer.Option(None, help="Model id clients must send (default: the file name without .ninfer)."),
    chat_template: Path | None = typer.Option(None, help="Jinja chat template file replacing the model's."),
    shutdown_timeout: float = typer.Option(30.0, min=0, help="Seconds in-flight requests get to finish on SIGINT/SIGTERM."),
    log_level: str = typer.Option("info", help="debug, info, warning or error."),
) -> None:
    """Serve ARTIFACT with OpenAI-compatible routes: /v1/chat/completions, /v1/completions, /v1/models, /health."""
    if api_key is None and os.environ.get("NINFER_API_KEY") == "":
        api_key = ""  # typer reads an empty variable as unset, which would serve without a key
    if api_key is not None and not api_key.strip():
        raise NinferError("the API key is empty (--api-key or NINFER_API_KEY): give a key, or leave both unset to serve without one")
    if log_level.lower() not in ("debug", "info", "warning", "error"):
        raise NinferError(f"--log-level must be debug, info, warning or error, got {log_level!r}")
    if not artifact.is_file():
        raise NinferError(f"no such artifact file: {artifact}")
    template = None
    if chat_template is not None:
        try:
            template = chat_template.read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as err:
            raise NinferError(f"cannot read chat template {chat_template}: {err}") from None

    from ninfer_offload.frontend import Frontend
    from ninfer_offload.runtime.engine import Engine
    from ninfer_offload.serve.app import create_app
    from ninfer_offload.serve.guards import LOOPBACK_NAMES, is_loopback
    from ninfer_offload.serve.server import graceful_server

    _configure_logging(log_level)
    if not is_loopback(host) and api_key is None:
        log.warning(
            "warning: %s is not a loopback address and no --api-key is set: anyone who can reach this port can use the model", host
        )
    extra_hosts = list(allowed_host or [])
    allowed_hosts = [*LOOPBACK_NAMES, *extra_hosts] if is_loopback(host) or extra_hosts else None
    _check_can_listen(host, port)
    start = time.perf_counter()
    if miss_path not in ("staged", "cpu", "auto"):
        raise NinferError(f"--miss-path must be staged, cpu or auto, got {miss_path!r}")
    engine = Engine.load(
        artifact, device=device, experts=experts, max_context=max_context, max_sequences=max_concurrency,
        miss_path=None if miss_path == "staged" else miss_path,
    )
    frontend = Frontend.from_artifact(engine.artifact, chat_template=template)
    if frontend.template is None:
        raise NinferError("the model has no chat template; pass one with --chat-template FILE")
    config = engine.config
    log.info(
        "loaded %s in %.1fs: %d layers, %d experts (top-%d), vocab %d, %s %s, experts %s, context %d tokens",
        artifact, time.perf_counter() - start, config.num_layers, config.num_experts, config.top_k,
        config.vocab_size, engine.device, str(engine.dtype).removeprefix("torch."),
        experts if experts == "resident" else f"{experts} (misses {miss_path})", engine.max_context,
    )
    if profile is not None or engine.device.type == "cuda":
        log.info(_plan_summary(engine, profile or "auto", max_concurrency, prefill_chunk))
    name = served_model_name or artifact.name.removesuffix(".ninfer")
    app = create_app(
        engine, frontend, name, engine.max_context,
        max_concurrency=max_concurrency, max_queue=max_queue, prefill_chunk=prefill_chunk, api_key=api_key,
        allowed_hosts=allowed_hosts,
    )
    log.info(
        "serving model '%s' at /v1 (%d concurrent sequences, queue %d%s)",
        name, max_concurrency, max_queue, ", API key required" if api_key else "",
    )
    graceful_server(app, host, port, log_level.lower(), shutdown_timeout).run()
