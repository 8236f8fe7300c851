"""`ninfer serve` at its limits, on real uvicorn servers over the tiny model: input the server must
refuse as OpenAI JSON errors naming the field (never a text/plain 500 or a reset connection),
sampling values the sampler cannot use, failures anywhere, the queue bound, and large requests
that must neither block the event loop nor be tokenized when they cannot fit.
"""

from __future__ import annotations

import json
import logging
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import psutil
import pytest
from test_serve_api import MODEL, USER, LiveServer

from ninfer_offload.runtime.engine import Engine
from ninfer_offload.serve.app import create_app

CONTEXT = 512
CHAT = "/v1/chat/completions"
COMPLETIONS = "/v1/completions"


@pytest.fixture(scope="module")
def engine(tiny_artifact):
    """Plain decoding: the wrappers below act on its one-token steps."""
    return Engine.load(tiny_artifact, device="cpu", max_sequences=8, spec="none")


class FailingEngine:
    """The real engine, whose decode steps (on host or device tokens) raise once `fail` is set."""

    def __init__(self, engine) -> None:
        self.engine = engine
        self.fail = False

    def __getattr__(self, name: str):
        return getattr(self.engine, name)  # everything else is the real engine's

    def session(self):
        return self.engine.session()

    def step_batch(self, sessions, token_ids):
        if self.fail:
            raise RuntimeError("injected decode failure")
        return self.engine.step_batch(sessions, token_ids)

    def step_on_device(self, sessions, tokens):
        if self.fail:
            raise RuntimeError("injected decode failure")
        return self.engine.step_on_device(sessions, tokens)


@pytest.fixture(scope="module")
def server(engine, frontend):
    failing = FailingEngine(engine)
    app = create_app(failing, frontend, MODEL, CONTEXT, max_concurrency=4, max_queue=4)

    @app.get("/test/unexpected")
    async def unexpected() -> dict:
        raise KeyError("a bug")

    with LiveServer(app) as live:
        live.engine = failing
        yield live


def body(**fields) -> dict:
    return {"model": MODEL, "messages": USER, "max_tokens": 2, **fields}


def nested(depth: int) -> str:
    return "[" * depth + "]" * depth


def raw(text: str) -> bytes:
    return text.encode()


def assert_openai_error(response: httpx.Response, status: int, param: str | None, code: str) -> dict:
    assert response.status_code == status, response.text
    assert response.headers["content-type"] == "application/json"
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["message"]
    assert (error["param"], error["code"]) == (param, code)
    return error


def local_port(response: httpx.Response) -> int:
    """The client-side port of the connection that carried `response`."""
    return response.extensions["network_stream"].get_extra_info("client_addr")[1]


# -- input that used to escape as a text/plain 500 -------------------------------------------------

DEEP = nested(600)
TOOL_CALL = {"id": "call_1", "type": "function", "function": {"name": "f", "arguments": "{\"a\": " + DEEP + "}"}}


