"""The body of `POST /v1/responses` (OpenAI Responses API), checked and translated into the chat
request it amounts to. Input items and content parts are read one by one, so that an unknown or
unsupported type is a 400 naming it."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from ninfer_offload.serve.body import validate, validate_typed
from ninfer_offload.serve.conversation import FieldNames
from ninfer_offload.serve.errors import APIError
from ninfer_offload.serve.protocol import ChatCompletionRequest

NAMES = FieldNames(
    messages="input",
    max_tokens="max_output_tokens",
    response_format="text.format",
    tool_schema="tools.{}.parameters",
    tool_arguments="input",
)
_UNSUPPORTED_PARTS = {"input_image": "images", "input_file": "files", "input_audio": "audio"}


class _Body(BaseModel):
    model_config = ConfigDict(extra="ignore")


class MessageItem(_Body):
    role: Literal["user", "system", "developer", "assistant"]
    content: str | list[dict[str, Any]]


class TextPart(_Body):
    type: Literal["input_text", "output_text"]
    text: str


class FunctionCallItem(_Body):
    call_id: str = Field(min_length=1)
    name: str = Field(min_length=1)
    arguments: str


class FunctionCallOutputItem(_Body):
    call_id: str = Field(min_length=1)
    output: str | list[dict[str, Any]]


class ReasoningText(_Body):
    text: str


class ReasoningItem(_Body):
    content: list[ReasoningText] | None = None
    summary: list[ReasoningText] = []


class FunctionTool(_Body):
    type: Literal["function"]
    name: str = Field(min_length=1)
    description: str | None = None
    parameters: dict[str, Any] | None = None


class FunctionChoice(_Body):
    type: Literal["function"]
    name: str


class Reasoning(_Body):
    effort: Literal["none", "minimal", "low", "medium", "high", "xhigh"] | None = None


class TextFormat(_Body):
    type: Literal["text", "json_object", "json_schema"]
    name: str = "response"
    schema_: dict[str, Any] | None = Field(None, alias="schema")


class TextOptions(_Body):
    format: TextFormat | None = None


class ResponsesRequest(_Body):
    model: str
    input: str | list[dict[str, Any]] = Field(min_length=1)
    instructions: str | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: Literal["none", "auto", "required"] | FunctionChoice | None = None
    parallel_tool_calls: bool = True
    reasoning: Reasoning | None = None
    text: TextOptions | None = None
    max_output_tokens: int | None = Field(None, ge=1)
    temperature: float | None = None
    top_p: float | None = None
    stream: bool = False
    previous_response_id: str | None = None

    @property
    def thinking(self) -> bool:
        """Reasoning on unless `reasoning.effort` is "none" (the model either thinks or does not)."""
        return self.reasoning is None or self.reasoning.effort != "none"

    def check_supported(self) -> None:
        if self.previous_response_id is not None:
            message = "previous_response_id is not supported: this server keeps no responses; send the whole conversation in input"
            raise APIError(400, message, param="previous_response_id", code="unsupported_parameter")
        if self.text and self.text.format and self.text.format.type == "json_schema" and self.text.format.schema_ is None:
            raise APIError(400, "text.format.schema: a json_schema format needs a schema", param="text.format.schema", code="invalid_value")


def _text(parts: list[dict[str, Any]], where: str) -> str:
    """The text of content parts; 400 naming the part that is not text."""
    texts = []
    for number, part in enumerate(parts):
        kind = part.get("type")
        if kind in _UNSUPPORTED_PARTS:
            message = f"{where}.{number}.type: {_UNSUPPORTED_PARTS[kind]} are not supported by this server (text only)"
            raise APIError(400, message, param=f"{where}.{number}.type", code="unsupported_value")
        if kind not in ("input_text", "output_text"):
            message = f"{where}.{number}.type: unknown content part type {kind!r}"
            raise APIError(400, message, param=f"{where}.{number}.type", code="invalid_value")
        texts.append(validate(part, TextPart, location=(where, number)).text)
    return "".join(texts)


def _messages(body: ResponsesRequest) -> list[dict]:
    """The chat messages of `instructions` and `input`: function calls join the assistant turn they
    follow, reasoning items go to the next assistant turn, each call output must answer a call."""
    messages: list[dict] = [{"role": "system", "content": body.instructions}] if body.instructions else []
    if isinstance(body.input, str):
        return [*messages, {"role": "user", "content": body.input}]
    reasoning: list[str] = []
    calls: set[str] = set()
    for index, item in enumerate(body.input):
        where = f"input.{index}"
        kind = item.get("type", "message")
        if kind == "message":
            message = validate(item, MessageItem, location=("input", index))
            content = message.content if isinstance(message.content, str) else _text(message.content, f"{where}.content")
            messages.append({"role": message.role, "content": content})
        elif kind == "function_call":
            call = validate(item, FunctionCallItem, location=("input", index))
            calls.add(call.call_id)
            tool_call = {"id": call.call_id, "type": "function", "function": {"name": call.name, "arguments": call.arguments}}
            last = messages[-1] if messages else None
            if last is None or last["role"] != "assistant":
                messages.append(last := {"role": "assistant", "content": None})
            last.setdefault("tool_calls", []).append(tool_call)
        elif kind == "function_call_output":
            output = validate(item, FunctionCallOutputItem, location=("input", index))
            if output.call_id not in calls:
                message = f"{where}.call_id: no function_call with call_id {output.call_id!r} comes before this output"
                raise APIError(400, message, param=f"{where}.call_id", code="invalid_value")
            content = output.output if isinstance(output.output, str) else _text(output.output, f"{where}.output")
            messages.append({"role": "tool", "tool_call_id": output.call_id, "content": content})
        elif kind == "reasoning":
            thought = validate(item, ReasoningItem, location=("input", index))
            reasoning += [part.text for part in thought.content or thought.summary]
            continue
        else:
            raise APIError(400, f"{where}.type: unsupported input item type {kind!r}", param=f"{where}.type", code="unsupported_value")
        if reasoning and messages[-1]["role"] == "assistant":
            messages[-1]["reasoning_content"] = "".join(reasoning)
            reasoning = []
    return messages


def _tools(body: ResponsesRequest) -> list[dict] | None:
    if body.tools is None:
        return None
    tools = validate_typed(body.tools, "tools", ("function",), FunctionTool, "function tools")
    return [{"type": "function", "function": tool.model_dump(exclude={"type"}, exclude_none=True)} for tool in tools]


def to_chat(body: ResponsesRequest) -> ChatCompletionRequest:
    """The chat request a checked Responses body amounts to."""
    body.check_supported()
    choice = body.tool_choice
    text_format = body.text.format if body.text else None
    messages = _messages(body)
    if not messages:
        raise APIError(400, "input holds no message", param="input", code="invalid_value")
    chat = {
        "model": body.model,
        "messages": messages,
        "tools": _tools(body),
        "tool_choice": {"type": "function", "function": {"name": choice.name}} if isinstance(choice, FunctionChoice) else choice,
        "parallel_tool_calls": body.parallel_tool_calls,
        "chat_template_kwargs": {"enable_thinking": body.thinking},
        "max_completion_tokens": body.max_output_tokens,
        "temperature": body.temperature,
        "top_p": body.top_p,
        "stream": body.stream,
    }
    if text_format is not None:
        chat["response_format"] = {"type": text_format.type, "json_schema": {"name": text_format.name, "schema": text_format.schema_}}
    return validate(chat, ChatCompletionRequest)
