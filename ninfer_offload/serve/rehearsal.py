"""Requests sent through the app's own routes before the server listens, so that its first client request pays
what a later one does. `Engine.warm_up` compiles the kernels and captures the steps; this runs the rest once:
the ASGI middleware stack, body parsing and tokenization on the request worker, the decode loop's host work
(greedy steps queued one ahead and read behind, a batch's token indexing, the sampler's penalties, filters and
draws, the pinned copies of picked tokens), the streamed and the whole responses, and every module those load
lazily (a module imported during a first request holds the GIL that the engine thread waits for)."""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import Awaitable, Callable
from contextlib import contextmanager

log = logging.getLogger("ninfer.serve")

# A prompt past one captured prefill chunk (replayed in pieces, where the context has room), and a few tokens each.
PROMPT_TOKENS, NEW_TOKENS = 40, 4
SAMPLED = {"temperature": 0.7, "top_k": 40, "top_p": 0.9, "min_p": 0.01, "presence_penalty": 0.1, "repetition_penalty": 1.1, "seed": 0}

App = Callable[[dict, Callable, Callable], Awaitable[None]]


async def rehearse(app: App, model: str, api_key: str | None, vocab_size: int, max_context: int, side_by_side: int) -> tuple[int, float]:
    """Send `app` greedy streamed completions side by side (`side_by_side` of them: a batched step), then a
    sampled chat completion; (requests sent, seconds). A request that fails is logged as a warning (the server
    still starts: a client would meet the same error). Their per-request log lines are left out."""
    began = time.perf_counter()
    prompt = [(7 * i + 1) % vocab_size for i in range(max(1, min(PROMPT_TOKENS, max_context - NEW_TOKENS - 1)))]
    greedy = {"model": model, "prompt": prompt, "max_tokens": NEW_TOKENS, "temperature": 0, "stream": True,
              "stream_options": {"include_usage": True}}
    sampled = {"model": model, "messages": [{"role": "user", "content": "Hello"}], "max_tokens": NEW_TOKENS, **SAMPLED}
    headers = [(b"authorization", f"Bearer {api_key}".encode())] if api_key is not None else []
    with _quiet(log):
        await asyncio.gather(*(_post(app, "/v1/completions", greedy, headers) for _ in range(side_by_side)))
        await _post(app, "/v1/chat/completions", sampled, headers)
    return side_by_side + 1, time.perf_counter() - began


async def _post(app: App, path: str, body: dict, headers: list[tuple[bytes, bytes]]) -> None:
    """POST `body` as JSON to `app` over ASGI, as uvicorn hands it a loopback client's request (HTTP spec 2.3: a
    streamed response also listens for the client's disconnect, in a task group whose modules load lazily); a status
    other than 200 is logged."""
    payload = json.dumps(body).encode()
    scope = {
        "type": "http", "asgi": {"version": "3.0", "spec_version": "2.3"}, "http_version": "1.1", "method": "POST",
        "scheme": "http", "path": path, "raw_path": path.encode(), "query_string": b"", "root_path": "",
        "client": ("127.0.0.1", 0), "server": ("127.0.0.1", 0),
        "headers": [(b"host", b"127.0.0.1"), (b"content-type", b"application/json"), (b"content-length", str(len(payload)).encode()),
                    *headers],
    }
    messages = [{"type": "http.request", "body": payload, "more_body": False}]
    status, parts = 0, []

    async def receive() -> dict:
        if messages:
            return messages.pop()
        return await asyncio.Future()  # never set: the client stays, and whoever waits for its disconnect is cancelled at the end

    async def send(message: dict) -> None:
        nonlocal status
        if message["type"] == "http.response.start":
            status = message["status"]
        elif message["type"] == "http.response.body":
            parts.append(message.get("body", b""))

    await app(scope, receive, send)
    if status != 200:
        log.warning("warning: the rehearsal's %s request got %d: %s", path, status, b"".join(parts)[:300].decode(errors="replace"))


@contextmanager
def _quiet(logger: logging.Logger):
    """`logger` at WARNING inside the block: the rehearsal's requests are not the clients'."""
    level = logger.level
    logger.setLevel(max(level, logging.WARNING))
    try:
        yield
    finally:
        logger.setLevel(level)
