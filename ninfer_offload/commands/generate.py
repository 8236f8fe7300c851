"""`ninfer generate ARTIFACT (--prompt TEXT | --messages FILE.json | --prompt-ids 1,2,3) [...]`.

Streams the generated text to stdout as it is produced (statistics go to stderr), or with
`--json` prints one JSON object: prompt and generated ids, text, finish reason, timings (and with
`--logprobs N` each token's log-probability and its N most likely alternatives). `--json-schema FILE`
constrains the output to one JSON value matching the schema (after the reasoning, when the prompt
leaves thinking open), as the server's `response_format` does.
Sampling options left unset take the model's generation_config.json values (as transformers
does, `do_sample: false` meaning greedy), then the neutral defaults; `--greedy` (or
`--temperature 0`) takes the argmax. Everything that can be checked without the weights (options,
the prompt against the context and the vocabulary) is checked before the slow load.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import typer

from ninfer_offload.commands.bench_routing import apply_bench_routing
from ninfer_offload.commands.load_options import PLACEMENT, SPECULATION, load_options
from ninfer_offload.errors import NinferError
from ninfer_offload.planner.request import DEFAULT_MAX_CONTEXT, LoadRequest


MAX_LOGPROBS = 20  # alternatives per token, OpenAI's top_logprobs limit


def _read_text(path: Path, what: str) -> str:
    try:
        return path.read_text(encoding="utf-8")
    except OSError as err:
        raise NinferError(f"cannot read {what} {path}: {err.strerror or err}") from None
    except UnicodeDecodeError:
        raise NinferError(f"{what} {path} is not UTF-8 text") from None


def _parse_ids(text: str) -> list[int]:
    """Comma-separated integers (spaces around them allowed); an empty item ("1,,2", a trailing comma) is refused."""
    if not text.strip():
        raise NinferError("--prompt-ids is empty")
    try:
        return [int(part) for part in text.split(",")]
    except ValueError:
        raise NinferError(f"--prompt-ids must be comma-separated integers, got {text!r}") from None


def _check_utf8(text: str, flag: str) -> None:
    """Refuse a command-line value whose bytes were not UTF-8 (Python keeps them as lone surrogates)."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as err:
        raise NinferError(f"{flag} is not valid UTF-8 text (byte {err.start} of it cannot be decoded)") from None


def _read_messages(path: Path) -> tuple[list[dict], list[dict] | None]:
    """A JSON list of messages, or an object with "messages" (and optionally "tools")."""
    try:
        data = json.loads(_read_text(path, "messages file"))
    except json.JSONDecodeError as err:
        raise NinferError(f"messages file {path} is not valid JSON: {err}") from None
    if isinstance(data, dict):
        return data.get("messages"), data.get("tools")
    return data, None


def _check_prompt(ids: list[int], text_config: dict, max_context: int | None, default_context: int) -> None:
    """The prompt fits the context and the vocabulary; --max-context is within the model's maximum."""
    limit, vocab = int(text_config["max_position_embeddings"]), int(text_config["vocab_size"])
    if max_context is not None and not 0 < max_context <= limit:
        raise NinferError(f"--max-context must be between 1 and the model's maximum context of {limit} tokens, got {max_context}")
    if not ids:
        raise NinferError("the prompt is empty: give at least one token")
    bad = next((t for t in ids if not 0 <= t < vocab), None)
    if bad is not None:
        raise NinferError(f"token id {bad} is outside the model's vocabulary [0, {vocab})")
    capacity = max_context if max_context is not None else min(limit, default_context)
    if len(ids) > capacity:
        remedy = "that is the model's maximum context" if capacity == limit else f"raise --max-context (the model allows up to {limit})"
        raise NinferError(f"the prompt has {len(ids)} tokens, more than the context limit of {capacity}; {remedy}")


def _read_schema(path: Path) -> dict:
    """A JSON schema file's object."""
    try:
        schema = json.loads(_read_text(path, "JSON schema file"))
    except json.JSONDecodeError as err:
        raise NinferError(f"JSON schema file {path} is not valid JSON: {err}") from None
    if not isinstance(schema, dict):
        raise NinferError(f"JSON schema file {path} must hold a JSON object")
    return schema


def _logprob_entries(frontend, tokens: list[int], logprobs: list) -> list[dict]:
    """One JSON entry per generated token: its id, text and log-probability, and the alternatives'."""

    def entry(token: int, logprob: float) -> dict:
        return {"id": token, "text": frontend.decode([token]), "logprob": logprob}

    return [{**entry(token, lp.logprob), "top": [entry(t, v) for t, v in lp.top]} for token, lp in zip(tokens, logprobs)]


