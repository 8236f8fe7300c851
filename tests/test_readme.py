"""The README's "Try it without the 35B model" commands run as written, in a fresh directory, so the README cannot drift;
its install and real-model commands hold no placeholder and pin what pip would otherwise replace; it stays short."""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
from pathlib import Path

import pytest

README = Path(__file__).resolve().parent.parent / "README.md"
PYPROJECT = README.parent / "pyproject.toml"
MAX_LINES = 450
SECTION = "## Try it without the 35B model"
PORT = 8080  # the port the README's serve example uses


def section_blocks() -> list[str]:
    """The fenced bash blocks of the section, in order."""
    text = README.read_text(encoding="utf-8")
    assert SECTION in text, f"README.md lost its section {SECTION!r}"
    section = text.split(SECTION, 1)[1].split("\n## ", 1)[0]
    return re.findall(r"```bash\n(.*?)```", section, flags=re.S)


def port_is_free(port: int) -> bool:
    with socket.socket() as probe:
        return probe.connect_ex(("127.0.0.1", port)) != 0


def run_block(block: str, cwd: Path) -> subprocess.CompletedProcess:
    """One block under `bash -e`, with this interpreter's `ninfer` first on PATH; its whole process group is ended after."""
    env = {**os.environ, "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}"}
    process = subprocess.Popen(
        ["bash", "-e", "-c", block], cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True
    )
    try:
        stdout, stderr = process.communicate(timeout=120)
    finally:
        try:
            os.killpg(process.pid, signal.SIGTERM)
        except ProcessLookupError:
            pass
    return subprocess.CompletedProcess(block, process.returncode, stdout, stderr)


def test_readme_walkthrough_runs_as_written(tmp_path):
    blocks = section_blocks()
    assert len(blocks) == 2 and blocks[0].startswith("ninfer tiny ") and "ninfer serve " in blocks[1]
    if shutil.which("curl") is None or not port_is_free(PORT):
        pytest.skip(f"the serve example needs curl and a free port {PORT}")
    outputs = []
    for block in blocks:
        run = run_block(block, tmp_path)
        assert run.returncode == 0, f"{block}\nstdout:\n{run.stdout}\nstderr:\n{run.stderr}"
        outputs.append(run.stdout)
    assert "verify: the resources parse and every binding the loader reads resolves" in outputs[0]
    assert "status   feasible" in outputs[0]
    assert '"choices"' in outputs[1] and '"chat.completion"' in outputs[1]
    completion = next(line for line in outputs[1].splitlines() if line.startswith("{"))  # after uvicorn's access lines
    reply = json.loads(completion)["choices"][0]["message"]  # thinking off: the text is the content
    assert isinstance(reply["content"], str) and reply.get("reasoning_content") is None


def test_readme_stays_short():
    assert len(README.read_text(encoding="utf-8").splitlines()) <= MAX_LINES, "put the detail in docs/"


def test_install_pins_the_cpu_torch_wheel_to_the_supported_range():
    """A CPU wheel outside pyproject's torch range would be replaced by the CUDA build at `pip install -e .`."""
    supported = re.search(r'"torch(>=[^"]+)"', PYPROJECT.read_text(encoding="utf-8")).group(1)
    cpu_wheel = next(line for line in README.read_text(encoding="utf-8").splitlines() if "download.pytorch.org/whl/cpu" in line)
    assert cpu_wheel.startswith(f'pip install "torch{supported}" --index-url '), cpu_wheel


def test_commands_hold_no_placeholders_and_the_real_model_runs_as_served():
    """No `<repository URL>` to fill in; `generate` on the 35B model places the experts as `serve` does (auto)."""
    text = README.read_text(encoding="utf-8")
    assert not re.search(r"<[^>\n]*\b(url|URL)\b[^>\n]*>", text)
    real = text.split("## Getting the real model", 1)[1].split("\n## ", 1)[0]
    runs = [line for line in real.splitlines() if line.startswith(("ninfer generate ", "ninfer serve "))]
    assert len(runs) == 2 and not any("--experts" in line for line in runs), runs
