"""`ninfer plan` and `ninfer profile` through the real command line."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from ninfer_offload.planner import PLAN_SCHEMA
from ninfer_offload.planner.schema import schema_errors


def ninfer(*args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "ninfer_offload", *args], capture_output=True, text=True, timeout=120, env=env)


def test_default_plan_is_feasible_and_reports():
    result = ninfer("plan")
    assert result.returncode == 0, result.stderr
    for text in ("feasible", "rtx5090", "10240 of 10240", "routing mass covered", "KV capacity", "decode tok/s", "Assumptions"):
        assert text in result.stdout


def test_json_validates_against_the_schema():
    result = ninfer("plan", "--profile", "rtx5060ti", "--json")
    assert result.returncode == 0, result.stderr
    document = json.loads(result.stdout)
    assert schema_errors(document, PLAN_SCHEMA) == []
    assert document["feasible"] and 0 < document["experts_resident"] < document["experts_total"]
    assert set(document["predicted"]) >= {"decode_tok_s", "decode_tok_s_mtp", "prefill_tok_s"}


def test_infeasible_exits_2_with_one_line():
    result = ninfer("plan", "--vram-budget", "2GiB")
    assert result.returncode == 2
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: needs") and "Traceback" not in result.stderr


def test_bad_option_exits_2_with_one_line():
    result = ninfer("plan", "--kv-dtype", "fp4")
    assert result.returncode == 2 and result.stderr.strip() == "error: --kv-dtype must be one of bf16, fp8, int8, got 'fp4'"


def test_all_profiles_side_by_side_and_plot(tmp_path):
    png = tmp_path / "speed.png"
    result = ninfer("plan", "--profile", "all", "--json", "--plot", str(png))
    assert result.returncode == 0, result.stderr
    documents = json.loads(result.stdout)
    assert [d["profile"] for d in documents] == ["h200", "rtx5060ti", "rtx5090", "rtxpro6000"]
    assert all(schema_errors(d, PLAN_SCHEMA) == [] for d in documents)
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    table = ninfer("plan", "--profile", "all", "--spec", "none")
    assert table.returncode == 0 and "Plans side by side" in table.stdout


def test_plan_does_not_import_torch():
    code = (
        "import sys, runpy; sys.argv = ['ninfer', 'plan', '--json']\n"
        "try:\n    runpy.run_module('ninfer_offload', run_name='__main__')\nexcept SystemExit:\n    pass\n"
        "print('TORCH' if 'torch' in sys.modules else 'NO-TORCH', file=sys.stderr)"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert result.stderr.strip().endswith("NO-TORCH"), result.stderr


def test_profile_without_gpu_says_so():
    torch = pytest.importorskip("torch")
    if torch.cuda.is_available():
        pytest.skip("a GPU is present")
    result = ninfer("profile")
    assert result.returncode == 2
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: no GPU")


@pytest.mark.gpu
@pytest.mark.skipif(not __import__("torch").cuda.is_available(), reason="needs CUDA")
def test_profile_measures_the_gpu(tmp_path):
    out = tmp_path / "gpu.toml"
    result = ninfer("profile", "--out", str(out))
    assert result.returncode == 0, result.stderr
    plan = ninfer("plan", "--profile", str(out), "--json")
    document = json.loads(plan.stdout)
    assert document["profile"] and schema_errors(document, PLAN_SCHEMA) == []


def test_plan_an_artifact_file(tiny_artifact_official, tmp_path):
    result = ninfer("plan", str(tiny_artifact_official), "--spec", "none", "--json")
    assert result.returncode == 0, result.stderr
    document = json.loads(result.stdout)
    assert document["feasible"] and document["routing_stats"] == "uniform"
    assert document["experts_resident"] == document["experts_total"] > 0
    missing = ninfer("plan", str(tmp_path / "absent.ninfer"))
    assert missing.returncode == 2 and len(missing.stderr.strip().splitlines()) == 1 and "Traceback" not in missing.stderr


def test_routing_stats_option(tmp_path):
    counts = tmp_path / "counts.txt"
    counts.write_text("\n".join(" ".join(["5"] * 256) for _ in range(40)) + "\n")
    result = ninfer("plan", "--profile", "rtx5060ti", "--routing-stats", str(counts), "--json")
    assert result.returncode == 0, result.stderr
    assert json.loads(result.stdout)["routing_stats"] == str(counts)
    bad = ninfer("plan", "--routing-stats", str(tmp_path / "nope.txt"))
    assert bad.returncode == 2 and bad.stderr.startswith("error: cannot read routing stats")
