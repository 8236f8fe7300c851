"""`POST /v1/chat/completions`: render the conversation, generate, split reasoning and tool calls."""

from __future__ import annotations

import time
from collections.abc import AsyncIterator

from fastapi import Request
from fastapi.responses import JSONResponse, Response

from ninfer_offload.errors import NinferError
from ninfer_offload.serve.context import ServeContext
from ninfer_offload.serve.errors import APIError
from ninfer_offload.serve.generation import TextGeneration
from ninfer_offload.serve.protocol import ChatCompletionRequest
from ninfer_offload.serve.reasoning import ReasoningStream, prompt_leaves_thinking_open, split_reasoning
from ninfer_offload.serve.sse import event_stream, sse, until_disconnect
from ninfer_offload.serve.tool_calls import ToolCallStream, parse_tool_calls


def _messages(body: ChatCompletionRequest) -> list[dict]:
    """Messages as plain dicts for the template; content parts must be text and are joined."""
    messages = []
    for index, message in enumerate(body.messages):
        data = message.model_dump(exclude_none=True)
        if isinstance(message.content, list):
            for part in message.content:
                if part.type != "text" or part.text is None:
                    raise APIError(
                        400,
                        f"messages.{index}.content: only text content parts are supported (got '{part.type}')",
                        param=f"messages.{index}.content",
                        code="unsupported_value",
                    )
            data["content"] = "".join(part.text for part in message.content)
        if data["role"] == "developer":
            data["role"] = "system"
        messages.append(data)
    return messages


def _prompt(ctx: ServeContext, body: ChatCompletionRequest) -> str:
    options = dict(body.chat_template_kwargs or {})
    if {"messages", "tools"} & options.keys():
        raise APIError(400, "chat_template_kwargs cannot replace messages or tools", param="chat_template_kwargs", code="invalid_value")
    enable_thinking = bool(options.pop("enable_thinking", True))
    tools = [tool.model_dump(exclude_none=True) for tool in body.tools] if body.uses_tools else None
    try:
        return ctx.frontend.render(_messages(body), tools=tools, enable_thinking=enable_thinking, **options)
    except NinferError as exc:
        raise APIError(400, str(exc), param="messages", code="invalid_messages") from None


async def chat_completion(ctx: ServeContext, body: ChatCompletionRequest, request: Request) -> Response:
    ctx.check_model(body.model)
    body.check_supported()
    prompt = _prompt(ctx, body)
    prompt_ids = ctx.frontend.encode(prompt)
    max_tokens = ctx.token_budget(len(prompt_ids), body.token_limit(), "messages")
    thinking = prompt_leaves_thinking_open(prompt)
    tools = [tool.model_dump() for tool in body.tools] if body.uses_tools else None
    generation = ctx.start("chatcmpl", prompt_ids, body, max_tokens)
    if body.stream:
        return event_stream(_chunks(ctx, body, generation, thinking, tools), generation)
    return await until_disconnect(request, generation, _complete(ctx, generation, thinking, tools))


async def _complete(ctx: ServeContext, generation: TextGeneration, thinking: bool, tools: list[dict] | None) -> JSONResponse:
    text = "".join([delta async for delta in generation.deltas()])
    reasoning, content = split_reasoning(text) if thinking else (None, text or None)
    calls: list[dict] = []
    if tools and content:
        content, calls = parse_tool_calls(content, tools)
    message: dict = {"role": "assistant", "content": content}
    if reasoning is not None:
        message["reasoning_content"] = reasoning
    if calls:
        message["tool_calls"] = calls
    return JSONResponse(
        {
            "id": generation.handle.id,
            "object": "chat.completion",
            "created": int(time.time()),
            "model": ctx.model_name,
            "choices": [
                {"index": 0, "message": message, "logprobs": None, "finish_reason": "tool_calls" if calls else generation.finish_reason}
            ],
            "usage": generation.usage(),
        }
    )


async def _chunks(
    ctx: ServeContext, body: ChatCompletionRequest, generation: TextGeneration, thinking: bool, tools: list[dict] | None
) -> AsyncIterator[str]:
    header = {"id": generation.handle.id, "object": "chat.completion.chunk", "created": int(time.time()), "model": ctx.model_name}
    usage_field = {"usage": None} if body.include_usage else {}

    def chunk(delta: dict, finish_reason: str | None = None) -> str:
        choice = {"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish_reason}
        return sse({**header, "choices": [choice], **usage_field})

    reasoning_stream = ReasoningStream(thinking)
    tool_stream = ToolCallStream(tools) if tools else None

    def deltas(reasoning: str, content: str, final: bool = False) -> list[str]:
        out = [chunk({"reasoning_content": reasoning})] if reasoning else []
        calls: list[dict] = []
        if tool_stream is not None:
            content, calls = tool_stream.feed(content)
            if final:
                tail, more = tool_stream.flush()
                content, calls = content + tail, calls + more
        if content:
            out.append(chunk({"content": content}))
        first = len(tool_stream.calls) - len(calls) if tool_stream is not None else 0
        for index, call in enumerate(calls, start=first):
            out.append(chunk({"tool_calls": [{"index": index, **call}]}))
        return out

    yield chunk({"role": "assistant", "content": ""})
    async for text in generation.deltas():
        for event in deltas(*reasoning_stream.feed(text)):
            yield event
    for event in deltas(*reasoning_stream.flush(), final=True):
        yield event
    finish_reason = "tool_calls" if tool_stream is not None and tool_stream.calls else generation.finish_reason
    yield chunk({}, finish_reason)
    if body.include_usage:
        yield sse({**header, "choices": [], "usage": generation.usage()})
