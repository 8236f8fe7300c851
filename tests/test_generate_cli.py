"""`ninfer generate` end to end in subprocesses on the tiny bf16 artifact."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
from conftest import GREEDY_PROMPT
import torch

from ninfer_offload.frontend import Frontend
from ninfer_offload.runtime.generate import generate
from ninfer_offload.runtime.sampling import SamplingParams

PROMPT = GREEDY_PROMPT  # shared with the session greedy reference (conftest)
TOOLS = [{"type": "function", "function": {"name": "now", "description": "Current time.", "parameters": {}}}]


def ninfer(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "ninfer_offload", "generate", *map(str, args)], capture_output=True, text=True, timeout=300
    )


def one_line_error(run: subprocess.CompletedProcess, fragment: str) -> None:
    assert run.returncode == 2, run.stderr
    lines = run.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and fragment in lines[0], run.stderr


@pytest.fixture(scope="module")
def frontend(tiny_checkpoint):
    return Frontend.from_directory(tiny_checkpoint)


def test_json_greedy_output_equals_the_engine(tiny_artifact, frontend, reprefill_greedy):
    run = ninfer(tiny_artifact, "--prompt-ids", ",".join(map(str, PROMPT)), "--greedy", "--max-tokens", 16, "--spec", "none", "--json")
    assert run.returncode == 0, run.stderr
    out = json.loads(run.stdout)
    assert out["prompt_ids"] == PROMPT
    assert out["ids"] == reprefill_greedy
    assert out["text"] == frontend.decode(reprefill_greedy)
    assert out["finish_reason"] == "length" and out["stop_id"] is None
    assert out["prompt_tokens"] == len(PROMPT) and out["decode_steps"] == 15 and out["speculation"] is None
    assert out["prefill_tokens_per_s"] > 0 and out["decode_tokens_per_s"] > 0
    assert out["warm_up_seconds"] >= 0  # the warm-up before timing is reported apart


def test_a_prompt_prefilled_in_small_chunks_gives_the_same_output(tiny_artifact, reprefill_greedy):
    """`--prefill-chunk 3`: the prompt runs through the model three tokens per forward, the output is the same."""
    assert len(PROMPT) > 3
    args = ["--prompt-ids", ",".join(map(str, PROMPT)), "--greedy", "--max-tokens", 16, "--spec", "none", "--prefill-chunk", 3, "--json"]
    run = ninfer(tiny_artifact, *args)
    assert run.returncode == 0, run.stderr
    assert json.loads(run.stdout)["ids"] == reprefill_greedy


@pytest.mark.parametrize("drafts", [["--profile", "SPECULATING_CARD"], ["--spec", "mtp", "--draft-tokens", 2]])
def test_json_greedy_with_mtp_drafts_is_the_same_output(tiny_artifact, reprefill_greedy, speculating_card, drafts):
    """`--spec auto` (the default) with 3 drafts on a card where they pay, or as asked."""
    drafts = [str(speculating_card) if arg == "SPECULATING_CARD" else arg for arg in drafts]
    run = ninfer(tiny_artifact, "--prompt-ids", ",".join(map(str, PROMPT)), "--greedy", "--max-tokens", 16, *drafts, "--json")
    assert run.returncode == 0, run.stderr
    if "--profile" in drafts:
        assert "decoding with 3 MTP drafts per step (--spec auto: on, x2.41 projected for speculating_card" in run.stderr
    out = json.loads(run.stdout)
    assert out["ids"] == reprefill_greedy
    spec = out["speculation"]
    assert spec["rounds"] == out["decode_steps"] and out["decode_tokens"] == spec["rounds"] + spec["accepted"]
    assert len(spec["acceptance_at"]) == (int(drafts[-1]) if "--draft-tokens" in drafts else 3)


def test_proposal_head_drafts_give_the_plain_output(tiny_artifact, tiny_artifact_proposal):
    ids = ",".join(map(str, PROMPT))
    plain = ninfer(tiny_artifact_proposal, "--prompt-ids", ids, "--greedy", "--max-tokens", 12, "--spec", "none", "--json")
    drafted = ninfer(tiny_artifact_proposal, "--prompt-ids", ids, "--greedy", "--max-tokens", 12, "--spec", "mtp", "--proposal-head")
    assert plain.returncode == drafted.returncode == 0, plain.stderr + drafted.stderr
    text = json.loads(plain.stdout)["text"].replace("\r\n", "\n").replace("\r", "\n")  # as the text-mode pipe reads it
    assert drafted.stdout == text + "\n"
    assert "MTP: " in drafted.stderr and "of drafts accepted" in drafted.stderr
    one_line_error(ninfer(tiny_artifact, "--prompt-ids", ids, "--spec", "mtp", "--proposal-head"), "has no proposal head")


def test_streamed_text_is_the_generated_text(tiny_artifact, tiny_engine, frontend):
    """The text streams to stdout; stderr counts the decode tokens as --json's `decode_tokens` does, and on a
    CPU load reports no warm-up (there is none)."""
    run = ninfer(tiny_artifact, "--prompt", "Hello, how are you?", "--greedy", "--max-tokens", 12, "--no-thinking")
    assert run.returncode == 0, run.stderr
    prompt = frontend.encode(frontend.render([{"role": "user", "content": "Hello, how are you?"}], enable_thinking=False))
    result = generate(tiny_engine, prompt, 12, SamplingParams(greedy=True), frontend.stop_ids).run()
    assert run.stdout == frontend.decode(result.token_ids) + "\n"
    assert result.finish_reason == "length"  # the decode passes made one token fewer than the text has
    assert f"| decode: {result.decode_tokens} tokens, {result.decode_steps} steps in " in run.stderr
    speculation, summary = run.stderr.splitlines()
    assert speculation.startswith("decoding with no speculation (--spec auto: off, speculation is projected for a GPU")
    assert summary.startswith("prefill: ") and "tok/s" in summary and "warm-up" not in run.stderr


def test_messages_file_tools_and_template_override(tmp_path, tiny_artifact, frontend):
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What time is it?"}]
    (tmp_path / "chat.json").write_text(json.dumps({"messages": messages, "tools": TOOLS}))
    run = ninfer(tiny_artifact, "--messages", tmp_path / "chat.json", "--no-thinking", "--max-tokens", 3, "--seed", 5, "--json")
    assert run.returncode == 0, run.stderr
    expected = frontend.encode(frontend.render(messages, tools=TOOLS, enable_thinking=False))
    assert json.loads(run.stdout)["prompt_ids"] == expected
    (tmp_path / "plain.jinja").write_text("{% for m in messages %}{{ m.content }}{% endfor %}")
    run = ninfer(tiny_artifact, "--prompt", "abc", "--chat-template", tmp_path / "plain.jinja", "--max-tokens", 1, "--json")
    assert json.loads(run.stdout)["prompt_ids"] == frontend.encode("abc")


def test_seeded_sampling_reproduces_across_processes(tiny_artifact, tiny_engine, frontend):
    args = ("--temperature", 1.3, "--top-k", 20, "--top-p", 0.9, "--min-p", 0, "--repetition-penalty", 1)
    run = ninfer(tiny_artifact, "--prompt-ids", "1,2,3", *args, "--seed", 77, "--max-tokens", 8, "--spec", "none", "--json")
    assert run.returncode == 0, run.stderr
    params = SamplingParams(temperature=1.3, top_k=20, top_p=0.9, seed=77)
    assert json.loads(run.stdout)["ids"] == generate(tiny_engine, [1, 2, 3], 8, params, frontend.stop_ids).run().token_ids


def test_prompt_beyond_the_context_limit(tiny_artifact):
    one_line_error(ninfer(tiny_artifact, "--prompt-ids", ",".join(["5"] * 40), "--max-context", 16), "context")


def test_bad_sampling_option(tiny_artifact):
    one_line_error(ninfer(tiny_artifact, "--prompt-ids", "1", "--top-p", 0), "--top-p must be in (0, 1]")


def test_bad_inputs_are_one_line_errors(tmp_path, tiny_artifact):
    one_line_error(ninfer(tiny_artifact, "--prompt", "a", "--prompt-ids", "1"), "exactly one of")
    one_line_error(ninfer(tiny_artifact), "exactly one of")
    one_line_error(ninfer(tmp_path / "missing.ninfer", "--prompt", "a"), "no such artifact file")
    one_line_error(ninfer(tiny_artifact, "--prompt-ids", "1,x"), "comma-separated integers")
    one_line_error(ninfer(tiny_artifact, "--prompt-ids", "1,,2"), "--prompt-ids must be comma-separated integers, got '1,,2'")
    one_line_error(ninfer(tiny_artifact, "--prompt", "a", "--experts", "gpu"), "experts must be one of")
    one_line_error(ninfer(tiny_artifact, "--prompt", "a", "--max-tokens", 0), "--max-tokens must be >= 1")
    one_line_error(ninfer(tiny_artifact, "--messages", tmp_path / "none.json"), "cannot read messages file")
    (tmp_path / "bad.json").write_text("[{")
    one_line_error(ninfer(tiny_artifact, "--messages", tmp_path / "bad.json"), "not valid JSON")
    one_line_error(ninfer(tiny_artifact, "--prompt", "a", "--chat-template", tmp_path / "none.jinja"), "cannot read chat template")
    one_line_error(ninfer(tiny_artifact, "--prompt", "a", "--kv-dtype", "bf16"), "unsupported KV dtype 'bf16': use fp8")


def test_an_fp8_kv_cache_gives_the_engines_fp8_output(tiny_artifact):
    """`--kv-dtype fp8` loads as `Engine.load(kv_dtype="fp8")` does: the same greedy tokens."""
    from ninfer_offload import Engine

    run = ninfer(tiny_artifact, "--prompt-ids", ",".join(map(str, PROMPT)), "--greedy", "--max-tokens", 8, "--kv-dtype", "fp8", "--json")
    assert run.returncode == 0, run.stderr
    engine = Engine.load(tiny_artifact, kv_dtype="fp8")
    try:
        assert all(k.dtype == v.dtype == torch.float8_e4m3fn for k, v in engine.state.kv.values())
        assert json.loads(run.stdout)["ids"] == generate(engine, PROMPT, 8, SamplingParams(greedy=True)).run().token_ids
    finally:
        engine.close()


def test_a_prompt_of_invalid_utf8_bytes_is_a_one_line_error(tiny_artifact):
    run = subprocess.run(
        [sys.executable, "-m", "ninfer_offload", "generate", str(tiny_artifact), "--prompt", b"caf\xe9 \xff"],
        capture_output=True, text=True, timeout=300,
    )
    one_line_error(run, "--prompt is not valid UTF-8 text (byte 3 of it cannot be decoded)")


def test_a_directory_is_named_as_one(tmp_path, tiny_checkpoint):
    """A Hugging Face checkpoint's directory gets the command that converts it."""
    message = (
        f"{tiny_checkpoint} is a directory holding a Hugging Face checkpoint, not a .ninfer artifact: "
        f"convert it first with 'ninfer convert {tiny_checkpoint} {tiny_checkpoint.name}.ninfer'"
    )
    one_line_error(ninfer(tiny_checkpoint, "--prompt", "a"), message)
    one_line_error(ninfer(tmp_path, "--prompt", "a"), f"{tmp_path} is a directory, not a .ninfer artifact file")


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the error on a machine without CUDA")
def test_cuda_without_a_cuda_device(tiny_artifact):
    one_line_error(ninfer(tiny_artifact, "--prompt", "a", "--device", "cuda"), "no CUDA GPU")


