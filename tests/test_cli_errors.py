"""One-line errors everywhere: usage errors, flag names in messages, the stray-safetensors case, and
`ninfer generate` refusing what it can before the slow load."""

from __future__ import annotations

import shutil
import subprocess
import sys

import pytest
import torch
from safetensors.torch import save_file
from typer.testing import CliRunner

from ninfer_offload import Engine
from ninfer_offload.cli import app
from ninfer_offload.errors import NinferError
from ninfer_offload.runtime import engine as engine_module


def ninfer(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "ninfer_offload", *map(str, args)], capture_output=True, text=True, timeout=300)


def one_line_error(run: subprocess.CompletedProcess, fragment: str) -> None:
    assert run.returncode == 2, (run.returncode, run.stderr)
    lines = run.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and fragment in lines[0], run.stderr


@pytest.mark.parametrize(
    "args, fragment",
    [
        (["generate"], "missing argument 'artifact'; see 'ninfer generate --help'"),
        (["generate", "model.ninfer", "--bogus"], "no such option: --bogus"),
        (["plan", "--max-context", "lots"], "invalid value for '--max-context'"),
        (["convert", "only-one-argument"], "missing argument 'out_path'"),
        (["frobnicate"], "no such command 'frobnicate'"),
    ],
)
def test_usage_errors_are_one_line(args, fragment):
    one_line_error(ninfer(*args), fragment)


def test_bare_ninfer_prints_the_help_as_a_usage_error():
    bare = ninfer()
    assert bare.returncode == 2 and "Usage: ninfer" in bare.stderr and "tiny" in bare.stderr and bare.stdout == ""


def test_help_shows_no_value_type_on_flags():
    """A flag takes no value: `--greedy`, `--json`, `--help` show none (they once read `<bool>`)."""
    for args in (["--help"], ["generate", "--help"], ["serve", "--help"]):
        run = ninfer(*args)
        assert run.returncode == 0 and "Usage: ninfer" in run.stdout, run.stderr
        assert "<bool>" not in run.stdout and "--help " in run.stdout


@pytest.mark.parametrize(
    "plot, fragment",
    [
        ("/nonexistent/x.png", "--plot /nonexistent/x.png: no such directory /nonexistent"),
        ("x.txt", "--plot writes a PNG image: give a file name ending in .png, got x.txt"),
    ],
)
def test_plan_plot_path_is_checked(plot, fragment):
    one_line_error(ninfer("plan", "--plot", plot), fragment)


@pytest.fixture
def no_load(monkeypatch):
    """Engine.load fails loudly: an error raised before it proves the check came first."""

    def load(*args, **kwargs):
        raise AssertionError("Engine.load was called")

    monkeypatch.setattr(engine_module.Engine, "load", load)


@pytest.mark.parametrize(
    "args, fragment",
    [
        (["--prompt", "a", "--greedy", "--temperature", "0.7"], "--greedy and --temperature contradict each other"),
        (["--prompt", "a", "--miss-path", "cpu"], "--miss-path cpu computes experts kept in host memory: add --experts host"),
        (["--prompt", "a", "--miss-path", "disk"], "--miss-path must be one of pcie, cpu, auto"),
        (["--prompt", "a", "--experts", "gpu"], "--experts must be one of auto, resident, host"),
        (["--prompt", "a", "--spec", "eagle"], "--spec must be one of auto, none, mtp"),
        (["--prompt", "a", "--spec", "dflash2"], "--spec dflash2: drafting with a DFlash model is not supported"),
        (["--prompt", "a", "--spec", "mtp", "--draft-tokens", "9"], "--draft-tokens must be 1..5"),
        (["--prompt-ids", "1,600"], "token id 600 is outside the model's vocabulary [0, 512)"),
        (["--prompt", "a", "--max-context", "5000"], "--max-context must be between 1 and the model's maximum context of 4096"),
        (["--prompt-ids", ",".join(["5"] * 40), "--max-context", "16"], "more than the context limit of 16; raise --max-context"),
        (["--prompt-ids", ",".join(["5"] * 4097)], "more than the context limit of 4096; that is the model's maximum context"),
        (["--prompt", "a", "--top-p", "0"], "--top-p must be in (0, 1]"),
        (["--prompt", "a", "--prefill-chunk", "0"], "--prefill-chunk must be >= 1, got 0"),
    ],
)
def test_generate_refuses_before_loading(args, fragment, tiny_artifact, no_load):
    result = CliRunner().invoke(app, ["generate", str(tiny_artifact), *args])
    assert isinstance(result.exception, NinferError), result.exception
    assert fragment in str(result.exception)


