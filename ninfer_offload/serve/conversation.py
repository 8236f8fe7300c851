"""A conversation ready for the engine, and its reply split into reasoning, content and tool calls:
the part chat completions, responses and messages share (one chat template, reasoning parser, tool
grammar, sampling rules and set of limits). Each API translates its body into a
`ChatCompletionRequest`, and names its own fields in errors through `FieldNames`."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any, Literal

from ninfer_offload.errors import NinferError
from ninfer_offload.frontend.grammar import schema_problem
from ninfer_offload.serve.body import check_nesting, nesting_error
from ninfer_offload.serve.context import Prepared, ServeContext
from ninfer_offload.serve.errors import APIError
from ninfer_offload.serve.generation import TextGeneration
from ninfer_offload.serve.protocol import ChatCompletionRequest, ToolCall
from ninfer_offload.serve.reasoning import ReasoningStream, prompt_leaves_thinking_open, split_reasoning
from ninfer_offload.serve.tool_calls import ToolCallStream, parse_tool_calls

# Names the renderer itself passes to the template (or binds), which chat_template_kwargs cannot replace.
_RESERVED_TEMPLATE_NAMES = frozenset({"self", "messages", "tools", "documents"})


@dataclass(frozen=True)
class FieldNames:
    """What an API calls the chat request's fields, so that its errors name the field the client sent."""

    messages: str = "messages"
    max_tokens: str = "max_tokens"
    tool_choice: str = "tool_choice"
    response_format: str = "response_format"
    tool_schema: str = "tools.{}.function.parameters"  # formatted with the tool's index
    tool_arguments: str = "messages.{}.tool_calls.{}.function.arguments"  # with the message's and the call's index


@dataclass(frozen=True)
class PreparedChat:
    """A chat request ready for the engine, with what the reply's parsing needs."""

    request: Prepared
    thinking: bool
    tools: list[dict] | None


def prepare_chat(ctx: ServeContext, body: ChatCompletionRequest, names: FieldNames = FieldNames()) -> PreparedChat:
    """Check, render and tokenize a validated chat request (on the request worker thread); cheap
    checks first, and no tokenizing of a prompt that cannot fit."""
    ctx.check_model(body.model)
    body.check_supported()
    sampling = ctx.sampling(body)
    _check_free_form(body, names)
    prompt = _render(ctx, body, names)
    prompt_ids = ctx.encode(prompt, names.messages)
    max_tokens = ctx.token_budget(len(prompt_ids), body.token_limit(), names.messages, names.max_tokens)
    tools = [tool.model_dump() for tool in body.tools] if body.uses_tools else None
    thinking = prompt_leaves_thinking_open(prompt)
    prepared = Prepared(
        body, prompt_ids, max_tokens, sampling, _constraint(ctx, body, thinking, names), body.logprob_count(), body.cache_prompt
    )
    return PreparedChat(prepared, thinking, tools)


def render_prompt(ctx: ServeContext, body: ChatCompletionRequest, names: FieldNames = FieldNames()) -> list[int]:
    """The token ids of a validated chat request's prompt, as `prepare_chat` renders it (for counting)."""
    ctx.check_model(body.model)
    _check_free_form(body, names)
    return ctx.encode(_render(ctx, body, names), names.messages)


def _check_free_form(body: ChatCompletionRequest, names: FieldNames) -> None:
    """Refuse free-form JSON nested too deeply for the template (which recurses over it), and tool
    parameters that are not a JSON schema."""
    if body.chat_template_kwargs:
        check_nesting(body.chat_template_kwargs, "chat_template_kwargs")
    for index, tool in enumerate(body.tools or []):
        param = names.tool_schema.format(index)
        check_nesting(tool.function.parameters, param)
        problem = schema_problem(tool.function.parameters) if tool.function.parameters is not None else None
        if problem:
            message = f"{param} of tool '{tool.function.name}' is not a valid JSON schema: {problem}"
            raise APIError(400, message, param=param, code="invalid_value")
    for index, message in enumerate(body.messages):
        for number, call in enumerate(message.tool_calls or []):
            _check_arguments(call, names.tool_arguments.format(index, number))


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
            for number, part in enumerate(message.content):
                param = f"messages.{index}.content"
                if part.type != "text":
                    reason = f"{param}.{number}: only text content parts are supported (got '{part.type}')"
                    raise APIError(400, reason, param=param, code="unsupported_value")
                if part.text is None:
                    param = f"{param}.{number}.text"
                    raise APIError(400, f"{param}: a text part needs a 'text' string", param=param, code="invalid_value")
            data["content"] = "".join(part.text for part in message.content)
        if data["role"] == "developer":
            data["role"] = "system"
        messages.append(data)
    return messages


def _render(ctx: ServeContext, body: ChatCompletionRequest, names: FieldNames) -> str:
    options = dict(body.chat_template_kwargs or {})
    reserved = sorted(_RESERVED_TEMPLATE_NAMES & options.keys())
    if reserved:
        listed = ", ".join(f"'{name}'" for name in reserved)
        raise APIError(400, f"chat_template_kwargs cannot set {listed}", param="chat_template_kwargs", code="invalid_value")
    enable_thinking = bool(options.pop("enable_thinking", True))
    tools = [tool.model_dump(exclude_none=True) for tool in body.tools] if body.uses_tools else None
    try:
        return ctx.frontend.render(_messages(body), tools=tools, enable_thinking=enable_thinking, **options)
    except NinferError as exc:
        raise APIError(400, f"{names.messages}: {exc}", param=names.messages, code="invalid_messages") from None


