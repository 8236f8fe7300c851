"""Checks every request passes before a route runs: Host header, what a web page may send (Origin,
content type), API key, body size, time and concurrent uploads. The checks of POST bodies apply to
every POST route under `/v1/`."""

from __future__ import annotations

import asyncio
import hmac
import ipaddress
import time
from collections.abc import Iterable
from urllib.parse import urlsplit

from starlette.exceptions import HTTPException
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from ninfer_offload.serve.errors import APIError, error_response

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


def _is_api_post(scope: Scope) -> bool:
    return scope["type"] == "http" and scope["method"] == "POST" and scope["path"].startswith("/v1/")


def origin_name(origin: str) -> str:
    """An Origin as compared: lower case, without a trailing slash ("HTTP://Example.com/" -> "http://example.com")."""
    return origin.strip().lower().rstrip("/")


class BrowserGuard:
    """What a web page on another site could send to a POST route under /v1/ without the browser
    asking first (a CORS "simple request"): refuse an Origin header other than this server's own
    (the Host it was reached by), a loopback one on its port, or one of `allowed` with 403, a body
    that is not `application/json` or is compressed (Content-Encoding) with 415. Requests without
    an Origin header (curl, SDKs) pass; so does any Origin when `allowed` holds "*"."""

    def __init__(self, app: ASGIApp, allowed: Iterable[str] = ()) -> None:
        self.app = app
        self.allowed = frozenset(origin_name(origin) for origin in allowed)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if _is_api_post(scope):
            problem = self._problem(scope)
            if problem is not None:
                await problem.response()(scope, receive, send)
                return
        await self.app(scope, receive, send)

    def _problem(self, scope: Scope) -> APIError | None:
        headers = dict(scope["headers"])
        origin = headers.get(b"origin")
        if origin is not None and not self._origin_allowed(origin.decode("latin-1"), headers.get(b"host", b"").decode("latin-1"), scope):
            message = f"requests from the web page at {origin.decode('latin-1')!r} are not allowed (see --allowed-origin)"
            return APIError(403, message, code="origin_not_allowed")
        encoding = headers.get(b"content-encoding", b"identity").decode("latin-1").strip().lower()
        if encoding != "identity":
            message = f"compressed request bodies are not supported (Content-Encoding: {encoding})"
            return APIError(415, message, code="unsupported_media_type")
        media_type = headers.get(b"content-type", b"").decode("latin-1").partition(";")[0].strip().lower()
        if media_type != "application/json":
            message = f"the request body must be JSON sent as 'Content-Type: application/json', not {media_type or 'no content type'!r}"
            return APIError(415, message, code="unsupported_media_type")
        return None

    def _origin_allowed(self, origin: str, host: str, scope: Scope) -> bool:
        name = origin_name(origin)
        if "*" in self.allowed or name in self.allowed:
            return True
        parts = urlsplit(name)
        if parts.scheme not in ("http", "https") or not parts.hostname:
            return False  # "null" (a sandboxed frame, a file) and the like
        if parts.netloc == host.strip().lower():
            return True  # same origin
        try:
            port = parts.port or (443 if parts.scheme == "https" else 80)
        except ValueError:
            return False
        server = scope.get("server")
        return parts.hostname in LOOPBACK_NAMES and server is not None and port == server[1]


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
    """Bound request bodies: larger than `limit` bytes is a 413 (declared or streamed length); a body
    not received within `timeout` seconds of the request's start is a 408 (the connection closes);
    a request with a body while `max_uploads` others are still sending theirs is a 503."""

    def __init__(self, app: ASGIApp, limit: int, timeout: float, max_uploads: int) -> None:
        self.app = app
        self.limit = limit
        self.timeout = timeout
        self.max_uploads = max_uploads
        self.uploads = 0  # requests whose body has not all arrived

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        headers = dict(scope["headers"])
        declared = headers.get(b"content-length")
        if declared is not None and declared.isdigit() and int(declared) > self.limit:
            await error_response(413, self._message(), code="request_too_large")(scope, receive, send)
            return
        uploading = (declared is not None and declared != b"0") or b"chunked" in headers.get(b"transfer-encoding", b"").lower()
        if uploading and self.uploads >= self.max_uploads:
            message = f"{self.max_uploads} requests are already sending their bodies; retry later"
            await error_response(503, message, code="server_busy", headers={"Retry-After": "1"})(scope, receive, send)
            return
        self.uploads += uploading
        deadline = time.monotonic() + self.timeout
        seen = 0

        async def counted() -> Message:
            nonlocal seen, uploading
            if not uploading:
                return await receive()
            try:
                message = await asyncio.wait_for(receive(), max(0.0, deadline - time.monotonic()))
            except asyncio.TimeoutError:
                message = f"the request body did not arrive within {self.timeout:g} seconds"
                raise APIError(408, message, code="request_timeout", headers={"Connection": "close"}) from None
            seen += len(message.get("body", b""))
            if seen > self.limit:
                raise HTTPException(413, self._message())
            if message["type"] != "http.request" or not message.get("more_body", False):
                uploading = False
                self.uploads -= 1
            return message

        try:
            await self.app(scope, counted, send)
        finally:
            self.uploads -= uploading

    def _message(self) -> str:
        return f"request body is larger than {self.limit} bytes"
