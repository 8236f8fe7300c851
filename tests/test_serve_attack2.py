"""`ninfer serve` against the second round of hostile and careless input, on one real uvicorn server
over the tiny model (its outputs forced on demand by `ScriptedEngine`): every input a client or a
web page can send gets a clear answer, never a 500, a silently ignored field or a hung connection.
"""

from __future__ import annotations

import json
import logging
import signal
import socket
import subprocess
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest
from test_serve_api import MODEL, WEATHER_TOOL, LiveServer, ScriptedEngine, script
from test_serve_cli import SERVE
from test_serve_limits import assert_openai_error
from tokenizers import Tokenizer

from ninfer_offload.frontend import Frontend
from ninfer_offload.runtime.engine import Engine
from ninfer_offload.serve.app import create_app
from ninfer_offload.serve.protocol import DEFAULT_COMPLETION_TOKENS
from ninfer_offload.serve.tool_calls import parse_tool_calls

CHAT = "/v1/chat/completions"
COMPLETIONS = "/v1/completions"
ALLOWED_ORIGIN = "http://app.lan:3000"
BODY_TIMEOUT_S = 1.0
MAX_UPLOADS = 2
CONTEXT = 512
NO_THINKING = {"enable_thinking": False}
ASK = [{"role": "user", "content": "Weather as JSON, please."}]


class GatedEngine(ScriptedEngine):
    """The scripted engine, whose decode steps wait while `gate` is cleared."""

    def __init__(self, engine) -> None:
        super().__init__(engine)
        self.gate = threading.Event()
        self.gate.set()

    def step_batch(self, sessions, token_ids):
        self.gate.wait(30)
        return super().step_batch(sessions, token_ids)

    def step_on_device(self, sessions, tokens):
        self.gate.wait(30)
        return super().step_on_device(sessions, tokens)


@pytest.fixture(scope="module")
def server(tiny_artifact, frontend):
    """One slot, no queue: a request in flight makes the next one a 429."""
    engine = GatedEngine(Engine.load(tiny_artifact, device="cpu", max_sequences=2, spec="none"))
    app = create_app(
        engine, frontend, MODEL, CONTEXT, max_concurrency=1, max_queue=0,
        allowed_origins=[ALLOWED_ORIGIN], body_timeout=BODY_TIMEOUT_S, max_uploads=MAX_UPLOADS,
    )
    with LiveServer(app) as live:
        live.engine = engine
        yield live


def chat(**fields) -> dict:
    return {"model": MODEL, "messages": ASK, "max_tokens": 2, **fields}


def completion(**fields) -> dict:
    return {"model": MODEL, "prompt": "Once", "max_tokens": 2, "temperature": 0, **fields}


def long_integer(field: str, path: str) -> bytes:
    """A body whose `field` is an integer literal of 5,000 digits (past Python's int-string limit)."""
    body = chat() if path == CHAT else completion()
    body[field] = 0
    return json.dumps(body).replace(f'"{field}": 0', f'"{field}": {"1" * 5000}').encode()


# -- 1. integers too long to read ------------------------------------------------------------------


@pytest.mark.parametrize(("path", "field"), [(CHAT, "seed"), (COMPLETIONS, "max_tokens"), (COMPLETIONS, "seed")])
def test_an_integer_past_the_int_string_limit_is_invalid_json(server, path, field):
    assert_openai_error(server.post(path, long_integer(field, path)), 400, None, "invalid_json")


def test_a_prompt_id_past_the_int_string_limit_is_invalid_json(server):
    content = json.dumps(completion(prompt=[1, 2])).replace("[1, 2]", f"[1, {'9' * 5000}]").encode()
    error = assert_openai_error(server.post(COMPLETIONS, content), 400, None, "invalid_json")
    assert "digits" in error["message"]


# -- 2. tool schemas --------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("parameters", "named"),
    [
        ({"type": "object", "required": 5}, "required"),
        ({"type": "object", "required": "a"}, "required"),
        ({"type": "object", "properties": [1, 2]}, "properties"),
        ({"type": "object", "properties": "abc"}, "properties"),
        ({"type": "object", "properties": {"a": 5}}, "schema"),
    ],
)
def test_a_malformed_tool_schema_is_a_400_naming_the_tool_and_the_field(server, parameters, named):
    tools = [WEATHER_TOOL, {"type": "function", "function": {"name": "broken_tool", "parameters": parameters}}]
    error = assert_openai_error(server.post(CHAT, chat(tools=tools)), 400, "tools.1.function.parameters", "invalid_value")
    assert "broken_tool" in error["message"] and named in error["message"]