def _sampling(generation_config: dict, greedy: bool, **given):
    """SamplingParams from the options given and the model's generation config; a bad option is named by its flag."""
    from ninfer_offload.runtime.sampling import sampling_from_config

    try:
        return sampling_from_config(generation_config, greedy=greedy, **given)
    except NinferError as err:
        param, message = getattr(err, "param", None), str(err)  # a sampling error names its field
        if given.get(param) is None:
            raise  # the value came from generation_config.json
        flag = f"--{param.replace('_', '-')}"
        raise NinferError(flag + message[len(param):] if message.startswith(param) else f"{flag}: {message}") from None


def _expert_summary(stats: dict) -> str:
    return (
        f"experts: hit rate {stats['hit_rate']:.1%}, {stats['pcie_bytes_per_token'] / 1e6:.2f} MB/token read from host memory, "
        f"{stats['promotions_per_token']:.2f} promotions/token"
    )


def _summary(result) -> str:
    line = (
        f"prefill: {result.prompt_tokens} tokens in {result.prefill_seconds:.3f} s "
        f"({result.prefill_tokens_per_s:.1f} tok/s) | decode: {result.decode_tokens} tokens, "
        f"{result.decode_steps} steps in {result.decode_seconds:.3f} s ({result.decode_tokens_per_s:.1f} tok/s) "
        f"| finish: {result.finish_reason}"
    )
    if result.speculation:
        spec = result.speculation
        line += f" | MTP: {spec['acceptance_rate']:.0%} of drafts accepted, {spec['tokens_per_round']:.2f} tokens per step"
    return line


