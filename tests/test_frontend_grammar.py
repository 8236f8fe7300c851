"""Structured outputs: llguidance grammars over the tiny tokenizer constrain random logits to valid JSON."""

from __future__ import annotations

import json

import pytest
import torch

from ninfer_offload.convert.tiny_tokenizer import write_tokenizer_files
from ninfer_offload.errors import NinferError
from ninfer_offload.frontend import Frontend
from ninfer_offload.frontend.grammar import REASONING_END, GrammarCompiler

VOCAB = 520  # the model's logits may be wider than the tokenizer's vocabulary


@pytest.fixture(scope="module")
def frontend(tmp_path_factory) -> Frontend:
    directory = tmp_path_factory.mktemp("tokenizer")
    write_tokenizer_files(directory)
    return Frontend.from_directory(directory)


@pytest.fixture(scope="module")
def compiler(frontend) -> GrammarCompiler:
    return GrammarCompiler.for_frontend(frontend, VOCAB)


def generate(frontend, constraint, seed: int, limit: int = 400, prefix: list[int] = ()) -> tuple[list[int], bool]:
    """Sample from random logits under the constraint: (tokens, ended with a stop id). Closing tokens
    are favoured so that values end soon (a uniform walk over JSON can nest for a long time)."""
    generator = torch.Generator().manual_seed(seed)
    closing = torch.zeros(VOCAB)
    for token in range(frontend.vocab_size):
        text = frontend.decode([token])
        closing[token] = 6.0 if token in frontend.stop_ids else 3.0 if any(c in text for c in '}"]') else 0.0
    tokens = []
    for token in prefix:
        constraint.accept(token)
        tokens.append(token)
    for _ in range(limit):
        logits = torch.randn(VOCAB, generator=generator) + closing
        constraint.mask(logits)
        token = int(torch.multinomial(torch.softmax(logits, -1), 1, generator=generator))
        if token in frontend.stop_ids:
            return tokens, True
        constraint.accept(token)
        tokens.append(token)
    return tokens, False


@pytest.mark.parametrize("seed", range(5))
def test_random_logits_under_a_json_object_grammar_give_a_json_object(frontend, compiler, seed):
    tokens, stopped = generate(frontend, compiler.json(None, thinking=False), seed)
    assert stopped and isinstance(json.loads(frontend.decode(tokens)), dict)


@pytest.mark.parametrize("seed", range(5))
def test_a_json_schema_is_followed(frontend, compiler, seed):
    schema = {
        "type": "object",
        "properties": {"answer": {"type": "integer"}, "sure": {"type": "boolean"}, "tag": {"enum": ["yes", "no"]}},
        "required": ["answer", "sure", "tag"],
        "additionalProperties": False,
    }
    tokens, stopped = generate(frontend, compiler.json(schema, thinking=False), seed)
    value = json.loads(frontend.decode(tokens))
    assert stopped and set(value) == {"answer", "sure", "tag"}
    assert isinstance(value["answer"], int) and isinstance(value["sure"], bool) and value["tag"] in ("yes", "no")


def test_with_thinking_the_grammar_starts_after_the_reasoning(frontend, compiler):
    constraint = compiler.json(None, thinking=True)
    logits = torch.zeros(VOCAB)
    constraint.mask(logits)
    masked = set(torch.nonzero(~torch.isfinite(logits)).flatten().tolist())
    assert masked == set(frontend.stop_ids)  # reasoning is free, but cannot end the turn before the answer
    reasoning = frontend.encode("I think so") + [frontend.tokenizer.token_to_id(REASONING_END)]
    tokens, stopped = generate(frontend, constraint, seed=3, prefix=reasoning)
    answer = frontend.decode(tokens[len(reasoning):])
    assert stopped and isinstance(json.loads(answer), dict)


def test_a_finished_value_allows_only_the_stop_ids(frontend, compiler):
    constraint = compiler.json({"type": "integer"}, thinking=False)
    for token in frontend.encode("42"):
        constraint.accept(token)
    logits = torch.zeros(VOCAB)
    constraint.mask(logits)
    allowed = set(torch.nonzero(torch.isfinite(logits)).flatten().tolist())
    assert frontend.stop_ids <= allowed and all(frontend.decode([t]).isdigit() for t in allowed - frontend.stop_ids)
    assert not torch.isfinite(logits[frontend.vocab_size :]).any()


def test_an_invalid_schema_is_a_client_error(compiler):
    with pytest.raises(NinferError, match="invalid JSON schema"):
        compiler.json({"type": "objectx"}, thinking=False)


WEATHER = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "parameters": {
                "type": "object",
                "properties": {"city": {"type": "string"}, "days": {"type": "integer", "minimum": 1, "maximum": 9}},
                "required": ["city"],
            },
        },
    },
    {"type": "function", "function": {"name": "noop", "parameters": {"type": "object", "properties": {}}}},
]
CALL = "<tool_call>\n<function=get_weather>\n<parameter=city>\n{city}\n</parameter>\n{days}</function>\n</tool_call>\n"


def _feed(frontend, constraint, text: str) -> None:
    for token in frontend.encode(text):
        constraint.accept(token)


@pytest.mark.parametrize(
    "text",
    [
        "Let me look.\n" + CALL.format(city="Paris\nin France", days="<parameter=days>\n3\n</parameter>\n"),
        "<tool_call>\n<function=noop>\n</function>\n</tool_call>\n" + CALL.format(city="Rome", days=""),
        "<think>\nThe user wants the weather.\n</think>\n\n" + CALL.format(city="Oslo", days="").rstrip("\n"),
    ],
)
def test_well_formed_tool_calls_pass_the_tool_grammar(frontend, compiler, text):
    constraint = compiler.tool_calls(WEATHER)
    _feed(frontend, constraint, text)
    logits = torch.zeros(VOCAB)
    constraint.mask(logits)
    assert torch.isfinite(logits[sorted(frontend.stop_ids)]).all()  # the reply may end here


@pytest.mark.parametrize(
    "text",
    [
        "<tool_call>\n<function=get_weather>\n<parameter=days>\n3",  # the required city is missing
        CALL.format(city="Oslo", days="<parameter=days>\n12\n</parameter>\n"),  # days above its maximum
        "<tool_call>\n<function=get_time>\n",  # no such tool
        CALL.format(city="Oslo", days="") + "trailing text",  # only further calls may follow a call
    ],
)
def test_malformed_tool_calls_are_refused(frontend, compiler, text):
    with pytest.raises(NinferError, match="breaks the response grammar"):
        _feed(frontend, compiler.tool_calls(WEATHER), text)


def test_free_text_without_tool_calls_is_unconstrained(frontend, compiler):
    constraint = compiler.tool_calls(WEATHER)
    _feed(frontend, constraint, "I think the answer is yes, because")
    logits = torch.zeros(VOCAB)
    constraint.mask(logits)
    texts = {token: frontend.decode([token]) for token in range(frontend.vocab_size)}
    plain = [token for token, text in texts.items() if text.isascii() and text.isprintable() and "<" not in text]
    assert len(plain) > 200 and torch.isfinite(logits[plain]).all()  # any plain text may follow
