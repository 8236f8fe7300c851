"""`ninfer plan` and `ninfer profile` through the real command line."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from ninfer_offload.artifact.contract import official_directory
from ninfer_offload.artifact.inventory import Inventory
from ninfer_offload.planner import PLAN_SCHEMA, PlanOptions, plan
from ninfer_offload.planner.schema import schema_errors
from ninfer_offload.profiles import load_profile


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
    assert [d["profile"] for d in documents] == ["h100", "h200", "rtx5060ti", "rtx5090", "rtxpro6000"]
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


def test_sizes_need_a_unit():
    result = ninfer("plan", "--vram-budget", "12")
    assert result.returncode == 2 and result.stderr.strip() == "error: size '12' has no unit; write e.g. 12GiB (binary) or 12GB (decimal)"


def test_budget_above_the_card_warns():
    result = ninfer("plan", "--vram-budget", "48GiB", "--json")
    assert result.returncode == 0, result.stderr
    assert result.stderr.strip() == "warning: --vram-budget 48GiB is more than the 32.0 GiB of rtx5090; planning with the whole card"
    document = json.loads(result.stdout)
    assert document["vram_budget_bytes"] == document["vram_total_bytes"]


def test_at_context_is_checked_against_the_context():
    result = ninfer("plan", "--max-context", "2048", "--at-context", "8192")
    assert result.returncode == 2 and "--at-context 8192 is beyond the context of 2048 tokens" in result.stderr
    assert ninfer("plan", "--max-context", "2048", "--json").returncode == 0  # the default follows the context


def test_host_budget_message_shows_the_value_given():
    result = ninfer("plan", "--profile", "rtx5060ti", "--host-budget", "1GiB")
    assert result.returncode == 2 and "budget is 1.0 GiB (given by --host-budget)" in result.stderr and "75%" not in result.stderr


def test_an_artifact_plans_with_its_own_components_and_context(tiny_artifact_official, tmp_path):
    from ninfer_offload.convert import convert
    from ninfer_offload.convert.tiny import write_checkpoint

    options = json.loads(ninfer("plan", str(tiny_artifact_official), "--json").stdout)["options"]
    # A load's defaults: the model's context (up to 32768), no proposal head, and --spec auto deciding as the load
    # would (MTP does not pay on the rtx5090 at the H200's timings); MTP as asked where the artifact has it.
    assert (options["speculative"], options["proposal_head"], options["max_context"], options["at_context"]) == ("none", False, 4096, 4096)
    asked = json.loads(ninfer("plan", str(tiny_artifact_official), "--spec", "mtp", "--json").stdout)["options"]
    assert asked["speculative"] == "mtp"
    no_mtp = convert(write_checkpoint(tmp_path / "src", mtp=False), tmp_path / "no_mtp.ninfer", progress=False)
    result = ninfer("plan", str(no_mtp), "--json")
    assert result.returncode == 0, result.stderr
    assert json.loads(result.stdout)["options"]["speculative"] == "none"
    explicit = ninfer("plan", str(no_mtp), "--spec", "mtp")
    assert explicit.returncode == 2 and explicit.stderr.strip() == "error: artifact has no MTP component; use --spec none"
    beyond = ninfer("plan", str(no_mtp), "--max-context", "8192")
    assert beyond.returncode == 2 and "beyond the model's maximum context of 4096 tokens" in beyond.stderr


def test_profile_auto_without_a_gpu_names_the_alternative(tmp_path):
    torch = pytest.importorskip("torch")
    if torch.cuda.is_available():
        pytest.skip("a GPU is present")
    result = ninfer("plan", "--profile", "auto", env={**os.environ, "NINFER_PROFILE": str(tmp_path / "none.toml")})
    assert result.returncode == 2 and len(result.stderr.strip().splitlines()) == 1
    assert "--profile auto has no profile stored at" in result.stderr and "name a card instead, e.g. --profile rtx5090" in result.stderr


@pytest.mark.parametrize(
    "args, labels",
    [
        ([], ("per layer min / mean / max", "routing mass covered", "KV capacity (tokens)")),
        (["--profile", "rtx5060ti", "--spec", "none"], ("pinned host used / budget", "decode tok/s (batch 1)")),
        (["--profile", "all"], ("per layer min-max", "memory bandwidth GB/s", "KV capacity (tokens)")),
    ],
)
def test_tables_fit_80_columns(args, labels):
    result = ninfer("plan", *args, env={**os.environ, "COLUMNS": "80"})
    assert result.returncode == 0, result.stderr
    widest = max(len(line) for line in result.stdout.splitlines())
    assert widest <= 80 and "…" not in result.stdout, result.stdout
    assert all(label in result.stdout for label in labels), result.stdout  # whole labels: nothing wrapped or cut


def test_plot_marks_the_chosen_budget():
    from ninfer_offload.planner.plot import speed_curve, speed_figure

    inventory = Inventory.from_directory(official_directory())
    profile, options = load_profile("rtx5060ti"), PlanOptions(vram_budget=12 * 2**30)
    placement = plan(inventory, profile, options)
    figure = speed_figure({profile.name: speed_curve(inventory, profile, options, None, points=8)}, [placement], "test")
    lines = {line.get_label(): line for line in figure.axes[0].get_lines()}
    budget = lines["rtx5060ti: chosen budget 12.0 GiB"]
    assert list(budget.get_xdata()) == [12.0, 12.0]
    marker = next(line for line in lines.values() if list(line.get_xdata()) == [12.0] and line.get_marker() == "o")
    assert list(marker.get_ydata()) == [placement.predicted.decode_tok_s]
