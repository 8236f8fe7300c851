"""Running the app under uvicorn with a bounded graceful shutdown.

On SIGINT or SIGTERM the server stops accepting connections and lets in-flight requests finish
for `window` seconds. Then the scheduler ends every request still running: a stream gets a last
chunk with `finish_reason: "error"` and a `shutting_down` error, then `data: [DONE]`; a
non-streaming request gets a 503 JSON error. uvicorn's own deadline (when it cancels whatever is
left) lies `ABORT_GRACE_S` later, time for those last answers to be written. The process exits 0.
"""

from __future__ import annotations

import asyncio
import contextlib
import signal
import socket
import threading
from collections.abc import Callable, Iterator

import uvicorn
from fastapi import FastAPI

ABORT_GRACE_S = 5.0


class GracefulServer(uvicorn.Server):
    """uvicorn's server; `on_deadline` runs `window` seconds into its shutdown."""

    def __init__(self, config: uvicorn.Config, window: float, on_deadline: Callable[[], None]) -> None:
        super().__init__(config)
        self.window = window
        self.on_deadline = on_deadline

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        """SIGINT/SIGTERM start the shutdown; unlike uvicorn, the signal is not raised again after
        it, so the process exits 0 instead of dying of it."""
        if threading.current_thread() is not threading.main_thread():
            yield
            return
        previous = {sig: signal.signal(sig, self.handle_exit) for sig in (signal.SIGINT, signal.SIGTERM)}
        try:
            yield
        finally:
            for sig, handler in previous.items():
                signal.signal(sig, handler)

    async def shutdown(self, sockets: list[socket.socket] | None = None) -> None:
        deadline = asyncio.get_running_loop().call_later(self.window, self.on_deadline)
        try:
            await super().shutdown(sockets)
        finally:
            deadline.cancel()


def graceful_server(app: FastAPI, host: str, port: int, log_level: str, shutdown_timeout: float) -> GracefulServer:
    """A server for an app made by `create_app`, whose scheduler ends the requests at the deadline."""
    config = uvicorn.Config(app, host=host, port=port, log_level=log_level, timeout_graceful_shutdown=shutdown_timeout + ABORT_GRACE_S)
    return GracefulServer(config, shutdown_timeout, app.state.context.scheduler.abort)
