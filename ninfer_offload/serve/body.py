"""Request bodies: JSON decoded with the server's limits, then validated; every failure is an
`APIError` that names the field. Runs on the request worker thread, off the event loop."""

from __future__ import annotations

import json
import re
import sys
from collections.abc import Collection, Sequence
from typing import Any, TypeVar

from pydantic import BaseModel, ValidationError

from ninfer_offload.serve.errors import APIError, validation_error

MAX_NESTING = 64  # free-form JSON (template options, tool schemas, tool-call arguments): templates recurse over it

_SURROGATE_ESCAPE = re.compile(rb"\\u[dD][89a-fA-F]")
_SURROGATE = re.compile("[\ud800-\udfff]")

Body = TypeVar("Body", bound=BaseModel)


def decode_json(raw: bytes) -> dict[str, Any]:
    """The JSON object of a request body (an empty body is `{}`). 400 for invalid UTF-8 or JSON, an
    integer too long to read, a value other than an object, or a string holding a lone UTF-16 surrogate (no text can carry one)."""
    if not raw or raw.isspace():
        return {}
    try:
        data = json.loads(raw.decode("utf-8"))
    except UnicodeDecodeError as exc:
        raise APIError(400, f"request body is not valid UTF-8 ({exc.reason} at byte {exc.start})", code="invalid_json") from None
    except json.JSONDecodeError as exc:
        message = f"request body is not valid JSON: {exc.msg} (line {exc.lineno}, column {exc.colno})"
        raise APIError(400, message, code="invalid_json") from None
    except RecursionError:
        raise APIError(400, "request body is not valid JSON: nested too deeply", code="invalid_json") from None
    except ValueError:  # an integer literal past Python's int-string limit
        message = f"request body holds an integer with more than {sys.get_int_max_str_digits()} digits"
        raise APIError(400, message, code="invalid_json") from None
    if not isinstance(data, dict):
        raise APIError(400, "request body must be a JSON object", code="invalid_json")
    if _SURROGATE_ESCAPE.search(raw):  # only a \uD800-\uDFFF escape can put a surrogate into a str
        path = _lone_surrogate(data)
        if path is not None:
            message = f"{path or 'a key'}: the text holds a lone UTF-16 surrogate (an unpaired \\uD800-\\uDFFF escape)"
            raise APIError(400, message, param=path or None, code="invalid_unicode")
    return data


def _lone_surrogate(data: dict[str, Any]) -> str | None:
    """The dotted path of the first string (or key) holding a lone surrogate, None when none does."""
    stack: list[tuple[tuple, Any]] = [((), data)]
    while stack:
        path, value = stack.pop()
        if isinstance(value, str):
            if not value.isascii() and _SURROGATE.search(value):
                return ".".join(map(str, path))
        elif isinstance(value, dict):
            for key, item in value.items():
                if _SURROGATE.search(key):
                    return ".".join(map(str, path))
                stack.append(((*path, key), item))
        elif isinstance(value, list):
            stack.extend(((*path, index), item) for index, item in enumerate(value) if isinstance(item, (str, dict, list)))
    return None


def refuse_long_list(data: dict[str, Any], field: str, max_context: int) -> None:
    """400 before validation when list `field` has more items than the context has tokens: every
    item takes at least one token, so it cannot fit."""
    items = data.get(field)
    if isinstance(items, list) and len(items) > max_context:
        raise APIError(
            400,
            f"This model's maximum context length is {max_context} tokens. However, {field} has {len(items)} items, "
            "each taking at least one token. Please shorten it.",
            param=field,
            code="context_length_exceeded",
        )


def validate(data: Any, model: type[Body], required_first: Sequence[str] = (), location: Sequence[str | int] = ()) -> Body:
    """`model` from the decoded body (or the part of it at `location`); 422 naming the field (missing
    top-level fields by name)."""
    try:
        return model.model_validate(data)
    except ValidationError as exc:
        errors = [{**error, "loc": (*location, *error["loc"])} for error in exc.errors(include_url=False)]
        raise validation_error(errors, required_first) from None


def validate_typed(items: list[dict[str, Any]], field: str, accepted: Collection[str | None], model: type[Body], kinds: str) -> list[Body]:
    """Each item of the list `field` as `model`; 400 naming the `type` of an item whose type is not
    `accepted` (`kinds` says which are, in the error)."""
    checked = []
    for index, item in enumerate(items):
        kind = item.get("type")
        if kind not in accepted:
            message = f"{field}.{index}.type: only {kinds} are supported (got {kind!r})"
            raise APIError(400, message, param=f"{field}.{index}.type", code="unsupported_value")
        checked.append(validate(item, model, location=(field, index)))
    return checked


def check_nesting(value: Any, param: str) -> None:
    """400 when free-form JSON `value` nests objects or arrays more than MAX_NESTING levels deep."""
    stack = [(value, 1)]
    while stack:
        value, depth = stack.pop()
        if isinstance(value, (dict, list)):
            if depth > MAX_NESTING:
                raise nesting_error(param)
            stack.extend((item, depth + 1) for item in (value.values() if isinstance(value, dict) else value))


def nesting_error(param: str) -> APIError:
    return APIError(400, f"{param} is nested more than {MAX_NESTING} levels deep", param=param, code="nesting_too_deep")