def test_a_vram_budget_offloads_experts_and_reports_the_cache(tiny_artifact_official, small_card, half_expert_budget):
    """`--profile FILE --vram-budget SIZE` plans the load: half the experts stay on the host, the greedy
    output is the all-resident one, and the expert cache reports in --json and on stderr."""
    profile, budget = small_card, half_expert_budget
    ids = ",".join(map(str, PROMPT))
    want = ninfer(tiny_artifact_official, "--prompt-ids", ids, "--greedy", "--max-tokens", 8, "--json")
    got = ninfer(
        tiny_artifact_official, "--prompt-ids", ids, "--greedy", "--max-tokens", 8, "--json", "--profile", profile,
        "--vram-budget", f"{budget}B", "--spec", "none",  # the budget is planned without the MTP layer
    )
    assert want.returncode == got.returncode == 0, got.stderr
    out = json.loads(got.stdout)
    assert out["ids"] == json.loads(want.stdout)["ids"]
    assert 0 < out["experts"]["hit_rate"] < 1 and out["experts"]["pcie_bytes_per_token"] > 0
    assert "plan small_card" in got.stderr and "experts in cpu memory (no VRAM on a cpu load)" in got.stderr
    small = ninfer(tiny_artifact_official, "--prompt-ids", ids, "--profile", profile, "--vram-budget", "1KiB")
    one_line_error(small, "budget")