@load_options(*PLACEMENT, *SPECULATION, "max_context", "kv_dtype", "prefill_chunk")
def generate(
    artifact: Path = typer.Argument(..., help="The .ninfer entry file."),
    prompt: str | None = typer.Option(None, "--prompt", help="A user message, rendered with the chat template."),
    messages: Path | None = typer.Option(None, "--messages", help="JSON file: a list of messages or {messages, tools}."),
    prompt_ids: str | None = typer.Option(None, "--prompt-ids", help="Token ids, comma-separated (no template)."),
    raw: bool = typer.Option(False, "--raw", help="Encode --prompt as plain text, without the chat template."),
    max_tokens: int = typer.Option(256, "--max-tokens", help="Most tokens to generate."),
    greedy: bool = typer.Option(False, "--greedy", help="Always take the most likely token."),
    temperature: float | None = typer.Option(None, "--temperature", help="Softmax temperature (0 = greedy)."),
    top_k: int | None = typer.Option(None, "--top-k", help="Keep the k most likely tokens (0 = off; -1 too)."),
    top_p: float | None = typer.Option(None, "--top-p", help="Keep the smallest set reaching this probability."),
    min_p: float | None = typer.Option(None, "--min-p", help="Drop tokens below min_p x the top probability."),
    presence_penalty: float = typer.Option(0.0, "--presence-penalty", help="OpenAI presence penalty."),
    frequency_penalty: float = typer.Option(0.0, "--frequency-penalty", help="OpenAI frequency penalty."),
    repetition_penalty: float | None = typer.Option(None, "--repetition-penalty", help="Repetition penalty (1 = off)."),
    seed: int | None = typer.Option(None, "--seed", help="Seed for reproducible sampling."),
    no_thinking: bool = typer.Option(False, "--no-thinking", help="Render the template with thinking disabled."),
    chat_template: Path | None = typer.Option(None, "--chat-template", help="Jinja chat template file to use instead."),
    device: str = typer.Option("cpu", "--device", help="cpu or cuda[:N]."),
    json_out: bool = typer.Option(False, "--json", help="Print one JSON object instead of streaming text."),
    logprobs: int | None = typer.Option(
        None, "--logprobs", help="With --json: each token's log-probability and this many most likely alternatives (0..20)."
    ),
    json_schema: Path | None = typer.Option(None, "--json-schema", help="JSON schema file: the output is one JSON value matching it."),
    *,
    load: dict,
) -> None:
    """Generate text from a prompt, a conversation or token ids.

    Text streams to stdout, statistics to stderr. Sampling options left unset take the model's
    generation_config.json values."""
    if sum(x is not None for x in (prompt, messages, prompt_ids)) != 1:
        raise NinferError("give exactly one of --prompt, --messages, --prompt-ids")
    if raw and prompt is None:
        raise NinferError("--raw applies to --prompt only")
    if max_tokens < 1:
        raise NinferError(f"--max-tokens must be >= 1, got {max_tokens}")
    if logprobs is not None and not 0 <= logprobs <= MAX_LOGPROBS:
        raise NinferError(f"--logprobs must be 0..{MAX_LOGPROBS}, got {logprobs}")
    if logprobs is not None and not json_out:
        raise NinferError("--logprobs is reported in the --json output: add --json")

    from ninfer_offload.artifact.errors import ArtifactError
    from ninfer_offload.artifact.reader import not_an_artifact_file, open_artifact
    from ninfer_offload.frontend import Frontend
    from ninfer_offload.frontend.grammar import GrammarCompiler
    from ninfer_offload.runtime.engine import Engine
    from ninfer_offload.runtime.generate import generate as generation_of
    from ninfer_offload.serve.reasoning import prompt_leaves_thinking_open

    if greedy and temperature is not None:
        raise NinferError("--greedy and --temperature contradict each other (--greedy always takes the most likely token); give one")
    request = LoadRequest(**load)
    if not artifact.is_file():
        raise not_an_artifact_file(artifact)
    if prompt is not None:
        _check_utf8(prompt, "--prompt")
    template = _read_text(chat_template, "chat template") if chat_template is not None else None
    conversation = _read_messages(messages) if messages is not None else None
    ids = _parse_ids(prompt_ids) if prompt_ids is not None else None
    schema = _read_schema(json_schema) if json_schema is not None else None
    with open_artifact(artifact) as opened:
        if "text" not in opened.components:
            raise ArtifactError(f"{artifact.name} has no text component")
        text_config = opened.components["text"].config
        frontend = Frontend.from_artifact(opened, chat_template=template)
    thinking = False  # whether the prompt leaves the model's reasoning open (a constraint applies after it)
    if ids is None:
        if prompt is not None and raw:
            ids = frontend.encode(prompt)
        else:
            chat, tools = conversation or ([{"role": "user", "content": prompt}], None)
            rendered = frontend.render(chat, tools=tools, enable_thinking=not no_thinking)
            thinking = prompt_leaves_thinking_open(rendered)
            ids = frontend.encode(rendered)
    _check_prompt(ids, text_config, request.max_context, DEFAULT_MAX_CONTEXT)
    sampling = _sampling(
        frontend.generation_config,
        greedy,
        seed=seed,
        temperature=temperature,
        top_k=top_k,
        top_p=top_p,
        min_p=min_p,
        presence_penalty=presence_penalty,
        frequency_penalty=frequency_penalty,
        repetition_penalty=repetition_penalty,
    )
    constraint = None
    if schema is not None:
        constraint = GrammarCompiler.for_frontend(frontend, frontend.vocab_size).json(schema, thinking)
    engine = Engine.load(artifact, request, device=device, progress=not json_out)
    apply_bench_routing(engine)
    if engine.store.offloaded:
        typer.echo(engine.placement_report(), err=True)
    typer.echo(f"decoding with {engine.speculation.describe()}", err=True)
    warm_up_seconds = engine.warm_up(min(len(ids), engine.prefill_chunk)).seconds if engine.needs_warm_up else 0.0
    generation = generation_of(engine, ids, max_tokens, sampling, frontend.stop_ids, constraint, logprobs)

    if json_out:
        result = generation.run()
        payload = {
            "prompt_ids": ids,
            "ids": result.token_ids,
            "text": frontend.decode(result.token_ids),
            **{key: value for key, value in result.as_dict().items() if key != "token_ids"},
            "warm_up_seconds": warm_up_seconds,
        }
        if logprobs is not None:
            payload["logprobs"] = _logprob_entries(frontend, result.token_ids, generation.logprobs)
        if engine.store.offloaded:
            payload["experts"] = engine.store.stats.to_json()
        typer.echo(json.dumps(payload, ensure_ascii=False))
        return
    decoder = frontend.incremental_decoder()
    for token in generation:
        sys.stdout.write(decoder.feed(token))
        sys.stdout.flush()
    sys.stdout.write(decoder.flush() + "\n")
    sys.stdout.flush()
    warm_up = f"warm-up: {warm_up_seconds:.2f} s | " if engine.needs_warm_up else ""
    typer.echo(warm_up + _summary(generation.result), err=True)
    if engine.store.offloaded:
        typer.echo(_expert_summary(engine.store.stats.to_json()), err=True)
