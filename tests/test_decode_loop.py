"""One decode loop for the CLI and the server: the same request gives the same tokens (and log-probabilities)
through `ninfer generate` (a batch of one, `runtime.generate`) and the server's scheduler (`serve.scheduler`),
greedy and seeded, with and without MTP speculation, with a grammar and with logprobs."""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys

import pytest
from conftest import GREEDY_PROMPT

from ninfer_offload.frontend.grammar import GrammarCompiler
from ninfer_offload.runtime.decoder import GenerationRequest
from ninfer_offload.runtime.engine import Engine
from ninfer_offload.runtime.generate import generate
from ninfer_offload.runtime.sampling import SamplingParams
from ninfer_offload.serve.scheduler import Scheduler

SCHEMA = {"type": "object", "properties": {"n": {"type": "integer"}, "ok": {"type": "boolean"}}, "required": ["n", "ok"]}
SAMPLINGS = {"greedy": SamplingParams(greedy=True), "seeded": SamplingParams(temperature=0.9, top_p=0.9, seed=11)}


@pytest.fixture(scope="module", params=["none", "mtp"])
def engine(request, tiny_artifact):
    loaded = Engine.load(tiny_artifact, device="cpu", max_sequences=2, spec=request.param)
    yield loaded
    loaded.close()


@pytest.fixture(scope="module")
def grammars(frontend):
    return GrammarCompiler.for_frontend(frontend, frontend.vocab_size)


def served(engine, request: GenerationRequest) -> tuple[list[int], list]:
    """Tokens and log-probabilities of `request` through the server's scheduler."""

    async def run():
        scheduler = Scheduler(engine, max_concurrency=1, max_queue=1)
        scheduler.start()
        handle = scheduler.submit(request, asyncio.get_running_loop())
        tokens = [token async for token in handle.tokens()]
        scheduler.stop()
        return tokens, handle.logprobs

    return asyncio.run(run())


@pytest.mark.parametrize("sampling", SAMPLINGS)
@pytest.mark.parametrize("extra", ["plain", "grammar", "logprobs"])
def test_generate_and_the_server_give_the_same_tokens(engine, grammars, frontend, sampling, extra):
    def request() -> GenerationRequest:  # a fresh grammar each time: a constraint follows one output
        constraint = grammars.json(SCHEMA, thinking=False) if extra == "grammar" else None
        logprobs = 3 if extra == "logprobs" else None
        return GenerationRequest(GREEDY_PROMPT, 24, SAMPLINGS[sampling], frozenset(frontend.stop_ids), constraint, logprobs)

    first = request()
    alone = generate(engine, first.prompt_ids, first.max_tokens, first.sampling, first.stop_ids, first.constraint, first.logprobs)
    tokens = list(alone)
    assert (tokens, alone.logprobs) == served(engine, request())
    assert len(alone.logprobs) == (len(tokens) if extra == "logprobs" else 0)
    if extra == "grammar":
        assert frontend.decode(tokens).startswith("{")
    speculating = engine.spec_tokens and extra == "plain"
    assert (alone.result.speculation is not None) == bool(speculating)


def test_the_cli_goes_through_the_same_loop(tiny_artifact, tmp_path, frontend, grammars):
    """`ninfer generate --json --logprobs --json-schema` gives the tokens and log-probabilities of the loop."""
    schema = tmp_path / "schema.json"
    schema.write_text(json.dumps(SCHEMA))
    args = ["--prompt-ids", ",".join(map(str, GREEDY_PROMPT)), "--max-tokens", "16", "--temperature", "0.9", "--top-p", "0.9"]
    run = subprocess.run(
        [sys.executable, "-m", "ninfer_offload", "generate", str(tiny_artifact), *args, "--seed", "11", "--json", "--logprobs", "2",
         "--json-schema", str(schema)],
        capture_output=True, text=True, timeout=300,
    )
    assert run.returncode == 0, run.stderr
    printed = json.loads(run.stdout)
    engine = Engine.load(tiny_artifact, device="cpu")
    try:
        request = GenerationRequest(
            GREEDY_PROMPT, 16, SAMPLINGS["seeded"], frozenset(frontend.stop_ids), grammars.json(SCHEMA, thinking=False), 2
        )
        tokens, logprobs = served(engine, request)
    finally:
        engine.close()
    assert printed["ids"] == tokens
    assert [entry["logprob"] for entry in printed["logprobs"]] == [lp.logprob for lp in logprobs]
    assert [[alt["id"] for alt in entry["top"]] for entry in printed["logprobs"]] == [[t for t, _ in lp.top] for lp in logprobs]
    assert printed["text"].startswith("{")


def test_cli_logprobs_and_schema_errors_are_one_line(tiny_artifact, tmp_path):
    def error_of(*args: str) -> str:
        run = subprocess.run(
            [sys.executable, "-m", "ninfer_offload", "generate", str(tiny_artifact), "--prompt-ids", "1,2", *args],
            capture_output=True, text=True, timeout=300,
        )
        assert run.returncode == 2, run.stderr
        lines = run.stderr.strip().splitlines()
        assert len(lines) == 1 and lines[0].startswith("error: "), run.stderr
        return lines[0]

    bad_json = tmp_path / "bad.json"
    bad_json.write_text("{not json")
    refused = tmp_path / "refused.json"
    refused.write_text(json.dumps({"type": "object", "properties": {"x": {"type": "no-such-type"}}}))
    assert "--logprobs must be 0..20" in error_of("--json", "--logprobs", "21")
    assert "add --json" in error_of("--logprobs", "2")
    assert "not valid JSON" in error_of("--json-schema", str(bad_json))
    assert "invalid JSON schema" in error_of("--json-schema", str(refused))
    assert "cannot read JSON schema file" in error_of("--json-schema", str(tmp_path / "missing.json"))
