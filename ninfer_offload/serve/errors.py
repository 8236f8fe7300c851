"""Error bodies, the handlers that turn every refused request into one, and the last resort that
answers any other failure as JSON too (never a text/plain 500). Errors take OpenAI's shape, except
under `/v1/messages`, where they take Anthropic's (`error_response` picks by the request's path)."""

from __future__ import annotations

import asyncio
import json
import logging
import re
import uuid
from collections.abc import Sequence
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.requests import ClientDisconnect
from starlette.types import ASGIApp, Message, Receive, Scope, Send

log = logging.getLogger("ninfer.serve")

_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    405: "invalid_request_error",
    408: "invalid_request_error",
    413: "invalid_request_error",
    415: "invalid_request_error",
    422: "invalid_request_error",
    429: "rate_limit_error",
    500: "server_error",
    503: "server_error",
}
_HTTP_CODES = {404: "not_found", 405: "method_not_allowed", 413: "request_too_large"}
_ANTHROPIC_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    408: "timeout_error",
    413: "request_too_large",
    429: "rate_limit_error",
    500: "api_error",
    503: "overloaded_error",
}
ANTHROPIC_PATH = "/v1/messages"


class APIError(Exception):
    """A request the server refuses, reported as `{"error": {message, type, param, code}}`."""

    def __init__(
        self, status: int, message: str, param: str | None = None, code: str | None = None, headers: dict[str, str] | None = None
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.code = code
        self.headers = headers

    def response(self) -> JSONResponse:
        return error_response(self.status, self.message, self.param, self.code, self.headers)

    def body(self) -> dict:
        """The OpenAI error JSON object of this error."""
        return error_body(self.status, self.message, self.param, self.code)


class ErrorJSON(JSONResponse):
    """JSON with non-ASCII escaped, so that text echoed from a request (a lone surrogate) always encodes."""

    def render(self, content: Any) -> bytes:
        return json.dumps(content, ensure_ascii=True, separators=(",", ":")).encode("ascii")


def error_body(status: int, message: str, param: str | None = None, code: str | None = None) -> dict:
    """The OpenAI error JSON object for one failure."""
    return {"error": {"message": message, "type": _TYPES.get(status, "invalid_request_error"), "param": param, "code": code}}


def speaks_anthropic(path: str) -> bool:
    """Whether `path` belongs to the Anthropic Messages API (its errors take Anthropic's shape)."""
    return path == ANTHROPIC_PATH or path.startswith(ANTHROPIC_PATH + "/")


def anthropic_status(status: int) -> int:
    """Anthropic answers a request body that fails validation with 400, not 422."""
    return 400 if status == 422 else status


def anthropic_error_body(status: int, message: str) -> dict:
    """Anthropic's error JSON object for one failure (the field is named in `message`)."""
    kind = _ANTHROPIC_TYPES.get(anthropic_status(status), "api_error" if status >= 500 else "invalid_request_error")
    return {"type": "error", "error": {"type": kind, "message": message}}


class ErrorResponse(ErrorJSON):
    """An error in OpenAI's shape, answered in Anthropic's when the request's path is under `/v1/messages`."""

    def __init__(self, status: int, message: str, param: str | None, code: str | None, headers: dict[str, str] | None) -> None:
        super().__init__(error_body(status, message, param, code), status_code=status, headers=headers)
        self.error = (status, message)
        self.extra_headers = headers

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if not speaks_anthropic(scope.get("path", "")):
            await super().__call__(scope, receive, send)
            return
        status, message = self.error
        anthropic = ErrorJSON(anthropic_error_body(status, message), status_code=anthropic_status(status), headers=self.extra_headers)
        await anthropic(scope, receive, send)


def error_response(
    status: int, message: str, param: str | None = None, code: str | None = None, headers: dict[str, str] | None = None
) -> JSONResponse:
    """A JSON response carrying the error in the shape of the API the request's path belongs to."""
    return ErrorResponse(status, message, param, code, headers)


_TYPE_TAG = re.compile(r"^(str|int|float|bool|none|[A-Z]\w*|.*[\[\-].*)$")


def _field_path(location: Sequence) -> str:
    """`messages.0.content` from a pydantic location, without "body" and union member tags."""
    parts = [str(p) for p in location if p != "body" and not (isinstance(p, str) and _TYPE_TAG.match(p))]
    return ".".join(parts)


def validation_error(errors: Sequence[dict], required_first: Sequence[str] = ()) -> APIError:
    """A 422 for pydantic errors: the missing top-level fields by name (those in `required_first`
    first), else the first problem with its field path and how many more there are."""
    paths = [(error.get("type"), _field_path(error.get("loc", ()))) for error in errors]
    missing = [path for kind, path in paths if kind == "missing" and path and "." not in path]
    if missing:
        missing.sort(key=lambda name: (name not in required_first, name))
        names = ", ".join(f"'{name}'" for name in missing)
        plural = "s" if len(missing) > 1 else ""
        return APIError(422, f"Missing required parameter{plural}: {names}.", param=missing[0], code="missing_required_parameter")
    first = errors[0] if errors else {"loc": (), "msg": "invalid request"}
    param = _field_path(first.get("loc", ())) or None
    message = f"{param}: {first['msg']}" if param else str(first["msg"])
    if len(errors) > 1:
        message += f" (and {len(errors) - 1} more problem{'s' if len(errors) > 2 else ''})"
    return APIError(422, message, param=param, code="invalid_value")


def install_error_handlers(app: FastAPI) -> None:
    """Make `APIError`, validation errors and HTTP errors (unknown route, wrong method, body too
    large) answer through `error_response`."""

    @app.exception_handler(APIError)
    async def _api_error(_: Request, exc: APIError) -> JSONResponse:
        return exc.response()

    @app.exception_handler(RequestValidationError)
    async def _invalid(_: Request, exc: RequestValidationError) -> JSONResponse:
        error = validation_error(exc.errors())
        return error_response(error.status, error.message, error.param, error.code)

    @app.exception_handler(StarletteHTTPException)
    async def _http(_: Request, exc: StarletteHTTPException) -> JSONResponse:
        message = exc.detail if isinstance(exc.detail, str) else "request failed"
        return error_response(exc.status_code, message, code=_HTTP_CODES.get(exc.status_code))


class ErrorGuard:
    """The last resort, outermost: an exception that escapes the app becomes a 500 JSON error with a
    request id (its traceback logged) and the connection stays usable; a request cancelled by the
    end of the shutdown window gets a 503 JSON error; a client gone before its body arrived is one
    log line."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        started = False

        async def tracked(message: Message) -> None:
            nonlocal started
            started = started or message["type"] == "http.response.start"
            await send(message)

        try:
            await self.app(scope, receive, tracked)
        except ClientDisconnect:
            log.info("%s %s: the client disconnected before sending its whole body", scope.get("method"), scope.get("path"))
        except asyncio.CancelledError:
            if not started:
                await error_response(503, "the server is shutting down", code="shutting_down")(scope, receive, send)
            raise
        except Exception:
            request_id = f"req-{uuid.uuid4().hex[:24]}"
            log.exception("request %s (%s %s) failed", request_id, scope.get("method"), scope.get("path"))
            if started:
                return
            message = f"internal server error (request id {request_id}); the server log has the details"
            response = error_response(500, message, code="internal_error", headers={"x-request-id": request_id})
            await response(scope, receive, send)
