"""Chat templates: Hugging Face-style Jinja templates rendered in a sandbox.

The environment matches what transformers gives templates (trim/lstrip blocks, loop controls,
a JSON `tojson` that does not escape HTML, `raise_exception`, `strftime_now`, and a
`{% generation %}` block that renders its body), so a template renders the same text here.
"""

from __future__ import annotations

import json
from datetime import datetime
from typing import Any

import jinja2
import jinja2.ext
import jinja2.nodes
from jinja2.sandbox import ImmutableSandboxedEnvironment

from ninfer_offload.errors import NinferError


class _GenerationBlock(jinja2.ext.Extension):
    """`{% generation %}...{% endgeneration %}` (marks assistant text in HF templates): renders the body."""

    tags = {"generation"}

    def parse(self, parser: jinja2.parser.Parser) -> jinja2.nodes.Node:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jinja2.nodes.Scope(body, lineno=lineno)


def _raise_exception(message: str) -> None:
    raise jinja2.exceptions.TemplateError(message)


def _tojson(value: Any, ensure_ascii: bool = False, indent: int | None = None, separators=None, sort_keys: bool = False) -> str:
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _strftime_now(format: str) -> str:
    return datetime.now().strftime(format)


def _environment() -> ImmutableSandboxedEnvironment:
    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[_GenerationBlock, jinja2.ext.loopcontrols]
    )
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    return env


def _plain(value: Any) -> Any:
    """A copy made of JSON types only, so the template cannot reach arbitrary objects."""
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    if isinstance(value, dict):
        return {str(key): _plain(item) for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(item) for item in value]
    raise NinferError(f"chat input holds a {type(value).__name__}; only JSON values are accepted")


_REASONING_KEYS = ("reasoning_content", "thinking", "reasoning")


def normalize_messages(messages: list[dict]) -> list[dict]:
    """Messages as templates expect them: None-valued keys dropped, reasoning under
    `reasoning_content` (and `thinking`), tool-call arguments given as JSON text parsed to objects."""
    if not isinstance(messages, list) or not messages:
        raise NinferError("messages must be a non-empty list of {role, content} objects")
    result = []
    for message in _plain(messages):
        if not isinstance(message, dict) or "role" not in message:
            raise NinferError(f"each message must be an object with a 'role': got {json.dumps(message)[:80]}")
        message = {key: value for key, value in message.items() if value is not None}
        reasoning = next((message[key] for key in _REASONING_KEYS if key in message), None)
        if reasoning is not None:
            message = {"thinking": reasoning, **message, "reasoning_content": reasoning}
        for call in message.get("tool_calls") or []:
            function = call.get("function", call) if isinstance(call, dict) else None
            if isinstance(function, dict) and isinstance(function.get("arguments"), str):
                try:
                    function["arguments"] = json.loads(function["arguments"] or "{}")
                except json.JSONDecodeError as err:
                    raise NinferError(f"tool call arguments are not valid JSON: {err}") from None
        result.append(message)
    return result


class ChatTemplate:
    """A compiled chat template plus the special-token strings it may reference (`eos_token`, ...)."""

    def __init__(self, source: str, special_tokens: dict[str, str] | None = None):
        self.source = source
        self.special_tokens = dict(special_tokens or {})
        try:
            self._template = _environment().from_string(source)
        except jinja2.TemplateSyntaxError as err:
            raise NinferError(f"chat template has a syntax error at line {err.lineno}: {err.message}") from None

    def render(
        self,
        messages: list[dict],
        tools: list[dict] | None = None,
        add_generation_prompt: bool = True,
        **options: Any,
    ) -> str:
        """The prompt text for `messages` (see `normalize_messages`); `options` reach the template
        as variables (e.g. `enable_thinking`)."""
        variables = {**self.special_tokens, **_plain(options)}
        try:
            return self._template.render(
                messages=normalize_messages(messages),
                tools=_plain(tools),
                documents=None,
                add_generation_prompt=add_generation_prompt,
                **variables,
            )
        except jinja2.TemplateError as err:
            raise NinferError(f"chat template: {err.message or err}") from None
        except (TypeError, ValueError, KeyError, AttributeError, OverflowError) as err:
            raise NinferError(f"chat template failed on these messages: {err}") from None
        except RecursionError:
            raise NinferError("chat template failed on these messages: they nest too deeply") from None