@pytest.mark.parametrize(
    ("path", "content", "param", "code"),
    [
        (CHAT, json.dumps(body(chat_template_kwargs={"self": 1})), "chat_template_kwargs", "invalid_value"),
        (CHAT, json.dumps(body(chat_template_kwargs={"documents": []})), "chat_template_kwargs", "invalid_value"),
        (CHAT, json.dumps(body())[:-1] + ', "chat_template_kwargs": {"a": ' + DEEP + "}}", "chat_template_kwargs", "nesting_too_deep"),
        (
            CHAT,
            json.dumps(body())[:-1] + ', "tools": [{"type": "function", "function": {"name": "f", "parameters": {"a": ' + DEEP + "}}}]}",
            "tools.0.function.parameters",
            "nesting_too_deep",
        ),
        (
            CHAT,
            json.dumps(body(messages=[*USER, {"role": "assistant", "content": None, "tool_calls": [TOOL_CALL]}])),
            "messages.1.tool_calls.0.function.arguments",
            "nesting_too_deep",
        ),
        (CHAT, json.dumps(body())[:-1] + ', "user": ' + nested(100_000) + "}", None, "invalid_json"),
        (CHAT, '{"model": "tiny", "messages": [{"role": "user", "content": "hi \\ud800"}]}', "messages.0.content", "invalid_unicode"),
        (
            CHAT,
            '{"model": "tiny", "messages": [{"role": "user", "content": [{"type": "text", "text": "\\udfff"}]}]}',
            "messages.0.content.0.text",
            "invalid_unicode",
        ),
        (COMPLETIONS, '{"model": "tiny", "prompt": "hi \\ud800 there"}', "prompt", "invalid_unicode"),
        (COMPLETIONS, '{"model": "tiny\\ud800", "prompt": "hi"}', "model", "invalid_unicode"),
        (COMPLETIONS, b'{"model": "tiny", "prompt": "hi \xed\xa0\x80"}', None, "invalid_json"),  # a surrogate as UTF-8 bytes
    ],
)
def test_hostile_input_is_a_400_naming_the_field_and_keeps_the_connection(server, path, content, param, code):
    with httpx.Client(base_url=server.url, timeout=60) as client:
        content = content if isinstance(content, bytes) else raw(content)
        response = client.post(path, content=content, headers={"content-type": "application/json"})
        assert_openai_error(response, 400, param, code)
        after = client.get("/health")
        assert after.status_code == 200 and local_port(after) == local_port(response)  # the keep-alive connection survived


def test_surrogate_pairs_are_text(server):
    content = '{"model": "tiny", "prompt": "a smile \\ud83d\\ude00", "max_tokens": 2}'
    assert server.post(COMPLETIONS, raw(content)).status_code == 200


def test_template_options_still_reach_the_template(server):
    assert server.post(CHAT, body(chat_template_kwargs={"enable_thinking": False, "custom": {"a": [1, 2]}})).status_code == 200


# -- sampling values: the sampler's own rules, at the edge -----------------------------------------


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("temperature", "1e-40"),
        ("temperature", "NaN"),
        ("temperature", "-1"),
        ("temperature", "1e400"),  # Python's json reads it as infinity
        ("repetition_penalty", "1e-308"),
        ("repetition_penalty", "Infinity"),
        ("repetition_penalty", "0"),
        ("presence_penalty", "-Infinity"),
        ("frequency_penalty", "NaN"),
        ("frequency_penalty", "2.5"),
        ("top_p", "NaN"),
        ("top_p", "0"),
        ("min_p", "NaN"),
        ("seed", str(2**70)),
    ],
)
@pytest.mark.parametrize("path", [CHAT, COMPLETIONS])
@pytest.mark.parametrize("stream", [False, True])
def test_sampling_values_the_sampler_cannot_use_are_refused(server, path, stream, field, value):
    request = body(stream=stream) if path == CHAT else {"model": MODEL, "prompt": "Hi", "max_tokens": 2, "stream": stream}
    content = json.dumps(request)[:-1] + f', "{field}": {value}}}'
    error = assert_openai_error(server.post(path, raw(content)), 422, field, "invalid_value")
    assert field in error["message"]


def test_sampling_values_at_the_limits_generate(server):
    limits = {"temperature": 1e-5, "repetition_penalty": 100.0, "presence_penalty": 2.0, "frequency_penalty": -2.0, "top_p": 1e-9}
    for fields in (limits, {**limits, "repetition_penalty": 0.01, "temperature": 50.0}):
        response = server.post(COMPLETIONS, {"model": MODEL, "prompt": "The harbour", "max_tokens": 8, **fields, "stream": True})
        events = [line for line in response.text.splitlines() if line]
        assert response.status_code == 200 and events[-1] == "data: [DONE]"
        assert all("error" not in json.loads(e.removeprefix("data: ")) for e in events[:-1])


# -- parse errors: a code on every error, missing fields by name ------------------------------------

