"""Checks every request passes before a route runs: Host header, API key, body size."""

from __future__ import annotations

import hmac
import ipaddress
from collections.abc import Iterable

from starlette.exceptions import HTTPException
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from ninfer_offload.serve.errors import error_response

LOOPBACK_NAMES = ("localhost", "127.0.0.1", "::1")


def is_loopback(address: str) -> bool:
    """Whether binding `address` accepts local clients only."""
    if address.lower() == "localhost":
        return True
    try:
        return ipaddress.ip_address(address.strip("[]")).is_loopback
    except ValueError:
        return False


def host_name(header: str) -> str:
    """The name in a Host header, lower case, without port or IPv6 brackets ("[::1]:8080" -> "::1")."""
    header = header.strip().lower()
    if header.startswith("["):
        return header[1 : header.find("]")] if "]" in header else header
    if header.count(":") > 1:  # a bare IPv6 address
        return header
    name, colon, port = header.rpartition(":")
    return name if colon and port.isdigit() else header


class HostGuard:
    """Refuse requests whose Host header names none of `allowed` (any port) with 403: a page on
    another site cannot reach a loopback server through DNS rebinding."""

    def __init__(self, app: ASGIApp, allowed: Iterable[str]) -> None:
        self.app = app
        self.allowed = frozenset(host_name(name) for name in allowed)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http":
            header = dict(scope["headers"]).get(b"host", b"").decode("latin-1")
            if host_name(header) not in self.allowed:
                message = f"Host header {header!r} is not allowed; use one of {', '.join(sorted(self.allowed))} (see --allowed-host)"
                await error_response(403, message, code="host_not_allowed")(scope, receive, send)
                return
        await self.app(scope, receive, send)


class ApiKeyGuard:
    """Require the key as `Authorization: Bearer KEY` or `x-api-key: KEY` (Anthropic's clients) on every
    `/v1/` route (checked before the body is read)."""

    def __init__(self, app: ASGIApp, api_key: str) -> None:
        self.app = app
        self.api_key = api_key.encode()

    def _accepts(self, headers: dict[bytes, bytes]) -> bool:
        scheme, _, token = headers.get(b"authorization", b"").partition(b" ")
        bearer = scheme.lower() == b"bearer" and hmac.compare_digest(token.strip(), self.api_key)
        return bearer or (b"x-api-key" in headers and hmac.compare_digest(headers[b"x-api-key"].strip(), self.api_key))

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and scope["path"].startswith("/v1/"):
            if not self._accepts(dict(scope["headers"])):
                message = "missing or invalid API key (send 'Authorization: Bearer KEY' or 'x-api-key: KEY')"
                await error_response(401, message, code="invalid_api_key")(scope, receive, send)
                return
        await self.app(scope, receive, send)


class BodyLimit:
    """Refuse request bodies larger than `limit` bytes with 413 (declared or streamed length)."""

    def __init__(self, app: ASGIApp, limit: int) -> None:
        self.app = app
        self.limit = limit

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        declared = dict(scope["headers"]).get(b"content-length")
        if declared is not None and declared.isdigit() and int(declared) > self.limit:
            await error_response(413, self._message(), code="request_too_large")(scope, receive, send)
            return
        seen = 0

        async def counted() -> Message:
            nonlocal seen
            message = await receive()
            seen += len(message.get("body", b""))
            if seen > self.limit:
                raise HTTPException(413, self._message())
            return message

        await self.app(scope, counted, send)

    def _message(self) -> str:
        return f"request body is larger than {self.limit} bytes"
