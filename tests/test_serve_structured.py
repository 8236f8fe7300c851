"""Structured outputs and log-probabilities through a real server: `response_format` constrains the
tiny random model's sampled replies to valid JSON (matching the schema), streamed or not, bad schemas
are 400s; `logprobs` report the model's own log-probabilities."""

from __future__ import annotations

import json

import pytest
import torch

from ninfer_offload.runtime.engine import Engine
from ninfer_offload.serve.app import create_app
from test_serve_api import MODEL, LiveServer

SCHEMA = {
    "type": "object",
    "properties": {
        "city": {"enum": ["Paris", "Rome", "Oslo"]},
        "sunny": {"type": "boolean"},
        "days": {"type": "integer", "minimum": 1, "maximum": 9},
    },
    "required": ["city", "sunny", "days"],
    "additionalProperties": False,
}
NO_THINKING = {"chat_template_kwargs": {"enable_thinking": False}}
ASK = [{"role": "user", "content": "Weather as JSON, please."}]


@pytest.fixture(scope="module")
def server(tiny_artifact, frontend):
    engine = Engine.load(tiny_artifact, device="cpu", max_sequences=4)
    with LiveServer(create_app(engine, frontend, MODEL, 512, max_concurrency=4, max_queue=8)) as live:
        yield live


def _check(text: str) -> None:
    value = json.loads(text)
    assert set(value) == {"city", "sunny", "days"} and value["city"] in SCHEMA["properties"]["city"]["enum"]
    assert isinstance(value["sunny"], bool) and 1 <= value["days"] <= 9


@pytest.mark.parametrize("seed", [1, 2, 3])
def test_json_schema_replies_follow_the_schema(server, seed):
    response_format = {"type": "json_schema", "json_schema": {"name": "weather", "schema": SCHEMA}}
    kwargs = dict(
        model=MODEL, messages=ASK, max_tokens=80, temperature=1.0, seed=seed, response_format=response_format, extra_body=NO_THINKING
    )
    reply = server.client().chat.completions.create(**kwargs)
    assert reply.choices[0].finish_reason == "stop"
    _check(reply.choices[0].message.content)
    chunks = list(server.client().chat.completions.create(**kwargs, stream=True))
    streamed = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert streamed == reply.choices[0].message.content  # same seed, same constrained draws


def test_json_object_replies_are_json_objects(server):
    reply = server.client().chat.completions.create(
        model=MODEL, messages=ASK, max_tokens=120, temperature=0, response_format={"type": "json_object"}, extra_body=NO_THINKING
    )
    text, finish = reply.choices[0].message.content, reply.choices[0].finish_reason
    assert text.startswith("{")
    if finish == "stop":  # a greedy random model may also fill the budget inside a string
        assert isinstance(json.loads(text), dict)


@pytest.mark.parametrize(
    "response_format",
    [{"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "objectx"}}}, {"type": "json_schema"}, {"type": "yaml"}],
)
def test_bad_response_formats_are_400s(server, response_format):
    body = {"model": MODEL, "messages": ASK, "max_tokens": 4, "response_format": response_format}
    response = server.post("/v1/chat/completions", body)
    assert response.status_code in (400, 422), response.text
    error = response.json()["error"]
    assert error["param"].startswith("response_format") and error["code"]


def test_chat_logprobs_are_the_models_and_stream_alike(server, tiny_artifact, frontend):
    kwargs = dict(model=MODEL, messages=ASK, max_tokens=6, temperature=0, logprobs=True, top_logprobs=3, extra_body=NO_THINKING)
    reply = server.client().chat.completions.create(**kwargs)
    entries = reply.choices[0].logprobs.content
    assert len(entries) == reply.usage.completion_tokens - (reply.choices[0].finish_reason == "stop")
    engine = Engine.load(tiny_artifact, device="cpu")
    session = engine.session()
    logits = session.prefill(frontend.encode(frontend.render(ASK, enable_thinking=False)))
    for entry in entries:
        expected = torch.log_softmax(logits.float(), -1)
        token = int(torch.argmax(expected))  # greedy
        assert entry.token == frontend.decode([token]) and abs(entry.logprob - float(expected[token])) < 1e-4
        assert [alt.logprob for alt in entry.top_logprobs] == sorted((alt.logprob for alt in entry.top_logprobs), reverse=True)
        assert len(entry.top_logprobs) == 3 and entry.top_logprobs[0].token == entry.token
        logits = session.step(token)
    chunks = list(server.client().chat.completions.create(**kwargs, stream=True))
    streamed = [e for c in chunks if c.choices and c.choices[0].logprobs for e in c.choices[0].logprobs.content]
    assert [(e.token, round(e.logprob, 5)) for e in streamed] == [(e.token, round(e.logprob, 5)) for e in entries]


def test_completion_logprobs_legacy_shape(server):
    body = {"model": MODEL, "prompt": "The weather", "max_tokens": 5, "temperature": 0, "logprobs": 2}
    choice = server.post("/v1/completions", body).json()["choices"][0]
    logprobs = choice["logprobs"]
    assert len(logprobs["tokens"]) == len(logprobs["token_logprobs"]) == len(logprobs["top_logprobs"]) == len(logprobs["text_offset"])
    assert all(len(top) <= 2 for top in logprobs["top_logprobs"]) and all(lp <= 0 for lp in logprobs["token_logprobs"])
    assert logprobs["text_offset"] == [sum(len(t) for t in logprobs["tokens"][:i]) for i in range(len(logprobs["tokens"]))]
    bad = server.post("/v1/completions", {**body, "logprobs": 9})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "logprobs"
    orphan = server.post("/v1/chat/completions", {"model": MODEL, "messages": ASK, "top_logprobs": 2})
    assert orphan.status_code == 400 and orphan.json()["error"]["param"] == "top_logprobs"
