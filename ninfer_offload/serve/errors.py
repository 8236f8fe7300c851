"""OpenAI-style error bodies and the handlers that turn every bad request into one (never a 500)."""

from __future__ import annotations

import json
import re

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    404: "not_found_error",
    405: "invalid_request_error",
    413: "invalid_request_error",
    422: "invalid_request_error",
    429: "rate_limit_error",
    500: "server_error",
    503: "server_error",
}


class APIError(Exception):
    """A request the server refuses, reported as `{"error": {message, type, param, code}}`."""

    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.code = code


def error_body(status: int, message: str, param: str | None = None, code: str | None = None) -> dict:
    """The OpenAI error JSON object for one failure."""
    return {"error": {"message": message, "type": _TYPES.get(status, "invalid_request_error"), "param": param, "code": code}}


def error_response(status: int, message: str, param: str | None = None, code: str | None = None) -> JSONResponse:
    """A JSONResponse carrying `error_body`."""
    return JSONResponse(error_body(status, message, param, code), status_code=status)


_TYPE_TAG = re.compile(r"^(str|int|float|bool|none|[A-Z]\w*|.*[\[\-].*)$")


def _field_path(location: tuple) -> str:
    """`messages.0.content` from a pydantic location, without "body" and union member tags."""
    parts = [str(p) for p in location if p != "body" and not (isinstance(p, str) and _TYPE_TAG.match(p))]
    return ".".join(parts)


def _validation_response(exc: RequestValidationError) -> JSONResponse:
    errors = exc.errors()
    for err in errors:
        if err.get("type") == "json_invalid":
            detail = err.get("ctx", {}).get("error", "malformed JSON")
            return error_response(400, f"request body is not valid JSON: {detail}", code="invalid_json")
    first = errors[0] if errors else {"loc": (), "msg": "invalid request"}
    param = _field_path(tuple(first.get("loc", ()))) or None
    message = f"{param}: {first['msg']}" if param else str(first["msg"])
    if len(errors) > 1:
        message += f" (and {len(errors) - 1} more problem{'s' if len(errors) > 2 else ''})"
    return error_response(422, message, param=param, code="invalid_value")


def install_error_handlers(app: FastAPI) -> None:
    """Make validation errors, bad JSON, unknown routes and `APIError` answer in OpenAI's format."""

    @app.exception_handler(APIError)
    async def _api_error(_: Request, exc: APIError) -> JSONResponse:
        return error_response(exc.status, exc.message, exc.param, exc.code)

    @app.exception_handler(RequestValidationError)
    async def _invalid(_: Request, exc: RequestValidationError) -> JSONResponse:
        return _validation_response(exc)

    @app.exception_handler(json.JSONDecodeError)
    async def _bad_json(_: Request, exc: json.JSONDecodeError) -> JSONResponse:
        return error_response(400, f"request body is not valid JSON: {exc.msg}", code="invalid_json")

    @app.exception_handler(StarletteHTTPException)
    async def _http(_: Request, exc: StarletteHTTPException) -> JSONResponse:
        message = exc.detail if isinstance(exc.detail, str) else "request failed"
        return error_response(exc.status_code, message)
