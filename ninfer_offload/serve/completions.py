"""`POST /v1/completions`: a raw prompt (text or token ids) continued as plain text."""

from __future__ import annotations

import time
from collections.abc import AsyncIterator

from fastapi import Request
from fastapi.responses import JSONResponse, Response

from ninfer_offload.serve.context import ServeContext
from ninfer_offload.serve.errors import APIError
from ninfer_offload.serve.generation import TextGeneration
from ninfer_offload.serve.protocol import CompletionRequest
from ninfer_offload.serve.sse import event_stream, sse, until_disconnect


def _prompt_ids(ctx: ServeContext, body: CompletionRequest) -> list[int]:
    prompt = body.prompt
    if isinstance(prompt, list) and prompt and isinstance(prompt[0], str):
        if len(prompt) != 1:
            raise APIError(400, "only one prompt per request is supported", param="prompt", code="unsupported_value")
        prompt = prompt[0]
    if isinstance(prompt, str):
        return ctx.frontend.encode(prompt)
    vocab = ctx.frontend.vocab_size
    if any(not 0 <= token < vocab for token in prompt):
        raise APIError(400, f"prompt token ids must lie in [0, {vocab})", param="prompt", code="invalid_value")
    return list(prompt)


async def completion(ctx: ServeContext, body: CompletionRequest, request: Request) -> Response:
    ctx.check_model(body.model)
    body.check_supported()
    prompt_ids = _prompt_ids(ctx, body)
    max_tokens = ctx.token_budget(len(prompt_ids), body.token_limit(), "prompt")
    generation = ctx.start("cmpl", prompt_ids, body, max_tokens)
    if body.stream:
        return event_stream(_chunks(ctx, body, generation), generation)
    return await until_disconnect(request, generation, _complete(ctx, generation))


def _body(ctx: ServeContext, generation: TextGeneration, created: int, text: str, finish_reason: str | None) -> dict:
    choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": finish_reason}
    return {"id": generation.handle.id, "object": "text_completion", "created": created, "model": ctx.model_name, "choices": [choice]}


async def _complete(ctx: ServeContext, generation: TextGeneration) -> JSONResponse:
    text = "".join([delta async for delta in generation.deltas()])
    return JSONResponse({**_body(ctx, generation, int(time.time()), text, generation.finish_reason), "usage": generation.usage()})


async def _chunks(ctx: ServeContext, body: CompletionRequest, generation: TextGeneration) -> AsyncIterator[str]:
    created = int(time.time())
    usage_field = {"usage": None} if body.include_usage else {}
    async for text in generation.deltas():
        yield sse({**_body(ctx, generation, created, text, None), **usage_field})
    yield sse({**_body(ctx, generation, created, "", generation.finish_reason), **usage_field})
    if body.include_usage:
        yield sse({**_body(ctx, generation, created, "", None), "choices": [], "usage": generation.usage()})
