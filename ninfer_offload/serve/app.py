"""The FastAPI application: routes, API key, body limit, and the scheduler's lifetime."""

from __future__ import annotations

import hmac
import time
from contextlib import asynccontextmanager
from typing import Any

from fastapi import APIRouter, FastAPI, Request
from starlette.exceptions import HTTPException
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from ninfer_offload.runtime.sampling import Sampler
from ninfer_offload.serve.chat import chat_completion
from ninfer_offload.serve.completions import completion
from ninfer_offload.serve.context import ServeContext
from ninfer_offload.serve.errors import error_response, install_error_handlers
from ninfer_offload.serve.protocol import ChatCompletionRequest, CompletionRequest
from ninfer_offload.serve.scheduler import Scheduler


class BodyLimit:
    """Refuse request bodies larger than `limit` bytes with 413 (declared or streamed length)."""

    def __init__(self, app: ASGIApp, limit: int) -> None:
        self.app = app
        self.limit = limit

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        declared = dict(scope["headers"]).get(b"content-length")
        if declared is not None and declared.isdigit() and int(declared) > self.limit:
            await error_response(413, self._message())(scope, receive, send)
            return
        seen = 0

        async def counted() -> Message:
            nonlocal seen
            message = await receive()
            seen += len(message.get("body", b""))
            if seen > self.limit:
                raise HTTPException(413, self._message())
            return message

        await self.app(scope, counted, send)

    def _message(self) -> str:
        return f"request body is larger than {self.limit} bytes"


class ApiKeyGuard:
    """Require `Authorization: Bearer KEY` on every `/v1/` route (checked before the body is read)."""

    def __init__(self, app: ASGIApp, api_key: str) -> None:
        self.app = app
        self.api_key = api_key.encode()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and scope["path"].startswith("/v1/"):
            scheme, _, token = dict(scope["headers"]).get(b"authorization", b"").partition(b" ")
            if scheme.lower() != b"bearer" or not hmac.compare_digest(token.strip(), self.api_key):
                message = "missing or invalid API key (send 'Authorization: Bearer KEY')"
                await error_response(401, message, code="invalid_api_key")(scope, receive, send)
                return
        await self.app(scope, receive, send)


def create_app(
    engine: Any,
    frontend: Any,
    model_name: str,
    max_context: int,
    max_concurrency: int = 4,
    max_queue: int = 64,
    prefill_chunk: int = 512,
    api_key: str | None = None,
    max_body_bytes: int = 16 * 1024 * 1024,
) -> FastAPI:
    """An OpenAI-compatible app serving `engine`; its scheduler thread runs while the app is up."""
    scheduler = Scheduler(engine, Sampler, max_concurrency=max_concurrency, max_queue=max_queue, prefill_chunk=prefill_chunk)
    ctx = ServeContext(frontend, scheduler, model_name, max_context)
    created = int(time.time())

    @asynccontextmanager
    async def lifespan(_: FastAPI):
        scheduler.start()
        try:
            yield
        finally:
            scheduler.stop()

    app = FastAPI(title="ninfer-offload", lifespan=lifespan, docs_url=None, redoc_url=None, openapi_url=None)
    app.state.context = ctx
    install_error_handlers(app)
    app.add_middleware(BodyLimit, limit=max_body_bytes)
    if api_key is not None:
        app.add_middleware(ApiKeyGuard, api_key=api_key)

    @app.get("/health")
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
    async def chat(body: ChatCompletionRequest, request: Request):
        return await chat_completion(ctx, body, request)

    @api.post("/completions")
    async def completions(body: CompletionRequest, request: Request):
        return await completion(ctx, body, request)

    app.include_router(api)
    return app
