"""`ninfer serve` as a user runs it: a subprocess on a free port, one log line per request,
graceful shutdown on SIGINT with a stream in flight, one-line errors for bad arguments."""

from __future__ import annotations

import json
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

    def __init__(self, *args: str) -> None:
        self.process = subprocess.Popen([*SERVE, *args, "--port", "0"], stderr=subprocess.PIPE, stdout=subprocess.DEVNULL, text=True)
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


def test_serve_logs_requests_and_shuts_down_gracefully(tiny_artifact):
    args = ["--served-model-name", "tiny", "--max-context", "1024", "--max-concurrency", "2", "--profile", "rtx5090", "--spec", "auto"]
    server = ServeProcess(str(tiny_artifact), *args)
    try:
        assert server.wait_for(r"loaded .* 6 layers, 8 experts \(top-2\), vocab 512, cpu float32")
        assert server.wait_for(r"56 of 56 experts pinned in VRAM, 0 cache slots")  # 6 layers and the MTP layer: it speculates
        assert server.wait_for(  # the prompt cache on by default, a tenth of the planned card's 32 GiB on the device
            r"serving model 'tiny' at /v1 \(2 concurrent sequences, queue 64, 3 MTP drafts per step, prompt cache 3.20 GiB on cpu "
            r"\+ 16.00 GiB host\)"
        )
        response = httpx.post(f"{server.url}/v1/completions", json={"model": "tiny", "prompt": "Hello", "max_tokens": 3, "temperature": 0})
        assert response.status_code == 200
        request_id = response.json()["id"]
        logged = rf"{request_id} prompt=\d+ cached=0 completion=\d+ queued=\S+ ttft=\S+ total=\S+ decode=.* finish=(stop|length)"
        assert server.wait_for(logged)

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

    server = ServeProcess(str(tiny_artifact_official), "--served-model-name", "tiny", "--experts", "host", "--miss-path", "cpu")
    try:
        assert server.wait_for(r"0 of 48 experts pinned in VRAM, .*; misses cpu")
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
