"""The body of `POST /v1/messages` (Anthropic Messages API), checked and translated into the chat
request it amounts to. Content blocks are read one by one, so that an unknown or unsupported type is
a 400 naming it."""

from __future__ import annotations

import json
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from ninfer_offload.serve.body import validate, validate_typed
from ninfer_offload.serve.conversation import FieldNames
from ninfer_offload.serve.errors import APIError
from ninfer_offload.serve.protocol import MAX_STOP_STRINGS, ChatCompletionRequest

NAMES = FieldNames(tool_schema="tools.{}.input_schema", tool_arguments="messages")
_UNSUPPORTED_BLOCKS = {"image": "images", "document": "documents", "search_result": "search results"}


class _Body(BaseModel):
    model_config = ConfigDict(extra="ignore")


class TextBlock(_Body):
    type: Literal["text"]
    text: str


class ToolUseBlock(_Body):
    id: str = Field(min_length=1)
    name: str = Field(min_length=1)
    input: dict[str, Any]


class ToolResultBlock(_Body):
    tool_use_id: str = Field(min_length=1)
    content: str | list[dict[str, Any]] = ""
    is_error: bool = False


class ThinkingBlock(_Body):
    thinking: str


class Message(_Body):
    role: Literal["user", "assistant"]
    content: str | list[dict[str, Any]]


class CustomTool(_Body):
    type: Literal["custom"] | None = None
    name: str = Field(min_length=1)
    description: str | None = None
    input_schema: dict[str, Any]


class ToolChoice(_Body):
    type: Literal["auto", "any", "tool", "none"]
    name: str | None = None
    disable_parallel_tool_use: bool = False


class Thinking(_Body):
    type: Literal["enabled", "disabled", "adaptive"]
    budget_tokens: int | None = Field(None, ge=1)


class CountTokensRequest(_Body):
    """The body of `POST /v1/messages/count_tokens`: a message request without `max_tokens`."""

    model: str
    messages: list[Message] = Field(min_length=1)
    system: str | list[TextBlock] | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: ToolChoice | None = None
    thinking: Thinking | None = None


class MessagesRequest(CountTokensRequest):
    max_tokens: int = Field(ge=1)  # required, as Anthropic requires it
    stop_sequences: list[str] | None = Field(None, max_length=MAX_STOP_STRINGS)
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = Field(None, ge=0)
    stream: bool = False


def _blocks(content: list[dict[str, Any]], where: str) -> list[tuple[str, Any, str]]:
    """(type, checked block, location) of each content block; 400 naming an unknown or unsupported one."""
    blocks = []
    for number, block in enumerate(content):
        at = f"{where}.{number}"
        kind = block.get("type")
        model = {"text": TextBlock, "tool_use": ToolUseBlock, "tool_result": ToolResultBlock, "thinking": ThinkingBlock}.get(kind)
        if kind in _UNSUPPORTED_BLOCKS:
            message = f"{at}.type: {_UNSUPPORTED_BLOCKS[kind]} are not supported by this server (text only)"
            raise APIError(400, message, param=f"{at}.type", code="unsupported_value")
        if model is None:
            raise APIError(400, f"{at}.type: unsupported content block type {kind!r}", param=f"{at}.type", code="unsupported_value")
        blocks.append((kind, validate(block, model, location=tuple(at.split("."))), at))
    return blocks


def _text(content: str | list[dict[str, Any]], where: str) -> str:
    """The text of a string or of text blocks (a tool result's, a system prompt's)."""
    if isinstance(content, str):
        return content
    blocks = _blocks(content, where)
    for kind, _, at in blocks:
        if kind != "text":
            raise APIError(400, f"{at}.type: only text blocks may stand here (got {kind!r})", param=f"{at}.type", code="invalid_value")
    return "".join(block.text for _, block, _ in blocks)


def _messages(body: CountTokensRequest) -> list[dict]:
    """The chat messages of `system` and `messages`: an assistant turn's `tool_use` blocks become its
    tool calls, a user turn's `tool_result` blocks become tool messages (each must answer a `tool_use`)."""
    messages: list[dict] = []
    if body.system:
        system = body.system if isinstance(body.system, str) else "".join(block.text for block in body.system)
        messages.append({"role": "system", "content": system})
    calls: set[str] = set()
    for index, message in enumerate(body.messages):
        if isinstance(message.content, str):
            messages.append({"role": message.role, "content": message.content})
            continue
        turn: dict = {"role": message.role, "content": ""}
        before = len(messages)
        for kind, block, at in _blocks(message.content, f"messages.{index}.content"):
            if kind == "text":
                turn["content"] += block.text
            elif kind == "thinking" and message.role == "assistant":
                turn["reasoning_content"] = turn.get("reasoning_content", "") + block.thinking
            elif kind == "tool_use" and message.role == "assistant":
                calls.add(block.id)
                function = {"name": block.name, "arguments": json.dumps(block.input, ensure_ascii=False)}
                turn.setdefault("tool_calls", []).append({"id": block.id, "type": "function", "function": function})
            elif kind == "tool_result" and message.role == "user":
                if block.tool_use_id not in calls:
                    message_text = f"{at}.tool_use_id: no tool_use block with id {block.tool_use_id!r} comes before this tool_result"
                    raise APIError(400, message_text, param=f"{at}.tool_use_id", code="invalid_value")
                result = _text(block.content, f"{at}.content")
                messages.append({"role": "tool", "tool_call_id": block.tool_use_id, "content": result})
            else:
                message_text = f"{at}.type: a {kind} block cannot stand in a {message.role} message"
                raise APIError(400, message_text, param=f"{at}.type", code="invalid_value")
        if turn["content"] or len(messages) == before:  # not a user turn of nothing but tool results
            messages.append(turn)
    return messages


def _tools(body: CountTokensRequest) -> list[dict] | None:
    if body.tools is None:
        return None
    tools = []
    for tool in validate_typed(body.tools, "tools", (None, "custom"), CustomTool, "custom tools with an input_schema"):
        function = {"name": tool.name, "description": tool.description, "parameters": tool.input_schema}
        tools.append({"type": "function", "function": {key: value for key, value in function.items() if value is not None}})
    return tools


def _tool_choice(choice: ToolChoice | None) -> str | dict | None:
    if choice is None:
        return None
    if choice.type == "tool":
        if not choice.name:
            raise APIError(400, "tool_choice.name: a tool choice of type 'tool' names the tool", param="tool_choice.name",
                           code="invalid_value")
        return {"type": "function", "function": {"name": choice.name}}
    return {"any": "required"}.get(choice.type, choice.type)


def to_chat(body: CountTokensRequest) -> ChatCompletionRequest:
    """The chat request a checked Messages body (or count_tokens body) amounts to. Thinking is off
    unless `thinking` enables it (Anthropic's default); `budget_tokens` is not enforced."""
    chat: dict[str, Any] = {
        "model": body.model,
        "messages": _messages(body),
        "tools": _tools(body),
        "tool_choice": _tool_choice(body.tool_choice),
        "parallel_tool_calls": not (body.tool_choice and body.tool_choice.disable_parallel_tool_use),
        "chat_template_kwargs": {"enable_thinking": body.thinking is not None and body.thinking.type != "disabled"},
    }
    if isinstance(body, MessagesRequest):
        chat.update(
            max_tokens=body.max_tokens, stop=body.stop_sequences, temperature=body.temperature, top_p=body.top_p, top_k=body.top_k,
            stream=body.stream,
        )
    return validate(chat, ChatCompletionRequest)
