"""`ninfer serve` as a user runs it: a subprocess on a free port, one log line per request,
graceful shutdown on SIGINT with a stream in flight, one-line errors for bad arguments."""

from __future__ import annotations

import json
import os
import queue
import re
import signal
import socket
import subprocess
import sys
import threading
import time

import httpx
import pytest

SERVE = [sys.executable, "-m", "ninfer_offload", "serve"]


class ServeProcess:
    """`ninfer serve ... --port 0`; stderr lines are collected, the bound port read from them."""

    def __init__(self, *args: str, env: dict[str, str] | None = None) -> None:
        self.process = subprocess.Popen(
            [*SERVE, *args, "--port", "0"], stderr=subprocess.PIPE, stdout=subprocess.DEVNULL, text=True, env=env
        )
        self.lines: queue.Queue[str] = queue.Queue()
        self.log: list[str] = []
        threading.Thread(target=self._read, daemon=True).start()
        try:
            self.url = f"http://127.0.0.1:{self.port()}"
        except BaseException:  # a server that never listened is not left running
            self.stop()
            raise

    def _read(self) -> None:
        for line in self.process.stderr:
            self.lines.put(line)

    def wait_for(self, pattern: str, timeout: float = 60.0) -> re.Match:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            for line in self.log:
                if match := re.search(pattern, line):
                    return match
            try:
                self.log.append(self.lines.get(timeout=0.2))
            except queue.Empty:
                assert self.process.poll() is None, f"server exited early:\n{''.join(self.log)}"
        raise AssertionError(f"no log line matching {pattern!r}:\n{''.join(self.log)}")

    def port(self) -> int:
        return int(self.wait_for(r"Uvicorn running on http://(?:\[[^\]]+\]|[^:/]+):(\d+)").group(1))

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.kill()
            self.process.wait()


def test_serve_logs_requests_and_shuts_down_gracefully(tiny_artifact, speculating_card):
    args = ["--served-model-name", "tiny", "--max-context", "1024", "--max-concurrency", "2", "--profile", str(speculating_card),
            "--allowed-origin", "http://app.lan:3000"]
    server = ServeProcess(str(tiny_artifact), *args)
    try:
        assert server.wait_for(r"loaded .* 6 layers, 8 experts \(top-2\), vocab 512, cpu float32")
        # 6 layers and the MTP layer (it speculates), in the memory of the CPU it runs on, which has nothing to warm up
        assert server.wait_for(r"56 of 56 experts in cpu memory \(no VRAM on a cpu load\), 0 cache slots")
        assert server.wait_for(r"no warm-up on cpu: its eager ops compile nothing and capture no steps")
        assert server.wait_for(r"serving model 'tiny' at /v1 \(2 concurrent sequences, queue 64, 3 MTP drafts per step \(--spec auto: on")
        assert server.wait_for(r"MTP drafts per step .*, prompt cache \d+\.\d\d GiB on cpu \+ 16\.00 GiB host\)")  # on by default
        response = httpx.post(f"{server.url}/v1/completions", json={"model": "tiny", "prompt": "Hello", "max_tokens": 3, "temperature": 0})
        assert response.status_code == 200
        request_id = response.json()["id"]
        logged = rf"{request_id} prompt=\d+ cached=0 completion=\d+ queued=\S+ ttft=\S+ total=\S+ decode=.* finish=(stop|length)"
        assert server.wait_for(logged)
        for origin, status in (("http://app.lan:3000", 200), ("http://evil.example", 403)):
            body = {"model": "tiny", "prompt": "Hello", "max_tokens": 1}
            assert httpx.post(f"{server.url}/v1/completions", json=body, headers={"origin": origin}).status_code == status

        body = {"model": "tiny", "prompt": "Once", "max_tokens": 60, "temperature": 0, "stream": True}
        with httpx.stream("POST", f"{server.url}/v1/completions", json=body, timeout=60) as stream:
            lines = stream.iter_lines()
            assert next(line for line in lines if line).startswith("data:")
            server.process.send_signal(signal.SIGINT)
            rest = [line for line in lines if line]
        assert rest[-1] == "data: [DONE]"  # the in-flight stream was allowed to finish
        final = json.loads(rest[-2].removeprefix("data: "))
        assert final["choices"][0]["finish_reason"] in ("stop", "length")
        assert server.process.wait(timeout=30) == 0
        server.wait_for(r"Application shutdown complete")
        shutting_down = next(i for i, line in enumerate(server.log) if "Shutting down" in line)
        stream_logged = next(i for i, line in enumerate(server.log) if final["id"] in line)
        assert shutting_down < stream_logged  # the signal came while the stream was still running
    finally:
        server.stop()


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["/nonexistent/model.ninfer"], "error: no such artifact file: /nonexistent/model.ninfer"),
        (["{artifact}", "--log-level", "loud"], "error: --log-level must be debug, info, warning or error, got 'loud'"),
        (["{artifact}", "--device", "tpu"], "error: unknown device 'tpu': use cpu or cuda"),
        (
            ["{artifact}", "--spec", "mtp", "--proposal-head"],
            "error: tiny_bf16.ninfer has no proposal head (proposal/head, proposal/token_ids); drop --proposal-head",
        ),
    ],
)
def test_serve_bad_arguments_one_line_errors(tiny_artifact, args, message):
    args = [a.replace("{artifact}", str(tiny_artifact)) for a in args]
    result = subprocess.run([*SERVE, *args], capture_output=True, text=True, timeout=120)
    assert result.returncode == 2
    assert result.stderr.strip().splitlines()[-1] == message
    assert "Traceback" not in result.stderr


