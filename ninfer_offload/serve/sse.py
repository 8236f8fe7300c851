"""Server-sent events in the form OpenAI streams use, and the streaming response around them."""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import AsyncIterator, Callable

from fastapi import Request
from fastapi.responses import StreamingResponse

from ninfer_offload.serve.errors import APIError, error_body
from ninfer_offload.serve.generation import TextGeneration

log = logging.getLogger("ninfer.serve")

DONE = "data: [DONE]\n\n"


def sse(payload: dict) -> str:
    """One `data:` event carrying a JSON object."""
    return f"data: {json.dumps(payload, ensure_ascii=False, separators=(',', ':'))}\n\n"


def event_stream(events: AsyncIterator[str], generation: TextGeneration, failure: Callable[[dict], str]) -> StreamingResponse:
    """Stream `events`, end with `[DONE]`. A failure (engine error, shutdown, any exception) ends the
    stream with `failure(error_body)`, a last chunk that says `finish_reason: "error"`; a client that
    goes away cancels the request (Starlette cancels this stream on disconnect)."""

    async def body() -> AsyncIterator[str]:
        try:
            async for event in events:
                yield event
        except APIError as exc:
            yield failure(error_body(exc.status, exc.message, exc.param, exc.code))
        except Exception:
            log.exception("request %s: the stream failed", generation.handle.id)
            message = f"internal server error (request id {generation.handle.id}); the server log has the details"
            yield failure(error_body(500, message, code="internal_error"))
        finally:
            generation.handle.cancel()
        yield DONE

    return StreamingResponse(body(), media_type="text/event-stream", headers={"Cache-Control": "no-cache"})


async def until_disconnect(request: Request, generation: TextGeneration, work):
    """Await `work` (a non-streaming response), cancelling the request if the client goes away."""

    async def watch() -> None:
        while (await request.receive())["type"] != "http.disconnect":
            pass
        generation.handle.cancel()

    watcher = asyncio.ensure_future(watch())
    try:
        return await work
    finally:
        watcher.cancel()