TOO_MANY_STOPS = json.dumps({"model": MODEL, "prompt": "x", "stop": list("abcdefghijklmnopq")}).encode()


@pytest.mark.parametrize(
    ("path", "content", "status", "param", "code", "message"),
    [
        (CHAT, b"", 422, "messages", "missing_required_parameter", "Missing required parameters: 'messages', 'model'."),
        (CHAT, b"{}", 422, "messages", "missing_required_parameter", "Missing required parameters: 'messages', 'model'."),
        (CHAT, b'{"model": "tiny"}', 422, "messages", "missing_required_parameter", "Missing required parameter: 'messages'."),
        (CHAT, b'{"messages": [{"role": "user", "content": "x"}]}', 422, "model", "missing_required_parameter", None),
        (COMPLETIONS, b"  ", 422, "prompt", "missing_required_parameter", "Missing required parameters: 'prompt', 'model'."),
        (COMPLETIONS, b'{"prompt": "x"}', 422, "model", "missing_required_parameter", "Missing required parameter: 'model'."),
        (COMPLETIONS, b"[1, 2]", 400, None, "invalid_json", None),
        (COMPLETIONS, b'{"model": "tiny", "prompt": ', 400, None, "invalid_json", None),
        (COMPLETIONS, b'{"model": "tiny", "prompt": "\xff"}', 400, None, "invalid_json", None),
        (COMPLETIONS, TOO_MANY_STOPS, 422, "stop", "invalid_value", None),
    ],
)
def test_parse_errors_carry_a_code_and_name_the_missing_field(server, path, content, status, param, code, message):
    error = assert_openai_error(server.post(path, content), status, param, code)
    assert message is None or error["message"] == message


def test_http_errors_carry_a_code(server):
    assert httpx.get(f"{server.url}/v1/engines").json()["error"]["code"] == "not_found"
    assert httpx.get(f"{server.url}{CHAT}").json()["error"]["code"] == "method_not_allowed"


# -- failures: never text/plain ---------------------------------------------------------------------


def test_an_unexpected_exception_is_a_500_json_with_a_request_id(server, caplog):
    caplog.set_level(logging.ERROR, logger="ninfer.serve")
    with httpx.Client(base_url=server.url, timeout=60) as client:
        response = client.get("/test/unexpected")
        error = assert_openai_error(response, 500, None, "internal_error")
        request_id = response.headers["x-request-id"]
        assert request_id in error["message"] and error["type"] == "server_error"
        after = client.get("/health")
        assert after.status_code == 200 and local_port(after) == local_port(response)
    logged = [r for r in caplog.records if request_id in r.getMessage()]
    assert logged and logged[0].exc_info and "a bug" in str(logged[0].exc_info[1])


def test_an_engine_failure_ends_a_stream_with_an_error_chunk_and_a_request_with_json(server):
    server.engine.fail = True
    try:
        plain = server.post(COMPLETIONS, {"model": MODEL, "prompt": "Once", "max_tokens": 8, "temperature": 0})
        assert_openai_error(plain, 500, None, "engine_error")
        completion = {"model": MODEL, "prompt": "Once", "max_tokens": 8, "stream": True}
        streams = ((CHAT, body(max_tokens=8, stream=True)), (COMPLETIONS, completion))
        for path, request in streams:
            response = server.post(path, request)
            events = [line.removeprefix("data: ") for line in response.text.splitlines() if line]
            assert response.status_code == 200 and events[-1] == "[DONE]"
            last = json.loads(events[-2])
            assert last["choices"][0]["finish_reason"] == "error"
            assert last["error"]["code"] == "engine_error" and "injected decode failure" in last["error"]["message"]
    finally:
        server.engine.fail = False
    assert server.wait_idle() < 10


# -- the queue bound --------------------------------------------------------------------------------