def _constraint(ctx: ServeContext, body: ChatCompletionRequest, thinking: bool, names: FieldNames):
    """The grammar the reply follows: `response_format`'s JSON (with thinking on, after the
    reasoning), else, with tools, well-formed tool calls whose arguments match their schemas (with a
    forced call: nothing but calls, after the reasoning)."""
    callable_tools = body.callable_tools(names.tool_choice)
    constrained = body.response_format is not None and body.response_format.constrained
    if constrained and body.uses_tools:
        message = f"{names.response_format} cannot be combined with tools"
        raise APIError(400, message, param=names.response_format, code="unsupported_value")
    if not constrained and not body.uses_tools:
        return None
    param = names.response_format if constrained else "tools"
    grammars = ctx.grammars(param)
    try:
        if constrained:
            return grammars.json(body.response_format.schema(), thinking)
        tools = [tool.model_dump(exclude_none=True) for tool in callable_tools]
        return grammars.tool_calls(tools, body.forces_tool_call, body.parallel_tool_calls, thinking)
    except NinferError as exc:
        raise APIError(400, f"{param}: {exc}", param=param, code="invalid_value") from None


@dataclass
class ReplyStream:
    """Text deltas of a reply -> its pieces in order, each as soon as it is certain: `("reasoning",
    text)`, `("content", text)` and `("tool_call", call)` (an OpenAI tool call dict)."""

    chat: PreparedChat
    calls: list[dict] = field(default_factory=list)

    def __post_init__(self) -> None:
        self._reasoning = ReasoningStream(self.chat.thinking)
        self._tools = ToolCallStream(self.chat.tools) if self.chat.tools else None

    def feed(self, delta: str) -> list[tuple[str, object]]:
        return self._pieces(*self._reasoning.feed(delta))

    def flush(self) -> list[tuple[str, object]]:
        """The pieces held back, at the end of the reply."""
        return self._pieces(*self._reasoning.flush(), final=True)

    def _pieces(self, reasoning: str, content: str, final: bool = False) -> list[tuple[str, object]]:
        pieces: list[tuple[str, object]] = [("reasoning", reasoning)] if reasoning else []
        calls: list[dict] = []
        if self._tools is not None:
            content, calls = self._tools.feed(content)
            if final:
                tail, more = self._tools.flush()
                content, calls = content + tail, calls + more
        if content:
            pieces.append(("content", content))
        self.calls += calls
        return pieces + [("tool_call", call) for call in calls]


@dataclass(frozen=True)
class Reply:
    """A whole reply: reasoning (None with thinking off), content (None when empty), tool calls."""

    reasoning: str | None
    content: str | None
    calls: list[dict]


async def whole_reply(chat: PreparedChat, generation: TextGeneration) -> Reply:
    """Generate to the end and split the reply, as `ReplyStream` splits it streamed."""
    text = "".join([delta async for delta in generation.deltas()])
    reasoning, content = split_reasoning(text, chat.thinking)
    calls: list[dict] = []
    if chat.tools and content:
        content, calls = parse_tool_calls(content, chat.tools)
    return Reply(reasoning, content, calls)


@dataclass(frozen=True)
class BlockEvent:
    """One step of a reply told in blocks: `start`, `delta` (text blocks only) or `stop` of block
    number `index`, of `kind` "reasoning", "content" or "tool_call"; `value` is the delta's text, the
    whole text at a text block's stop, the call (an OpenAI tool call dict) at a call's start and stop."""

    event: Literal["start", "delta", "stop"]
    index: int
    kind: str
    value: Any = None


class BlockStream:
    """A reply's pieces grouped into numbered blocks, as the Responses and Messages streams tell
    them: each run of reasoning or of content deltas is one block, each tool call one block."""

    def __init__(self, chat: PreparedChat) -> None:
        self.replies = ReplyStream(chat)
        self.count = 0  # blocks started
        self._open: str | None = None  # the kind of the text block receiving deltas
        self._texts: list[str] = []

    def feed(self, delta: str) -> list[BlockEvent]:
        return self._events(self.replies.feed(delta))

    def flush(self) -> list[BlockEvent]:
        """The rest, every block stopped."""
        return self._events(self.replies.flush()) + self._close()

    def _events(self, pieces: list[tuple[str, object]]) -> list[BlockEvent]:
        events: list[BlockEvent] = []
        for kind, value in pieces:
            if kind != self._open:
                events += self._close()
                events.append(BlockEvent("start", self.count, kind, value if kind == "tool_call" else None))
                self.count += 1
            if kind == "tool_call":
                events.append(BlockEvent("stop", self.count - 1, kind, value))
                continue
            self._open = kind
            self._texts.append(value)
            events.append(BlockEvent("delta", self.count - 1, kind, value))
        return events

    def _close(self) -> list[BlockEvent]:
        if self._open is None:
            return []
        event = BlockEvent("stop", self.count - 1, self._open, "".join(self._texts))
        self._open, self._texts = None, []
        return [event]


async def reply_blocks(chat: PreparedChat, generation: TextGeneration) -> AsyncIterator[BlockEvent]:
    """Generate to the end, telling the reply in blocks (`BlockStream`)."""
    blocks = BlockStream(chat)
    async for delta in generation.deltas():
        for block in blocks.feed(delta):
            yield block
    for block in blocks.flush():
        yield block