# -- 3. a tokenizer llguidance cannot read -----------------------------------------------------------


def test_without_a_grammar_tokenizer_structured_requests_are_400s_and_the_rest_is_served(tiny_artifact, frontend, caplog):
    data = json.loads(frontend.tokenizer.to_str())
    data["decoder"] = {"type": "WordPiece", "prefix": "##", "cleanup": True}
    tokenizer = Tokenizer.from_str(json.dumps(data))
    wordpiece = Frontend(tokenizer, frontend.tokenizer_config, frontend.generation_config, frontend.template.source)
    engine = Engine.load(tiny_artifact, device="cpu", max_sequences=1, spec="none")
    with caplog.at_level(logging.WARNING, logger="ninfer.serve"):
        app = create_app(engine, wordpiece, MODEL, 512, max_concurrency=1)
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1 and "structured output" in warnings[0] and "decoder" in warnings[0]
    with LiveServer(app) as live:
        for _ in range(2):
            response = live.post(CHAT, chat(response_format={"type": "json_object"}))
            error = assert_openai_error(response, 400, "response_format", "unsupported_value")
            assert "decoder" in error["message"]
        assert_openai_error(live.post(CHAT, chat(tools=[WEATHER_TOOL])), 400, "tools", "unsupported_value")
        assert live.post(CHAT, chat()).status_code == 200


# -- 4. template options the template reads as booleans ---------------------------------------------


@pytest.mark.parametrize("value", ["false", 0, None, []])
def test_enable_thinking_takes_booleans_only(server, value):
    response = server.post(CHAT, chat(chat_template_kwargs={"enable_thinking": value}))
    error = assert_openai_error(response, 422, "chat_template_kwargs", "invalid_value")
    assert "enable_thinking must be true or false" in error["message"]


# -- 5. logit_bias and parallel_tool_calls -----------------------------------------------------------


def test_logit_bias_forces_and_forbids_tokens_in_greedy_decoding(server, frontend):
    token = frontend.encode(" lighthouse")[0]
    forced = server.post(COMPLETIONS, completion(max_tokens=3, logit_bias={str(token): 100})).json()
    assert forced["choices"][0]["text"] == frontend.decode([token] * 3)
    reply = server.post(CHAT, chat(max_tokens=3, temperature=0, logit_bias={str(token): 100}, chat_template_kwargs=NO_THINKING)).json()
    assert reply["choices"][0]["message"]["content"] == frontend.decode([token] * 3)

    plain = server.post(COMPLETIONS, completion(max_tokens=1, logprobs=0)).json()["choices"][0]["logprobs"]["tokens"][0]
    first = frontend.encode(plain)[0]
    banned = server.post(COMPLETIONS, completion(max_tokens=1, logprobs=0, logit_bias={str(first): -100})).json()
    assert banned["choices"][0]["logprobs"]["tokens"][0] != plain
    sampled = server.post(COMPLETIONS, completion(max_tokens=3, temperature=1.0, seed=3, logit_bias={str(token): 100})).json()
    assert sampled["choices"][0]["text"] == frontend.decode([token] * 3)


@pytest.mark.parametrize("bias", [{"5": 101}, {"5": -100.5}, {"512": 1}, {"-1": 1}, {"x": 1}, {"5": "a"}])
def test_bad_logit_bias_is_refused(server, bias):
    response = server.post(COMPLETIONS, completion(logit_bias=bias))
    assert response.status_code == 422 and response.json()["error"]["param"].startswith("logit_bias"), response.text


def test_parallel_tool_calls_false_allows_one_call(server, frontend):
    call = "<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n</function>\n</tool_call>"
    messages = [{"role": "user", "content": "Weather in Paris and Rome?"}]
    for parallel, calls in ((True, 2), (False, 1)):
        server.engine.scripts.append(script(frontend, "</think>\n\n" + call + "\n" + call.replace("Paris", "Rome")))
        body = chat(messages=messages, tools=[WEATHER_TOOL], max_tokens=80, temperature=0, parallel_tool_calls=parallel)
        choice = server.post(CHAT, body).json()["choices"][0]
        assert choice["finish_reason"] == "tool_calls" and len(choice["message"]["tool_calls"]) == calls


# -- 6, 7. structured output: no end of turn while thinking, compact JSON ----------------------------


def test_a_json_reply_cannot_end_while_thinking(server, frontend):
    server.engine.scripts.append(script(frontend, "Let me think"))  # then the end of the turn, still thinking
    reply = server.post(CHAT, chat(max_tokens=12, temperature=0, response_format={"type": "json_object"})).json()
    choice = reply["choices"][0]
    if choice["finish_reason"] == "stop":
        assert isinstance(json.loads(choice["message"]["content"]), dict)
    else:
        assert choice["finish_reason"] == "length"


