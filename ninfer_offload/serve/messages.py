"""`POST /v1/messages` and `/v1/messages/count_tokens` (Anthropic Messages API): the conversation
(`serve.conversation`) with `thinking`, `text` and `tool_use` content blocks, whole or as Anthropic's
event stream. Errors under these paths take Anthropic's shape (`serve.errors`)."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator

from fastapi import Request
from fastapi.responses import JSONResponse, Response

from ninfer_offload.serve.body import decode_json, refuse_long_list, validate
from ninfer_offload.serve.context import ServeContext
from ninfer_offload.serve.conversation import BlockEvent, PreparedChat, prepare_chat, render_prompt, reply_blocks, whole_reply
from ninfer_offload.serve.errors import APIError, anthropic_error_body
from ninfer_offload.serve.generation import TextGeneration
from ninfer_offload.serve.messages_request import NAMES, CountTokensRequest, MessagesRequest, to_chat
from ninfer_offload.serve.sse import event_stream, sse, until_disconnect


def _checked(ctx: ServeContext, raw: bytes, model: type[CountTokensRequest]) -> CountTokensRequest:
    data = decode_json(raw)
    refuse_long_list(data, "messages", ctx.max_context)
    refuse_long_list(data, "tools", ctx.max_context)
    return validate(data, model, required_first=("model", "max_tokens", "messages"))


def _prepare(ctx: ServeContext, raw: bytes) -> PreparedChat:
    return prepare_chat(ctx, to_chat(_checked(ctx, raw, MessagesRequest)), NAMES)


def _count(ctx: ServeContext, raw: bytes) -> int:
    return len(render_prompt(ctx, to_chat(_checked(ctx, raw, CountTokensRequest)), NAMES))


async def count_tokens(ctx: ServeContext, request: Request) -> JSONResponse:
    return JSONResponse({"input_tokens": await ctx.off_loop(_count, ctx, await request.body())})


async def create_message(ctx: ServeContext, request: Request) -> Response:
    chat = await ctx.off_loop(_prepare, ctx, await request.body())
    generation = ctx.start("msg", chat.request)
    if chat.request.body.stream:

        def failure(error: APIError) -> str:
            return sse(anthropic_error_body(error.status, error.message), event="error")

        return event_stream(_events(ctx, chat, generation), generation, failure, done=None)
    return await until_disconnect(request, generation, _complete(ctx, chat, generation))


def _stop_reason(generation: TextGeneration, called: bool) -> str:
    if called:
        return "tool_use"
    if generation.finish_reason == "length":
        return "max_tokens"
    return "stop_sequence" if generation.stop_string is not None else "end_turn"


def _tool_use(call: dict) -> dict:
    function = call["function"]
    return {"type": "tool_use", "id": call["id"], "name": function["name"], "input": json.loads(function["arguments"])}


def _message(ctx: ServeContext, generation: TextGeneration, content: list[dict], stop_reason: str | None, output_tokens: int) -> dict:
    return {
        "id": generation.handle.id,
        "type": "message",
        "role": "assistant",
        "model": ctx.model_name,
        "content": content,
        "stop_reason": stop_reason,
        "stop_sequence": generation.stop_string if stop_reason == "stop_sequence" else None,
        "usage": {"input_tokens": generation.prompt_tokens, "output_tokens": output_tokens},
    }


async def _complete(ctx: ServeContext, chat: PreparedChat, generation: TextGeneration) -> JSONResponse:
    reply = await whole_reply(chat, generation)
    content: list[dict] = []
    if reply.reasoning:
        content.append({"type": "thinking", "thinking": reply.reasoning, "signature": ""})
    if reply.content:
        content.append({"type": "text", "text": reply.content})
    content += [_tool_use(call) for call in reply.calls]
    stop_reason = _stop_reason(generation, bool(reply.calls))
    return JSONResponse(_message(ctx, generation, content, stop_reason, generation.completion_tokens))


def _block_events(block: BlockEvent) -> list[str]:
    """The content_block_start/delta/stop events of one block event."""
    if block.event == "stop":
        return [sse({"type": "content_block_stop", "index": block.index}, event="content_block_stop")]
    if block.event == "start":
        if block.kind == "tool_call":
            use = _tool_use(block.value)
            start = {**use, "input": {}}
            delta = {"type": "input_json_delta", "partial_json": block.value["function"]["arguments"]}
            return [
                sse({"type": "content_block_start", "index": block.index, "content_block": start}, event="content_block_start"),
                sse({"type": "content_block_delta", "index": block.index, "delta": delta}, event="content_block_delta"),
            ]
        start = {"type": "thinking", "thinking": "", "signature": ""} if block.kind == "reasoning" else {"type": "text", "text": ""}
        return [sse({"type": "content_block_start", "index": block.index, "content_block": start}, event="content_block_start")]
    reasoning = block.kind == "reasoning"
    delta = {"type": "thinking_delta", "thinking": block.value} if reasoning else {"type": "text_delta", "text": block.value}
    return [sse({"type": "content_block_delta", "index": block.index, "delta": delta}, event="content_block_delta")]


async def _events(ctx: ServeContext, chat: PreparedChat, generation: TextGeneration) -> AsyncIterator[str]:
    """message_start; content_block_start, _delta and _stop per block; message_delta (stop reason,
    output tokens); message_stop."""
    yield sse({"type": "message_start", "message": _message(ctx, generation, [], None, 0)}, event="message_start")
    called = False
    async for block in reply_blocks(chat, generation):
        called = called or block.kind == "tool_call"
        for event in _block_events(block):
            yield event
    stop_reason = _stop_reason(generation, called)
    stop_sequence = generation.stop_string if stop_reason == "stop_sequence" else None
    done = {"type": "message_delta", "delta": {"stop_reason": stop_reason, "stop_sequence": stop_sequence},
            "usage": {"output_tokens": generation.completion_tokens}}
    yield sse(done, event="message_delta")
    yield sse({"type": "message_stop"}, event="message_stop")
