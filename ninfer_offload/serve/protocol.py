"""Request bodies of the OpenAI routes (unknown but harmless fields are accepted and ignored)."""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, StrictBool

from ninfer_offload.serve.errors import APIError

MAX_STOP_STRINGS = 16  # each is searched in every text delta, on the event loop


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
    top_k: int | None = Field(None, ge=-1)  # -1: disabled (vLLM)
    min_p: float | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    repetition_penalty: float | None = None
    seed: int | None = None
    stop: str | Annotated[list[str], Field(max_length=MAX_STOP_STRINGS)] | None = None
    n: int = Field(1, ge=1)
    stream: bool = False
    stream_options: StreamOptions | None = None
    logprobs: bool | int | None = None
    cache_prompt: StrictBool = True  # an extension: false neither resumes from nor saves to the prompt cache

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


class ChatCompletionRequest(SamplingFields):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    tools: list[Tool] | None = None
    tool_choice: Literal["none", "auto", "required"] | dict[str, Any] | None = None
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

    def check_supported(self) -> None:
        super().check_supported()
        if self.tool_choice not in (None, "none", "auto"):
            raise APIError(
                400,
                "tool_choice must be 'auto' or 'none' (forced tool calls are not supported)",
                param="tool_choice",
                code="unsupported_value",
            )

    @property
    def uses_tools(self) -> bool:
        return bool(self.tools) and self.tool_choice != "none"


class CompletionRequest(SamplingFields):
    prompt: str | list[int] | list[str]
    max_tokens: int | None = Field(16, ge=1)
    echo: bool = False
    suffix: str | None = None

    def check_supported(self) -> None:
        super().check_supported()
        if self.echo:
            raise APIError(400, "echo is not supported", param="echo", code="unsupported_value")
        if self.suffix:
            raise APIError(400, "suffix is not supported", param="suffix", code="unsupported_value")

    def token_limit(self) -> int | None:
        return self.max_tokens

    def logprob_count(self) -> int | None:
        """Alternatives to report per token (`logprobs`: 0..5; None: no log-probabilities)."""
        if self.logprobs is None or self.logprobs is False:
            return None
        if isinstance(self.logprobs, bool) or not 0 <= self.logprobs <= 5:
            raise APIError(400, "logprobs must be an integer in 0..5", param="logprobs", code="invalid_value")
        return self.logprobs
