"""`POST /v1/chat/completions`: render the conversation, generate, split reasoning and tool calls."""

from __future__ import annotations

import json
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass

from fastapi import Request
from fastapi.responses import JSONResponse, Response

from ninfer_offload.errors import NinferError
from ninfer_offload.serve.body import check_nesting, decode_json, nesting_error, refuse_long_list, validate
from ninfer_offload.serve.context import Prepared, ServeContext
from ninfer_offload.serve.errors import APIError
from ninfer_offload.serve.generation import TextGeneration
from ninfer_offload.serve.logprobs import chat_logprobs
from ninfer_offload.serve.protocol import ChatCompletionRequest, ToolCall
from ninfer_offload.serve.reasoning import ReasoningStream, prompt_leaves_thinking_open, split_reasoning
from ninfer_offload.serve.sse import event_stream, sse, until_disconnect
from ninfer_offload.serve.tool_calls import ToolCallStream, parse_tool_calls

# Names the renderer itself passes to the template (or binds), which chat_template_kwargs cannot replace.
_RESERVED_TEMPLATE_NAMES = frozenset({"self", "messages", "tools", "documents"})


@dataclass(frozen=True)
class PreparedChat:
    """A chat request ready for the engine, with what the reply's parsing needs."""

    request: Prepared
    thinking: bool
    tools: list[dict] | None


def _check_free_form(body: ChatCompletionRequest) -> None:
    """Refuse free-form JSON nested too deeply for the template (which recurses over it)."""
    if body.chat_template_kwargs:
        check_nesting(body.chat_template_kwargs, "chat_template_kwargs")
    for index, tool in enumerate(body.tools or []):
        check_nesting(tool.function.parameters, f"tools.{index}.function.parameters")
    for index, message in enumerate(body.messages):
        for number, call in enumerate(message.tool_calls or []):
            _check_arguments(call, f"messages.{index}.tool_calls.{number}.function.arguments")


def _check_arguments(call: ToolCall, param: str) -> None:
    """Tool-call arguments as the template sees them: text is parsed as JSON (invalid JSON is the
    renderer's to report)."""
    arguments = call.function.arguments
    if isinstance(arguments, str):
        try:
            arguments = json.loads(arguments or "{}")
        except RecursionError:
            raise nesting_error(param) from None
        except ValueError:
            return
    check_nesting(arguments, param)


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


def _render(ctx: ServeContext, body: ChatCompletionRequest) -> str:
    options = dict(body.chat_template_kwargs or {})
    reserved = sorted(_RESERVED_TEMPLATE_NAMES & options.keys())
    if reserved:
        names = ", ".join(f"'{name}'" for name in reserved)
        raise APIError(400, f"chat_template_kwargs cannot set {names}", param="chat_template_kwargs", code="invalid_value")
    enable_thinking = bool(options.pop("enable_thinking", True))
    tools = [tool.model_dump(exclude_none=True) for tool in body.tools] if body.uses_tools else None
    try:
        return ctx.frontend.render(_messages(body), tools=tools, enable_thinking=enable_thinking, **options)
    except NinferError as exc:
        raise APIError(400, str(exc), param="messages", code="invalid_messages") from None


def _prepare(ctx: ServeContext, raw: bytes) -> PreparedChat:
    """Decode, check, render and tokenize a request body (on the request worker thread); cheap
    checks first, and no tokenizing of a prompt that cannot fit."""
    data = decode_json(raw)
    refuse_long_list(data, "messages", ctx.max_context)
    refuse_long_list(data, "tools", ctx.max_context)
    body = validate(data, ChatCompletionRequest, required_first=("messages",))
    ctx.check_model(body.model)
    body.check_supported()
    sampling = ctx.sampling(body)
    _check_free_form(body)
    prompt = _render(ctx, body)
    prompt_ids = ctx.encode(prompt, "messages")
    max_tokens = ctx.token_budget(len(prompt_ids), body.token_limit(), "messages")
    tools = [tool.model_dump() for tool in body.tools] if body.uses_tools else None
    thinking = prompt_leaves_thinking_open(prompt)
    prepared = Prepared(
        body, prompt_ids, max_tokens, sampling, _constraint(ctx, body, thinking), body.logprob_count(), body.cache_prompt
    )
    return PreparedChat(prepared, thinking, tools)


def _constraint(ctx: ServeContext, body: ChatCompletionRequest, thinking: bool):
    """The grammar the reply follows: `response_format`'s JSON (with thinking on, after the
    reasoning), else, with tools, well-formed tool calls whose arguments match their schemas."""
    constrained = body.response_format is not None and body.response_format.constrained
    if constrained and body.uses_tools:
        raise APIError(400, "response_format cannot be combined with tools", param="response_format", code="unsupported_value")
    try:
        if constrained:
            return ctx.grammars.json(body.response_format.schema(), thinking)
        if body.uses_tools:
            return ctx.grammars.tool_calls([tool.model_dump(exclude_none=True) for tool in body.tools])
    except NinferError as exc:
        raise APIError(400, str(exc), param="response_format" if constrained else "tools", code="invalid_value") from None
    return None


async def chat_completion(ctx: ServeContext, request: Request) -> Response:
    chat = await ctx.off_loop(_prepare, ctx, await request.body())
    generation = ctx.start("chatcmpl", chat.request)
    if chat.request.body.stream:
        header = {"id": generation.handle.id, "object": "chat.completion.chunk", "created": int(time.time()), "model": ctx.model_name}

        def failure(error: dict) -> str:
            return sse({**header, "choices": [{"index": 0, "delta": {}, "logprobs": None, "finish_reason": "error"}], **error})

        return event_stream(_chunks(ctx, header, chat, generation), generation, failure)
    return await until_disconnect(request, generation, _complete(ctx, generation, chat))


async def _complete(ctx: ServeContext, generation: TextGeneration, chat: PreparedChat) -> JSONResponse:
    text = "".join([delta async for delta in generation.deltas()])
    reasoning, content = split_reasoning(text, chat.thinking)
    calls: list[dict] = []
    if chat.tools and content:
        content, calls = parse_tool_calls(content, chat.tools)
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
                {
                    "index": 0,
                    "message": message,
                    "logprobs": chat_logprobs(ctx.frontend, generation, 0) if chat.request.logprobs is not None else None,
                    "finish_reason": "tool_calls" if calls else generation.finish_reason,
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

    reasoning_stream = ReasoningStream(chat.thinking)
    tool_stream = ToolCallStream(chat.tools) if chat.tools else None

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
    if include_usage:
        yield sse({**header, "choices": [], "usage": generation.usage()})
