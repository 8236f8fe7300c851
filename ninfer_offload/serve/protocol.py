"""Request bodies of the OpenAI routes (unknown but harmless fields are accepted and ignored)."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, StrictBool, field_validator
from pydantic_core import PydanticCustomError

from ninfer_offload.serve.errors import APIError

MAX_STOP_STRINGS = 16  # each is searched in every text delta, on the event loop
DEFAULT_COMPLETION_TOKENS = 16  # /v1/completions without max_tokens (or with null), as OpenAI's


# chat_template_kwargs the templates read as booleans: "false" (a non-empty string) would read as true.
BOOLEAN_TEMPLATE_OPTIONS = frozenset({"enable_thinking"})


class _Body(BaseModel):
    model_config = ConfigDict(extra="ignore")


class ContentPart(_Body):
    type: str
    text: str | None = None


class FunctionCall(_Body):
    name: str
    arguments: str | dict[str, Any] = "{}"


class ToolCall(_Body):
    id: str | None = None
    type: Literal["function"] = "function"
    function: FunctionCall


class ChatMessage(_Body):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[ContentPart] | None = None
    name: str | None = None
    tool_calls: list[ToolCall] | None = None
    tool_call_id: str | None = None
    reasoning_content: str | None = None


class FunctionSpec(_Body):
    name: str = Field(min_length=1)
    description: str | None = None
    parameters: dict[str, Any] | None = None


class Tool(_Body):
    type: Literal["function"] = "function"
    function: FunctionSpec


class JsonSchemaFormat(_Body):
    name: str = "response"
    schema_: dict[str, Any] | None = Field(None, alias="schema")
    strict: bool | None = None


class ResponseFormat(_Body):
    """`text` (no constraint), `json_object` (any JSON object) or `json_schema` (JSON matching `json_schema.schema`)."""

    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None

    @property
    def constrained(self) -> bool:
        return self.type != "text"

    def schema(self) -> dict[str, Any] | None:
        """The JSON schema to follow (None: any JSON object)."""
        if self.type == "json_object":
            return None
        if self.json_schema is None or self.json_schema.schema_ is None:
            raise APIError(400, "response_format json_schema needs json_schema.schema", param="response_format", code="invalid_value")
        return self.json_schema.schema_


class StreamOptions(_Body):
    include_usage: bool = False


class SamplingFields(_Body):
    """Fields shared by chat and text completions. The sampling values are checked by
    `SamplingParams` (the sampler's own rules), not here."""

    model: str
    max_tokens: int | None = Field(None, ge=1)
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None  # 0 or -1 (vLLM's spelling): off
    min_p: float | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    repetition_penalty: float | None = None
    seed: int | None = None
    stop: str | list[str] | None = None
    logit_bias: dict[int, float] | None = None
    n: int = Field(1, ge=1)
    stream: bool = False
    stream_options: StreamOptions | None = None
    logprobs: bool | int | None = None
    cache_prompt: StrictBool = True  # an extension: false neither resumes from nor saves to the prompt cache

    @field_validator("stop")
    @classmethod
    def _few_stops(cls, stop: str | list[str] | None) -> str | list[str] | None:
        if isinstance(stop, list) and len(stop) > MAX_STOP_STRINGS:
            raise PydanticCustomError("too_many_stops", "at most {limit} stop strings are allowed, got {count}",
                                      {"limit": MAX_STOP_STRINGS, "count": len(stop)})
        return stop

    def check_supported(self) -> None:
        """Refuse the valid-but-unsupported options with a 400 instead of silently ignoring them."""
        if self.n != 1:
            raise APIError(400, "only n=1 is supported", param="n", code="unsupported_value")

    def stop_strings(self) -> list[str]:
        """`stop` as a list of non-empty strings."""
        if self.stop is None:
            return []
        stops = [self.stop] if isinstance(self.stop, str) else list(self.stop)
        return [s for s in stops if s]

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)


class FunctionName(_Body):
    name: str


