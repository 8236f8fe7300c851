"""Who can reach the server: Host header names on a loopback bind (DNS rebinding), `--allowed-host`,
the warning for a public bind without a key, and empty API keys refused at startup."""

from __future__ import annotations

import socket
import subprocess

import httpx
import pytest
from test_serve_api import MODEL, USER, LiveServer
from test_serve_cli import SERVE, ServeProcess

from ninfer_offload.errors import NinferError
from ninfer_offload.runtime.engine import Engine
from ninfer_offload.serve.app import create_app
from ninfer_offload.serve.guards import LOOPBACK_NAMES


@pytest.fixture(scope="module")
def engine(tiny_artifact):
    return Engine.load(tiny_artifact, device="cpu", max_sequences=2, spec="none")


@pytest.fixture(scope="module")
def loopback(engine, frontend):
    app = create_app(engine, frontend, MODEL, 512, allowed_hosts=[*LOOPBACK_NAMES, "myhost.lan"])
    with LiveServer(app) as live:
        yield live


@pytest.mark.parametrize(
    "host", ["localhost", "localhost:8080", "LocalHost:1", "127.0.0.1", "127.0.0.1:80", "[::1]", "[::1]:80", "myhost.lan", "MyHost.lan:443"]
)
def test_loopback_and_allowed_names_are_served(loopback, host):
    assert httpx.get(f"{loopback.url}/health", headers={"host": host}).status_code == 200
    response = loopback.post("/v1/chat/completions", {"model": MODEL, "messages": USER, "max_tokens": 1}, headers={"host": host})
    assert response.status_code == 200


@pytest.mark.parametrize(
    "host", ["evil.example", "evil.example:8080", "127.0.0.1.nip.io", "localhost.evil.example", "[::2]:80", "0.0.0.0:8080", ""]
)
def test_other_host_names_are_refused(loopback, host):
    for response in (
        httpx.get(f"{loopback.url}/health", headers={"host": host}),
        loopback.post("/v1/chat/completions", {"model": MODEL, "messages": USER, "max_tokens": 1}, headers={"host": host}),
    ):
        assert response.status_code == 403 and response.headers["content-type"] == "application/json"
        assert response.json()["error"]["code"] == "host_not_allowed"


def test_a_request_without_host_header_is_refused(loopback):
    with socket.create_connection(("127.0.0.1", loopback.port), timeout=10) as connection:
        connection.sendall(b"GET /health HTTP/1.0\r\n\r\n")
        reply = b"".join(iter(lambda: connection.recv(65536), b""))
    assert reply.startswith(b"HTTP/1.1 403") and b'"host_not_allowed"' in reply


def test_an_empty_api_key_is_refused_by_the_app(engine, frontend):
    for key in ("", "  "):
        with pytest.raises(NinferError, match="API key is empty"):
            create_app(engine, frontend, MODEL, 512, api_key=key)


EMPTY_KEY = "error: the API key is empty (--api-key or NINFER_API_KEY): give a key, or leave both unset to serve without one"


@pytest.mark.parametrize(("args", "env"), [(["--api-key", ""], {}), (["--api-key", " "], {}), ([], {"NINFER_API_KEY": ""})])
def test_serve_refuses_an_empty_api_key(tiny_artifact, monkeypatch, args, env):
    monkeypatch.delenv("NINFER_API_KEY", raising=False)
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    result = subprocess.run([*SERVE, str(tiny_artifact), *args], capture_output=True, text=True, timeout=120)
    assert result.returncode == 2
    assert result.stderr.strip().splitlines() == [EMPTY_KEY]


def test_serve_checks_host_names_on_loopback_with_allowed_hosts(tiny_artifact):
    server = ServeProcess(str(tiny_artifact), "--served-model-name", "tiny", "--allowed-host", "myhost.lan", "--allowed-host", "other.lan")
    try:
        for host, status in (("myhost.lan:1234", 200), ("other.lan", 200), ("localhost", 200), ("evil.example", 403)):
            assert httpx.get(f"{server.url}/health", headers={"host": host}).status_code == status, host
        assert not any("warning" in line for line in server.log)
    finally:
        server.stop()


def test_serve_on_a_public_address_without_a_key_warns(tiny_artifact):
    server = ServeProcess(str(tiny_artifact), "--served-model-name", "tiny", "--host", "0.0.0.0")
    try:
        assert server.wait_for(r"warning: 0\.0\.0\.0 is not a loopback address and no --api-key is set")
        assert httpx.get(f"{server.url}/health", headers={"host": "my-machine.lan"}).status_code == 200  # names are not checked
    finally:
        server.stop()