def test_host_experts_with_the_cpu_miss_path_serve_the_resident_greedy_text(tiny_artifact_official):
    from ninfer_offload import Engine, open_artifact
    from ninfer_offload.frontend import Frontend
    from ninfer_offload.runtime.sampling import SamplingParams

    with open_artifact(tiny_artifact_official) as artifact:
        frontend = Frontend.from_artifact(artifact)
    engine = Engine.load(tiny_artifact_official)
    generation = engine.generate(frontend.encode("Hello"), max_tokens=4, sampling=SamplingParams(greedy=True))
    generation.run()
    expected = frontend.decode(generation.result.token_ids)
    engine.close()

    # On a terminal (as rich reads TTY_COMPATIBLE) the load shows its progress bar; the numba compile is announced before it starts.
    args = [str(tiny_artifact_official), "--served-model-name", "tiny", "--experts", "host", "--miss-path", "cpu"]
    server = ServeProcess(*args, env={**os.environ, "TTY_COMPATIBLE": "1"})
    try:
        assert server.wait_for(r"compiling the CPU expert kernels \(numba: about 25 s the first time, then read from its cache\)")
        assert server.wait_for(r"loading experts")
        assert server.wait_for(r"0 of 48 experts in cpu memory \(no VRAM on a cpu load\), .*; misses cpu")
        body = {"model": "tiny", "prompt": "Hello", "max_tokens": 4, "temperature": 0}
        response = httpx.post(f"{server.url}/v1/completions", json=body, timeout=60)
        assert response.status_code == 200
        assert response.json()["choices"][0]["text"] == expected
        assert server.wait_for(r"finish=\S+ expert_hit_rate=[01]\.\d{3}")
        health = httpx.get(f"{server.url}/health").json()
        assert health["experts"]["uses"] > 0 and health["experts"]["cpu_assignments"] > 0
    finally:
        server.stop()


def test_bad_miss_path_is_a_one_line_error(tiny_artifact):
    result = subprocess.run([*SERVE, str(tiny_artifact), "--miss-path", "gpu"], capture_output=True, text=True, timeout=60)
    assert result.returncode == 2
    assert result.stderr.strip().splitlines() == ["error: --miss-path must be one of pcie, cpu, auto, got 'gpu'"]


def test_a_busy_port_is_a_one_line_error_before_the_model_loads(tiny_artifact):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        result = subprocess.run([*SERVE, str(tiny_artifact), "--port", str(port)], capture_output=True, text=True, timeout=60)
    assert result.returncode == 2 and "Traceback" not in result.stderr
    lines = result.stderr.strip().splitlines()
    assert lines[-1].startswith(f"error: cannot listen on 127.0.0.1:{port}: ") and "--port" in lines[-1]
    assert not any("loaded" in line for line in lines)  # refused before the load


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--host", "999.1.1.1"], r"cannot listen on 999\.1\.1\.1:0: no such address or host name \(.+\); give another --host"),
        (["--host", "192.0.2.1"], r"cannot listen on 192\.0\.2\.1:0: .+; it is not an address of this machine; give another --host"),
        # a budget the load refuses: the template is read first
        (["--chat-template", "{template}", "--profile", "{card}", "--vram-budget", "1KiB"], r"chat template has a syntax error at line 1"),
    ],
)
def test_what_would_fail_after_the_load_is_refused_before_it(tiny_artifact, small_card, tmp_path, args, message):
    """An address the server cannot bind (with --port 0 too) and a chat template that does not compile: one line
    before the model loads, not an error once it is loaded."""
    (tmp_path / "bad.jinja").write_text("{% for %}")
    args = [a.replace("{template}", str(tmp_path / "bad.jinja")).replace("{card}", str(small_card)) for a in args]
    result = subprocess.run([*SERVE, str(tiny_artifact), "--port", "0", *args], capture_output=True, text=True, timeout=120)
    assert result.returncode == 2 and "Traceback" not in result.stderr, result.stderr
    lines = result.stderr.strip().splitlines()
    assert re.fullmatch(f"error: {message}.*", lines[-1]), lines[-1]
    assert not any("loaded" in line or "loading" in line for line in lines), result.stderr