class NamedToolChoice(_Body):
    """`{"type": "function", "function": {"name": ...}}`: a call to that function is forced."""

    type: Literal["function"]
    function: FunctionName


class ChatCompletionRequest(SamplingFields):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    tools: list[Tool] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool = True
    chat_template_kwargs: dict[str, Any] | None = None
    response_format: ResponseFormat | None = None
    top_logprobs: int | None = Field(None, ge=0, le=20)

    def logprob_count(self) -> int | None:
        """Alternatives to report per token when `logprobs` is on (None: no log-probabilities)."""
        if self.top_logprobs is not None and self.logprobs is not True:
            raise APIError(400, "top_logprobs needs logprobs: true", param="top_logprobs", code="invalid_value")
        if self.logprobs not in (None, True, False):
            raise APIError(400, "logprobs must be true or false", param="logprobs", code="invalid_value")
        return (self.top_logprobs or 0) if self.logprobs else None

    def token_limit(self) -> int | None:
        """`max_completion_tokens` (the newer name) or `max_tokens`."""
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens

    @field_validator("chat_template_kwargs")
    @classmethod
    def _boolean_options(cls, options: dict[str, Any] | None) -> dict[str, Any] | None:
        for name in BOOLEAN_TEMPLATE_OPTIONS & (options or {}).keys():
            if not isinstance(options[name], bool):
                raise PydanticCustomError("bool_type", "{name} must be true or false (a JSON boolean), got {value}",
                                          {"name": name, "value": repr(options[name])})
        return options

    @field_validator("tool_choice", mode="before")
    @classmethod
    def _known_tool_choice(cls, choice: Any) -> Any:
        if isinstance(choice, str) and choice not in ("none", "auto", "required"):
            raise PydanticCustomError(
                "tool_choice", "tool_choice must be 'none', 'auto', 'required' or a named function, got {value}", {"value": repr(choice)}
            )
        return choice

    @property
    def uses_tools(self) -> bool:
        return bool(self.tools) and self.tool_choice != "none"

    def callable_tools(self, param: str = "tool_choice") -> list[Tool]:
        """The tools a reply may call: all of them, or the one `tool_choice` names (400 naming
        `param` when no tool has that name, or when a call is forced without tools)."""
        if self.forces_tool_call and not self.tools:
            raise APIError(400, f"{param} forces a tool call, but no tools are given", param=param, code="invalid_value")
        if not isinstance(self.tool_choice, NamedToolChoice):
            return list(self.tools or [])
        name = self.tool_choice.function.name
        named = [tool for tool in self.tools if tool.function.name == name]
        if not named:
            raise APIError(400, f"{param} names the function '{name}', which is not among the tools", param=param, code="invalid_value")
        return named

    @property
    def forces_tool_call(self) -> bool:
        return self.tool_choice == "required" or isinstance(self.tool_choice, NamedToolChoice)


class CompletionRequest(SamplingFields):
    prompt: str | list[int] | list[str]
    echo: bool = False
    suffix: str | None = None

    def check_supported(self) -> None:
        super().check_supported()
        if self.echo:
            raise APIError(400, "echo is not supported", param="echo", code="unsupported_value")
        if self.suffix:
            raise APIError(400, "suffix is not supported", param="suffix", code="unsupported_value")

    def token_limit(self) -> int:
        """`max_tokens`; unset or null: DEFAULT_COMPLETION_TOKENS."""
        return self.max_tokens if self.max_tokens is not None else DEFAULT_COMPLETION_TOKENS

    def logprob_count(self) -> int | None:
        """Alternatives to report per token (`logprobs`: 0..5; None: no log-probabilities)."""
        if self.logprobs is None or self.logprobs is False:
            return None
        if isinstance(self.logprobs, bool) or not 0 <= self.logprobs <= 5:
            raise APIError(400, "logprobs must be an integer in 0..5", param="logprobs", code="invalid_value")
        return self.logprobs