class GatedEngine:
    """The real engine, whose sessions open only once `gate` is set (as a slow start would): the
    first request then sits between the queue and the decoding batch."""

    def __init__(self, engine) -> None:
        self.engine = engine
        self.gate = threading.Event()
        self.opening = threading.Event()

    def __getattr__(self, name: str):
        return getattr(self.engine, name)  # everything else is the real engine's

    def session(self):
        self.opening.set()
        assert self.gate.wait(30)
        return self.engine.session()

    def step_batch(self, sessions, token_ids):
        return self.engine.step_batch(sessions, token_ids)


def test_queue_admits_exactly_concurrency_plus_queue(engine, frontend):
    gated = GatedEngine(engine)
    request = {"model": MODEL, "prompt": "Once", "max_tokens": 2, "temperature": 0}
    with LiveServer(create_app(gated, frontend, MODEL, CONTEXT, max_concurrency=1, max_queue=2)) as live, ThreadPoolExecutor(8) as pool:
        first = pool.submit(live.post, COMPLETIONS, request)
        assert gated.opening.wait(30)  # the engine thread took it off the queue and is opening its session
        start = threading.Barrier(7)

        def ask() -> int:
            start.wait()
            return live.post(COMPLETIONS, request).status_code

        others = [pool.submit(ask) for _ in range(7)]
        deadline = time.monotonic() + 30
        while sum(f.done() for f in others) + live.health()["waiting"] < 7:  # each refused, or queued
            assert time.monotonic() < deadline
            time.sleep(0.02)
        gated.gate.set()
        statuses = sorted([first.result().status_code] + [f.result() for f in others])
    assert statuses == [200] * 3 + [429] * 5


# -- large requests ---------------------------------------------------------------------------------


def test_a_maximal_request_does_not_block_the_event_loop(engine, frontend):
    # A context far beyond the prompt's tokens, so that a large prompt passes the size check and is
    # tokenized (about a second) before its token count refuses it.
    app = create_app(engine, frontend, MODEL, 2**17)
    text = "lighthouse keeper " * 80_000  # 1.44 MB: under 2**17 tokens x the longest token, far over 2**17 tokens
    content = json.dumps(body(messages=[{"role": "user", "content": text}])).encode()
    with LiveServer(app) as live, ThreadPoolExecutor(1) as pool, httpx.Client(base_url=live.url, timeout=10) as client:
        assert client.get("/health").status_code == 200
        started = time.perf_counter()
        big = pool.submit(live.post, CHAT, content)
        latencies = []
        while not big.done():
            before = time.perf_counter()
            assert client.get("/health").status_code == 200
            latencies.append(time.perf_counter() - before)
            time.sleep(0.01)
        elapsed = time.perf_counter() - started
        assert_openai_error(big.result(), 400, "messages", "context_length_exceeded")
    assert len(latencies) >= 5 and elapsed > 5 * max(latencies), (elapsed, latencies)
    assert max(latencies) < 0.1, latencies


def test_a_prompt_that_cannot_fit_is_refused_before_tokenizing(server):
    process = psutil.Process()
    rss = process.memory_info().rss
    content = "the lighthouse keeper counts ships " * 450_000  # 15.75 MB, under the 16 MiB body limit
    started = time.perf_counter()
    requests = ((CHAT, body(messages=[{"role": "user", "content": content}])), (COMPLETIONS, {"model": MODEL, "prompt": content}))
    for path, request in requests:
        response = server.post(path, request)
        error = assert_openai_error(response, 400, "messages" if path == CHAT else "prompt", "context_length_exceeded")
        assert "characters" in error["message"]
    refusing = time.perf_counter() - started
    assert refusing < 5, refusing  # tokenizing it took ~18 s on the development machine
    assert process.memory_info().rss - rss < 256 * 2**20
    ids = server.post(COMPLETIONS, {"model": MODEL, "prompt": [5] * (CONTEXT + 1)})
    assert_openai_error(ids, 400, "prompt", "context_length_exceeded")
    many = server.post(CHAT, body(messages=USER * (CONTEXT + 1)))
    assert_openai_error(many, 400, "messages", "context_length_exceeded")

