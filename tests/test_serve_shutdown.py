"""Shutdown past the graceful window: every client still waiting gets a last event (a chunk with
`finish_reason: "error"`, then `data: [DONE]`) or a 503 JSON error, and `ninfer serve` exits 0
on SIGINT and on SIGTERM."""

from __future__ import annotations

import json
import signal
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest
from test_serve_api import MODEL, USER, LiveServer, ScriptedEngine
from test_serve_cli import ServeProcess

from ninfer_offload.runtime.engine import Engine
from ninfer_offload.serve.app import create_app
from ninfer_offload.serve.server import ABORT_GRACE_S


def wait_active(url: str, count: int, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while httpx.get(f"{url}/health").json()["active"] < count:
        assert time.monotonic() < deadline, "the requests were not admitted"
        time.sleep(0.02)


def assert_ended_by_shutdown(stream_lines: list[str], plain: httpx.Response) -> None:
    """The stream's last chunk says error + shutting_down before [DONE]; the other request got a 503 JSON."""
    assert stream_lines[-1] == "data: [DONE]"
    last = json.loads(stream_lines[-2].removeprefix("data: "))
    assert last["object"] == "chat.completion.chunk" and last["choices"][0]["finish_reason"] == "error"
    assert last["error"]["code"] == "shutting_down" and last["error"]["type"] == "server_error"
    assert plain.status_code == 503 and plain.headers["content-type"] == "application/json"
    assert plain.json()["error"]["code"] == "shutting_down"


def test_requests_running_at_the_deadline_get_a_last_event_or_a_503(tiny_artifact, frontend):
    engine = ScriptedEngine(Engine.load(tiny_artifact, device="cpu", max_sequences=2, spec="none"))
    engine.scripts.extend([frontend.encode(" a") * 3000] * 2)
    window = 0.5
    app = create_app(engine, frontend, MODEL, 4096, max_concurrency=2, max_queue=2)
    with LiveServer(app, shutdown_timeout=window) as live, ThreadPoolExecutor(1) as pool:
        plain = pool.submit(live.post, "/v1/completions", {"model": MODEL, "prompt": "Once", "max_tokens": 3000, "temperature": 0})
        body = {"model": MODEL, "messages": USER, "max_tokens": 3000, "temperature": 0, "stream": True}
        with httpx.stream("POST", f"{live.url}/v1/chat/completions", json=body, timeout=60) as stream:
            lines = stream.iter_lines()
            assert json.loads(next(line for line in lines if line).removeprefix("data: "))["choices"][0]["delta"]["role"] == "assistant"
            wait_active(live.url, 2)
            shutdown = time.monotonic()
            live.server.should_exit = True
            rest = [line for line in lines if line]
        ended = time.monotonic() - shutdown
        assert_ended_by_shutdown(rest, plain.result(timeout=30))
        assert window <= ended < window + ABORT_GRACE_S  # ended at the deadline, not by uvicorn's cancellation
        live.thread.join(30)
        assert not live.thread.is_alive()


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM], ids=["SIGINT", "SIGTERM"])
def test_serve_answers_every_client_and_exits_0_past_the_window(tiny_artifact, sig):
    # One prompt token per scheduler step: the two long prompts are still being prefilled when
    # the one-second window ends.
    args = ["--served-model-name", "tiny", "--max-context", "4096", "--max-concurrency", "2", "--prefill-chunk", "1"]
    server = ServeProcess(str(tiny_artifact), *args, "--shutdown-timeout", "1")
    try:
        with ThreadPoolExecutor(1) as pool:
            request = {"model": "tiny", "prompt": [5] * 2000, "max_tokens": 4, "temperature": 0}
            plain = pool.submit(httpx.post, f"{server.url}/v1/completions", json=request, timeout=60)
            content = "lighthouse keeper " * 300
            body = {"model": "tiny", "messages": [{"role": "user", "content": content}], "max_tokens": 4, "stream": True}
            with httpx.stream("POST", f"{server.url}/v1/chat/completions", json=body, timeout=60) as stream:
                lines = stream.iter_lines()
                assert next(line for line in lines if line).startswith("data:")
                wait_active(server.url, 2)
                server.process.send_signal(sig)
                rest = [line for line in lines if line]
            assert_ended_by_shutdown(rest, plain.result(timeout=30))
        assert server.process.wait(timeout=30) == 0
        server.wait_for(r"Finished server process")
        log = "".join(server.log)
        assert "Traceback" not in log and "Exception in ASGI application" not in log, log
    finally:
        server.stop()
