"""The FastAPI application: routes, request checks, and the lifetime of the scheduler and the request worker."""

from __future__ import annotations

import logging
import time
from collections.abc import Collection
from contextlib import asynccontextmanager
from typing import Any

from fastapi import APIRouter, FastAPI, Request
from fastapi.responses import Response

from ninfer_offload.errors import NinferError
from ninfer_offload.serve.chat import chat_completion
from ninfer_offload.serve.completions import completion
from ninfer_offload.serve.context import ServeContext
from ninfer_offload.serve.errors import ErrorGuard, install_error_handlers
from ninfer_offload.serve.guards import ApiKeyGuard, BodyLimit, BrowserGuard, HostGuard
from ninfer_offload.serve.messages import count_tokens, create_message
from ninfer_offload.serve.rehearsal import rehearse
from ninfer_offload.serve.responses import create_response
from ninfer_offload.serve.scheduler import Scheduler

log = logging.getLogger("ninfer.serve")


def create_app(
    engine: Any,
    frontend: Any,
    model_name: str,
    max_context: int,
    max_concurrency: int = 4,
    max_queue: int = 64,
    prefill_chunk: int | None = None,
    api_key: str | None = None,
    max_body_bytes: int = 16 * 1024 * 1024,
    allowed_hosts: Collection[str] | None = None,
    allowed_origins: Collection[str] = (),
    body_timeout: float = 30.0,
    max_uploads: int = 64,
    rehearse_routes: bool | None = None,
) -> FastAPI:
    """An OpenAI-compatible app serving `engine`; its scheduler thread runs while the app is up.
    `allowed_hosts`: the Host header names accepted (any port); None accepts any. `allowed_origins`: web
    page origins ("http://host:port", "*" for any) accepted besides the server's own and loopback ones.
    `body_timeout`: seconds a request body may take to arrive; `max_uploads`: requests sending their
    bodies at once. `rehearse_routes`: send requests through the routes at startup (`serve.rehearsal`);
    None does on CUDA."""
    if api_key is not None and not api_key.strip():
        raise NinferError("the API key is empty: give a key, or none to serve without one")
    scheduler = Scheduler(engine, max_concurrency=max_concurrency, max_queue=max_queue, prefill_chunk=prefill_chunk)
    ctx = ServeContext(frontend, scheduler, model_name, max_context)
    created = int(time.time())

    rehearsing = engine.device.type == "cuda" if rehearse_routes is None else rehearse_routes

    @asynccontextmanager
    async def lifespan(served: FastAPI):
        scheduler.start()
        if rehearsing:
            side_by_side = min(2, max_concurrency)
            sent, seconds = await rehearse(served, model_name, api_key, engine.config.vocab_size, max_context, side_by_side)
            log.info("serving path rehearsed in %.2fs (%d requests)", seconds, sent)
        try:
            yield
        finally:
            scheduler.stop()
            ctx.worker.shutdown(wait=False, cancel_futures=True)

    app = FastAPI(title="ninfer-offload", lifespan=lifespan, docs_url=None, redoc_url=None, openapi_url=None)
    app.state.context = ctx
    install_error_handlers(app)
    app.add_middleware(BodyLimit, limit=max_body_bytes, timeout=body_timeout, max_uploads=max_uploads)
    if api_key is not None:
        app.add_middleware(ApiKeyGuard, api_key=api_key)
    app.add_middleware(BrowserGuard, allowed=allowed_origins)
    if allowed_hosts is not None:
        app.add_middleware(HostGuard, allowed=allowed_hosts)
    app.add_middleware(ErrorGuard)

    @app.api_route("/health", methods=["GET", "HEAD"])
    async def health() -> dict:
        return {"status": "ok", **scheduler.stats()}

    api = APIRouter(prefix="/v1")

    def model_card() -> dict:
        return {"id": model_name, "object": "model", "created": created, "owned_by": "ninfer-offload", "max_model_len": max_context}

    @api.get("/models")
    async def models() -> dict:
        return {"object": "list", "data": [model_card()]}

    @api.get("/models/{model_id:path}")
    async def model(model_id: str) -> dict:
        ctx.check_model(model_id)
        return model_card()

    @api.post("/chat/completions")
    async def chat(request: Request) -> Response:
        return await chat_completion(ctx, request)

    @api.post("/completions")
    async def completions(request: Request) -> Response:
        return await completion(ctx, request)

    @api.post("/responses")
    async def responses(request: Request) -> Response:
        return await create_response(ctx, request)

    @api.post("/messages")
    async def messages(request: Request) -> Response:
        return await create_message(ctx, request)

    @api.post("/messages/count_tokens")
    async def messages_count_tokens(request: Request) -> Response:
        return await count_tokens(ctx, request)

    app.include_router(api)
    return app
