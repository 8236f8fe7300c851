"""Server-sent events (OpenAI's `data:`-only form, or named events as Responses and Anthropic Messages
streams use), and the streaming response around them."""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import AsyncIterator, Callable

from fastapi import Request
from fastapi.responses import StreamingResponse

from ninfer_offload.serve.errors import APIError
from ninfer_offload.serve.generation import TextGeneration

log = logging.getLogger("ninfer.serve")

DONE = "data: [DONE]\n\n"


def sse(payload: dict, event: str | None = None) -> str:
    """One event carrying a JSON object, named `event` when given."""
    data = f"data: {json.dumps(payload, ensure_ascii=False, separators=(',', ':'))}\n\n"
    return data if event is None else f"event: {event}\n{data}"


def event_stream(
    events: AsyncIterator[str], generation: TextGeneration, failure: Callable[[APIError], str], done: str | None = DONE
) -> StreamingResponse:
    """Stream `events`, end with `done` (OpenAI's `[DONE]`; None: nothing). A failure (engine error,
    shutdown, any exception) ends the stream with `failure(error)`, a last event that reports it in the
    API's own form; a client that goes away cancels the request (Starlette cancels this stream on disconnect)."""

    async def body() -> AsyncIterator[str]:
        try:
            async for event in events:
                yield event
        except APIError as exc:
            yield failure(exc)
        except Exception:
            log.exception("request %s: the stream failed", generation.handle.id)
            message = f"internal server error (request id {generation.handle.id}); the server log has the details"
            yield failure(APIError(500, message, code="internal_error"))
        finally:
            generation.handle.cancel()
        if done is not None:
            yield done

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
