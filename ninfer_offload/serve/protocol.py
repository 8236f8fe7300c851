"""Request bodies of the OpenAI routes (unknown but harmless fields are accepted and ignored)."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from ninfer_offload.serve.errors import APIError


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


class StreamOptions(_Body):
    include_usage: bool = False


class SamplingFields(_Body):
    """Fields shared by chat and text completions."""

    model: str
    max_tokens: int | None = Field(None, ge=1)
    temperature: float | None = Field(None, ge=0.0, le=2.0)
    top_p: float | None = Field(None, gt=0.0, le=1.0)
    top_k: int | None = Field(None, ge=-1)
    min_p: float | None = Field(None, ge=0.0, le=1.0)
    presence_penalty: float | None = Field(None, ge=-2.0, le=2.0)
    frequency_penalty: float | None = Field(None, ge=-2.0, le=2.0)
    repetition_penalty: float | None = Field(None, gt=0.0)
    seed: int | None = Field(None, ge=-(2**63), lt=2**64)
    stop: str | list[str] | None = None
    n: int = Field(1, ge=1)
    stream: bool = False
    stream_options: StreamOptions | None = None
    logprobs: bool | int | None = None

    def check_supported(self) -> None:
        """Refuse the valid-but-unsupported options with a 400 instead of silently ignoring them."""
        if self.n != 1:
            raise APIError(400, "only n=1 is supported", param="n", code="unsupported_value")
        if self.logprobs:
            raise APIError(400, "logprobs are not supported", param="logprobs", code="unsupported_value")

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