@pytest.mark.parametrize(
    "args, message",
    [
        # `plan` once planned a zero budget (an infeasible plan), read --spec dflash as an unknown mode and refused --spec auto
        (["--vram-budget", "0"], "--vram-budget must be more than 0"),
        (["--vram-budget", "12"], "size '12' has no unit; write e.g. 12GiB (binary) or 12GB (decimal)"),
        (["--spec", "dflash"], "--spec dflash: drafting with a DFlash model is not supported"),
        (["--spec", "eagle"], "--spec must be one of auto, none, mtp, got 'eagle'"),
        (["--spec", "mtp", "--draft-tokens", "9"], "--draft-tokens must be 1..5, got 9"),
        (["--miss-path", "disk"], "--miss-path must be one of pcie, cpu, auto, got 'disk'"),
        (["--prefill-chunk", "0"], "--prefill-chunk must be >= 1, got 0"),
    ],
)
def test_plan_and_generate_refuse_a_load_option_alike(args, message, tiny_artifact, no_load):
    """The load options `plan` shares with `generate` are checked by one `LoadRequest`: the same one-line error."""
    plan = CliRunner().invoke(app, ["plan", *args])
    generate = CliRunner().invoke(app, ["generate", str(tiny_artifact), "--prompt", "a", *args])
    for result in (plan, generate):
        assert isinstance(result.exception, NinferError), result.exception
    assert str(plan.exception) == str(generate.exception)
    assert message in str(plan.exception) and "\n" not in str(plan.exception)


@pytest.mark.parametrize("options", [["--experts", "host", "--miss-path", "cpu"], ["--top-k", "-1"], ["--top-k", "0"]])
def test_valid_options_reach_the_load(tiny_artifact, no_load, options):
    """-1 turns top-k off as 0 does (the server's rule too)."""
    result = CliRunner().invoke(app, ["generate", str(tiny_artifact), "--prompt", "a", *options])
    assert isinstance(result.exception, AssertionError) and "Engine.load was called" in str(result.exception)


def test_a_negative_top_k_other_than_minus_one_is_refused(tiny_artifact, no_load):
    result = CliRunner().invoke(app, ["generate", str(tiny_artifact), "--prompt", "a", "--top-k", "-2"])
    assert isinstance(result.exception, NinferError) and str(result.exception) == "--top-k must be an integer >= 0 (0 or -1 disables it)"


def test_engine_messages_name_the_flags(tiny_artifact):
    with pytest.raises(NinferError, match="add --experts host"):
        Engine.load(tiny_artifact, miss_path="cpu")
    engine = Engine.load(tiny_artifact, max_context=4096)
    try:
        with pytest.raises(NinferError, match="that is the model's maximum context") as err:
            engine.logits([5] * 4097)
        assert "raise --max-context" not in str(err.value)
    finally:
        engine.close()


def test_convert_reads_the_files_transformers_reads(tiny_checkpoint, tmp_path):
    src = shutil.copytree(tiny_checkpoint, tmp_path / "src")
    save_file({"stray": torch.zeros(2)}, src / "old-model.safetensors")
    run = ninfer("convert", src, tmp_path / "a.ninfer", "--no-progress")
    assert run.returncode == 0, run.stderr
    warning = "warning: ignoring old-model.safetensors (without model.safetensors.index.json only model.safetensors is read)"
    assert run.stderr.strip() == warning
    (src / "model.safetensors").rename(src / "consolidated.safetensors")
    one_line_error(
        ninfer("convert", src, tmp_path / "b.ninfer"),
        "no model.safetensors or model.safetensors.index.json (found consolidated.safetensors, old-model.safetensors",
    )