def test_json_replies_hold_no_free_whitespace(server, frontend):
    server.engine.scripts.append(frontend.encode("{" + "\n" * 12))
    reply = server.post(CHAT, chat(max_tokens=16, temperature=0, response_format={"type": "json_object"}, chat_template_kwargs=NO_THINKING))
    content = reply.json()["choices"][0]["message"]["content"]
    assert content.startswith("{") and "\n" not in content and not content.startswith("{ ")


# -- 8. what a web page may send ----------------------------------------------------------------------


def test_a_body_that_is_not_json_is_a_415(server):
    for content_type in ("text/plain", "application/x-www-form-urlencoded", "multipart/form-data; boundary=x"):
        response = server.post(COMPLETIONS, completion(), headers={"content-type": content_type})
        assert_openai_error(response, 415, None, "unsupported_media_type")
    response = httpx.post(f"{server.url}{COMPLETIONS}", content=json.dumps(completion()).encode())  # no content type at all
    assert_openai_error(response, 415, None, "unsupported_media_type")
    assert server.post(COMPLETIONS, completion(), headers={"content-type": "application/json; charset=utf-8"}).status_code == 200
    message = {"model": MODEL, "max_tokens": 2, "messages": [{"role": "user", "content": "Hi"}]}
    anthropic = server.post("/v1/messages", message, headers={"content-type": "text/plain"})  # every route under /v1/ is guarded
    assert anthropic.status_code == 415 and anthropic.json()["type"] == "error"


@pytest.mark.parametrize("origin", ["http://evil.example", "http://127.0.0.1:1", "https://localhost", "null", "http://app.lan:3001"])
def test_a_foreign_origin_is_a_403(server, origin):
    for content_type in ("text/plain", "application/json"):
        response = server.post(COMPLETIONS, completion(), headers={"origin": origin, "content-type": content_type})
        assert_openai_error(response, 403, None, "origin_not_allowed")
    assert httpx.get(f"{server.url}/health", headers={"origin": origin}).status_code == 200  # reads are not guarded


def test_own_loopback_and_allowed_origins_are_served(server):
    for origin in (server.url, f"http://localhost:{server.port}", f"http://[::1]:{server.port}", ALLOWED_ORIGIN, "HTTP://APP.LAN:3000/"):
        assert server.post(COMPLETIONS, completion(), headers={"origin": origin}).status_code == 200, origin


# -- 9, 10. slow, unfinished and abandoned uploads ------------------------------------------------------


