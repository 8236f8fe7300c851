"""Qwen3 XML tool calls in model output -> OpenAI `tool_calls` (JSON arguments).

The model writes::

    <tool_call>
    <function=NAME>
    <parameter=P>
    VALUE
    </parameter>
    </function>
    </tool_call>

A value is parsed as JSON when it is strict JSON (numbers, booleans, objects...; not NaN or
Infinity, not nested past what the parser can follow), else kept as a string; a parameter the
tool's schema declares as a string always stays a string. `arguments` is always strict JSON. Content is the
text before the first tool call, as in vLLM's parser for this format.
"""

from __future__ import annotations

import json
import re
import uuid
from typing import Any

from ninfer_offload.serve.stops import partial_match_length

TOOL_OPEN = "<tool_call>"
TOOL_CLOSE = "</tool_call>"
_FUNCTION = re.compile(r"<function=([^>\n]+)>(.*?)(?:</function>|$)", re.S)
_PARAMETER = re.compile(r"<parameter=([^>\n]+)>(.*?)(?:</parameter>|(?=<parameter=)|$)", re.S)


def _string_parameters(tools: list[dict] | None) -> dict[str, set[str]]:
    """Per function name, the parameters whose schema type is "string"."""
    result: dict[str, set[str]] = {}
    for tool in tools or []:
        function = tool.get("function", {})
        properties = (function.get("parameters") or {}).get("properties") or {}
        result[function.get("name", "")] = {
            name for name, schema in properties.items() if isinstance(schema, dict) and schema.get("type") == "string"
        }
    return result


def _not_json(constant: str) -> Any:
    raise ValueError(f"{constant} is not JSON")


def _value(raw: str, keep_string: bool) -> Any:
    text = raw[1:] if raw.startswith("\n") else raw
    text = text[:-1] if text.endswith("\n") else text
    if keep_string:
        return text
    try:
        return json.loads(text, parse_constant=_not_json)
    except (ValueError, RecursionError):
        return text


def parse_call_block(block: str, string_parameters: dict[str, set[str]]) -> dict | None:
    """One `<tool_call>` body -> an OpenAI tool call dict, or None when it names no function."""
    match = _FUNCTION.search(block)
    if match is None:
        return None
    name = match.group(1).strip()
    strings = string_parameters.get(name, set())
    arguments = {
        param.strip(): _value(raw, param.strip() in strings) for param, raw in _PARAMETER.findall(match.group(2))
    }
    return {
        "id": f"call_{uuid.uuid4().hex[:24]}",
        "type": "function",
        "function": {"name": name, "arguments": json.dumps(arguments, ensure_ascii=False)},
    }


class ToolCallStream:
    """Feed content deltas; get back plain content and each tool call as soon as it is complete."""

    def __init__(self, tools: list[dict] | None) -> None:
        self._strings = _string_parameters(tools)
        self._pending = ""
        self._in_calls = False
        self._withheld = ""
        self.calls: list[dict] = []

    def feed(self, delta: str) -> tuple[str, list[dict]]:
        content = ""
        if not self._in_calls:
            text = self._pending + delta
            start = text.find(TOOL_OPEN)
            if start < 0:
                keep = partial_match_length(text, (TOOL_OPEN,))
                self._pending = text[len(text) - keep :]
                return text[: len(text) - keep], []
            self._in_calls = True
            content, delta, self._pending = text[:start], text[start:], ""
        self._withheld += delta
        text = self._pending + delta
        new_calls = []
        while (close := text.find(TOOL_CLOSE)) >= 0:
            new_calls += self._parse(text[: close + len(TOOL_CLOSE)])
            text = text[close + len(TOOL_CLOSE) :]
        self._pending = text
        return content, new_calls

    def _parse(self, block: str) -> list[dict]:
        start = block.find(TOOL_OPEN)
        if start < 0:
            return []
        body = block[start + len(TOOL_OPEN) :]
        body = body[: -len(TOOL_CLOSE)] if body.endswith(TOOL_CLOSE) else body
        call = parse_call_block(body, self._strings)
        if call is None:
            return []
        self.calls.append(call)
        return [call]

    def flush(self) -> tuple[str, list[dict]]:
        """At the end: parse an unterminated last call; if no call parsed at all, the text is content."""
        text, self._pending = self._pending, ""
        if not self._in_calls:
            return text, []
        new_calls = self._parse(text)
        if not self.calls:
            return self._withheld, []
        return "", new_calls


def parse_tool_calls(text: str, tools: list[dict] | None) -> tuple[str | None, list[dict]]:
    """(content, tool_calls) of a whole output; content is None when empty."""
    stream = ToolCallStream(tools)
    content, calls = stream.feed(text)
    tail, more = stream.flush()
    content += tail
    return content or None, calls + more
