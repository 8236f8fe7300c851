"""`POST /v1/completions`: a raw prompt (text or token ids) continued as plain text."""

from __future__ import annotations

import time
from collections.abc import AsyncIterator

from fastapi import Request
from fastapi.responses import JSONResponse, Response

from ninfer_offload.serve.body import decode_json, refuse_long_list, validate
from ninfer_offload.serve.context import Prepared, ServeContext
from ninfer_offload.serve.errors import APIError
from ninfer_offload.serve.generation import TextGeneration
from ninfer_offload.serve.logprobs import completion_logprobs
from ninfer_offload.serve.protocol import CompletionRequest
from ninfer_offload.serve.sse import event_stream, sse, until_disconnect


def _prompt_ids(ctx: ServeContext, body: CompletionRequest) -> list[int]:
    prompt = body.prompt
    if isinstance(prompt, list) and prompt and isinstance(prompt[0], str):
        if len(prompt) != 1:
            raise APIError(400, "only one prompt per request is supported", param="prompt", code="unsupported_value")
        prompt = prompt[0]
    if isinstance(prompt, str):
        return ctx.encode(prompt, "prompt")
    vocab = ctx.frontend.vocab_size
    if any(not 0 <= token < vocab for token in prompt):
        raise APIError(400, f"prompt token ids must lie in [0, {vocab})", param="prompt", code="invalid_value")
    return list(prompt)


def _prepare(ctx: ServeContext, raw: bytes) -> Prepared:
    """Decode, check and tokenize a request body (on the request worker thread), cheap checks first."""
    data = decode_json(raw)
    refuse_long_list(data, "prompt", ctx.max_context)
    body = validate(data, CompletionRequest, required_first=("prompt",))
    ctx.check_model(body.model)
    body.check_supported()
    sampling = ctx.sampling(body)
    prompt_ids = _prompt_ids(ctx, body)
    budget = ctx.token_budget(len(prompt_ids), body.token_limit(), "prompt")
    return Prepared(body, prompt_ids, budget, sampling, logprobs=body.logprob_count(), cache_prompt=body.cache_prompt)


async def completion(ctx: ServeContext, request: Request) -> Response:
    prepared = await ctx.off_loop(_prepare, ctx, await request.body())
    generation = ctx.start("cmpl", prepared)
    if prepared.body.stream:
        created = int(time.time())

        def failure(error: APIError) -> str:
            return sse({**_body(ctx, generation, created, "", "error"), **error.body()})

        return event_stream(_chunks(ctx, prepared, generation, created), generation, failure)
    return await until_disconnect(request, generation, _complete(ctx, prepared, generation))


def _body(
    ctx: ServeContext, generation: TextGeneration, created: int, text: str, finish_reason: str | None, logprobs: dict | None = None
) -> dict:
    choice = {"index": 0, "text": text, "logprobs": logprobs, "finish_reason": finish_reason}
    return {"id": generation.handle.id, "object": "text_completion", "created": created, "model": ctx.model_name, "choices": [choice]}


async def _complete(ctx: ServeContext, prepared: Prepared, generation: TextGeneration) -> JSONResponse:
    text = "".join([delta async for delta in generation.deltas()])
    logprobs = completion_logprobs(ctx.frontend, generation, 0, 0) if prepared.logprobs is not None else None
    return JSONResponse({**_body(ctx, generation, int(time.time()), text, generation.finish_reason, logprobs), "usage": generation.usage()})


async def _chunks(ctx: ServeContext, prepared: Prepared, generation: TextGeneration, created: int) -> AsyncIterator[str]:
    body = prepared.body
    usage_field = {"usage": None} if body.include_usage else {}
    sent, offset = 0, 0  # tokens whose log-probabilities went out, characters sent
    async for text in generation.deltas():
        logprobs = None
        if prepared.logprobs is not None:
            logprobs = completion_logprobs(ctx.frontend, generation, sent, offset)
            sent, offset = len(generation.tokens), offset + len(text)
        yield sse({**_body(ctx, generation, created, text, None, logprobs), **usage_field})
    yield sse({**_body(ctx, generation, created, "", generation.finish_reason), **usage_field})
    if body.include_usage:
        yield sse({**_body(ctx, generation, created, "", None), "choices": [], "usage": generation.usage()})
