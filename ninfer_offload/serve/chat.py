"""`POST /v1/chat/completions`: the conversation (`serve.conversation`) in OpenAI's chat format."""

from __future__ import annotations

import time
from collections.abc import AsyncIterator

from fastapi import Request
from fastapi.responses import JSONResponse, Response

from ninfer_offload.serve.body import decode_json, refuse_long_list, validate
from ninfer_offload.serve.context import ServeContext
from ninfer_offload.serve.conversation import PreparedChat, ReplyStream, prepare_chat, whole_reply
from ninfer_offload.serve.errors import APIError
from ninfer_offload.serve.generation import TextGeneration
from ninfer_offload.serve.logprobs import chat_logprobs
from ninfer_offload.serve.protocol import ChatCompletionRequest
from ninfer_offload.serve.sse import event_stream, sse, until_disconnect


def _prepare(ctx: ServeContext, raw: bytes) -> PreparedChat:
    """Decode and validate a request body, then prepare it (on the request worker thread)."""
    data = decode_json(raw)
    refuse_long_list(data, "messages", ctx.max_context)
    refuse_long_list(data, "tools", ctx.max_context)
    return prepare_chat(ctx, validate(data, ChatCompletionRequest, required_first=("messages",)))


async def chat_completion(ctx: ServeContext, request: Request) -> Response:
    chat = await ctx.off_loop(_prepare, ctx, await request.body())
    generation = ctx.start("chatcmpl", chat.request)
    if chat.request.body.stream:
        header = {"id": generation.handle.id, "object": "chat.completion.chunk", "created": int(time.time()), "model": ctx.model_name}

        def failure(error: APIError) -> str:
            return sse({**header, "choices": [{"index": 0, "delta": {}, "logprobs": None, "finish_reason": "error"}], **error.body()})

        return event_stream(_chunks(ctx, header, chat, generation), generation, failure)
    return await until_disconnect(request, generation, _complete(ctx, generation, chat))


async def _complete(ctx: ServeContext, generation: TextGeneration, chat: PreparedChat) -> JSONResponse:
    reply = await whole_reply(chat, generation)
    message: dict = {"role": "assistant", "content": reply.content}
    if reply.reasoning is not None:
        message["reasoning_content"] = reply.reasoning
    if reply.calls:
        message["tool_calls"] = reply.calls
    return JSONResponse(
        {
            "id": generation.handle.id,
            "object": "chat.completion",
            "created": int(time.time()),
            "model": ctx.model_name,
            "choices": [
                {
                    "index": 0,
                    "message": message,
                    "logprobs": chat_logprobs(ctx.frontend, generation, 0) if chat.request.logprobs is not None else None,
                    "finish_reason": "tool_calls" if reply.calls else generation.finish_reason,
                }
            ],
            "usage": generation.usage(),
        }
    )


async def _chunks(ctx: ServeContext, header: dict, chat: PreparedChat, generation: TextGeneration) -> AsyncIterator[str]:
    include_usage = chat.request.body.include_usage
    usage_field = {"usage": None} if include_usage else {}
    sent = 0  # tokens whose log-probabilities went out

    def chunk(delta: dict, finish_reason: str | None = None) -> str:
        nonlocal sent
        logprobs = None
        if chat.request.logprobs is not None and delta:
            logprobs, sent = chat_logprobs(ctx.frontend, generation, sent), len(generation.tokens)
        choice = {"index": 0, "delta": delta, "logprobs": logprobs, "finish_reason": finish_reason}
        return sse({**header, "choices": [choice], **usage_field})

    stream = ReplyStream(chat)

    def chunks(pieces: list[tuple[str, object]]) -> list[str]:
        out = []
        for kind, value in pieces:
            if kind == "tool_call":
                out.append(chunk({"tool_calls": [{"index": stream.calls.index(value), **value}]}))
            else:
                out.append(chunk({"reasoning_content" if kind == "reasoning" else "content": value}))
        return out

    yield chunk({"role": "assistant", "content": ""})
    async for text in generation.deltas():
        for event in chunks(stream.feed(text)):
            yield event
    for event in chunks(stream.flush()):
        yield event
    yield chunk({}, "tool_calls" if stream.calls else generation.finish_reason)
    if include_usage:
        yield sse({**header, "choices": [], "usage": generation.usage()})