def half_upload(port: int) -> socket.socket:
    body = json.dumps(completion()).encode()
    connection = socket.create_connection(("127.0.0.1", port), timeout=10)
    head = f"POST {COMPLETIONS} HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\nContent-Length: {len(body)}\r\n\r\n"
    connection.sendall(head.encode() + body[: len(body) // 2])
    return connection


def read_all(connection: socket.socket) -> bytes:
    return b"".join(iter(lambda: connection.recv(65536), b""))


def test_an_unfinished_body_is_a_408_and_uploads_are_bounded(server):
    started = time.monotonic()
    uploads = [half_upload(server.port) for _ in range(MAX_UPLOADS)]
    time.sleep(0.2)
    busy = server.post(COMPLETIONS, completion())
    assert_openai_error(busy, 503, None, "server_busy")
    assert busy.headers["retry-after"] == "1"
    for connection in uploads:
        with connection:
            reply = read_all(connection)  # the server closes the connection after its answer
        assert reply.startswith(b"HTTP/1.1 408") and b'"request_timeout"' in reply
    assert time.monotonic() - started < BODY_TIMEOUT_S + 5
    assert server.post(COMPLETIONS, completion()).status_code == 200


def test_a_client_gone_mid_upload_is_one_log_line(server, caplog):
    with caplog.at_level(logging.INFO, logger="ninfer.serve"):
        half_upload(server.port).close()
        deadline = time.monotonic() + 5
        while not [r for r in caplog.records if "disconnected" in r.getMessage()] and time.monotonic() < deadline:
            time.sleep(0.05)
    records = [r for r in caplog.records if r.name == "ninfer.serve"]
    assert len(records) == 1 and "disconnected before sending its whole body" in records[0].getMessage()
    assert records[0].exc_info is None


# -- 11. null means the default -------------------------------------------------------------------------


def test_null_max_tokens_on_completions_is_the_default(server, frontend):
    server.engine.scripts.append(frontend.encode(" a") * 100)
    response = server.post(COMPLETIONS, completion(max_tokens=None))
    assert response.json()["usage"]["completion_tokens"] == DEFAULT_COMPLETION_TOKENS


# -- 12. clear messages ------------------------------------------------------------------------------------


def test_seventeen_stop_strings_name_the_limit(server):
    error = assert_openai_error(server.post(CHAT, chat(stop=[f"s{i}" for i in range(17)])), 422, "stop", "invalid_value")
    assert error["message"] == "stop: at most 16 stop strings are allowed, got 17"


def test_an_unknown_tool_choice_says_what_is_accepted(server):
    error = assert_openai_error(server.post(CHAT, chat(tool_choice="sometimes")), 422, "tool_choice", "invalid_value")
    assert error["message"] == "tool_choice: tool_choice must be 'none', 'auto', 'required' or a named function, got 'sometimes'"


def test_a_text_part_without_text_says_so(server):
    messages = [{"role": "user", "content": [{"type": "text", "text": "Hi"}, {"type": "text"}]}]
    error = assert_openai_error(server.post(CHAT, chat(messages=messages)), 400, "messages.0.content.1.text", "invalid_value")
    assert "needs a 'text' string" in error["message"]


def test_a_schema_regex_error_is_reported_whole(server):
    schema = {"type": "object", "properties": {"code": {"type": "string", "pattern": "(["}}}
    response_format = {"type": "json_schema", "json_schema": {"name": "x", "schema": schema}}
    error = assert_openai_error(server.post(CHAT, chat(response_format=response_format)), 400, "response_format", "invalid_value")
    assert "unclosed character class" in error["message"] and "\n" not in error["message"]


@pytest.mark.parametrize("encoding", ["gzip", "deflate", "br"])
def test_a_compressed_body_is_a_415(server, encoding):
    response = server.post(COMPLETIONS, completion(), headers={"content-encoding": encoding})
    error = assert_openai_error(response, 415, None, "unsupported_media_type")
    assert encoding in error["message"]


# -- 13. small things ---------------------------------------------------------------------------------------


def test_head_health(server):
    response = httpx.head(f"{server.url}/health")
    assert response.status_code == 200 and response.content == b""


def test_a_full_queue_says_when_to_retry(server):
    server.engine.gate.clear()  # the one slot's request waits in its first decode step
    try:
        with ThreadPoolExecutor(1) as pool:
            holding = pool.submit(server.post, COMPLETIONS, completion(max_tokens=4))
            while server.health()["active"] == 0:
                time.sleep(0.01)
            refused = server.post(COMPLETIONS, completion())
            assert_openai_error(refused, 429, None, "queue_full")
            assert refused.headers["retry-after"] == "1"
            server.engine.gate.set()
            assert holding.result(timeout=30).status_code == 200
    finally:
        server.engine.gate.set()


def test_tool_call_values_too_deep_or_not_json_stay_strings_and_arguments_are_strict_json():
    deep = "[" * 1000 + "]" * 1000
    text = (
        "<tool_call>\n<function=f>\n<parameter=deep>\n" + deep + "\n</parameter>\n<parameter=nan>\nNaN\n</parameter>\n"
        "<parameter=inf>\n[1, -Infinity]\n</parameter>\n<parameter=n>\n2\n</parameter>\n</function>\n</tool_call>"
    )
    _, (call,) = parse_tool_calls(text, None)

    def refuse(constant: str):
        raise AssertionError(f"{constant} in arguments")

    arguments = json.loads(call["function"]["arguments"], parse_constant=refuse)
    assert arguments == {"deep": deep, "nan": "NaN", "inf": "[1, -Infinity]", "n": 2}


def test_sigterm_during_the_model_load_exits_cleanly(tiny_artifact):
    process = subprocess.Popen([*SERVE, str(tiny_artifact), "--port", "0"], stderr=subprocess.PIPE, stdout=subprocess.DEVNULL, text=True)
    watchdog = threading.Timer(60, process.kill)  # a server that never stops fails the test instead of hanging it
    watchdog.start()
    try:
        lines = []
        for line in process.stderr:
            lines.append(line)
            if "loading" in line:
                process.send_signal(signal.SIGTERM)
                break
        lines += process.stderr.readlines()
        assert process.wait() == 0, "".join(lines)
    finally:
        watchdog.cancel()
        if process.poll() is None:
            process.kill()
            process.wait()
    log = "".join(lines)
    assert "stopped by SIGTERM before serving" in log and "Traceback" not in log and "serving model" not in log
