"""`ninfer serve` end to end on CPU: real uvicorn servers on free loopback ports, driven by the
official `openai` client and raw httpx, checked against the Engine's own greedy generation.

Three servers over the tiny converted model:
- `server`: the plain engine, 8 concurrent sequences (greedy equality, batching, malformed input);
- `scripted`: the engine with its next tokens forced by a large logit bias (`ScriptedEngine`), one
  slot and a one-request queue, to produce reasoning and tool calls on demand, a long stream to
  disconnect from, and a full queue;
- `guarded`: an API key and a 2 KiB body limit.
"""

from __future__ import annotations

import gc
import json
import logging
import socket
import threading
import time
from collections import deque
from concurrent.futures import ThreadPoolExecutor

import httpx
import openai
import psutil
import pytest
import torch
import uvicorn

from ninfer_offload.runtime.engine import Engine
from ninfer_offload.runtime.generate import generate
from ninfer_offload.runtime.sampling import SamplingParams
from ninfer_offload.serve.app import create_app
from ninfer_offload.serve.reasoning import split_reasoning
from ninfer_offload.serve.server import graceful_server

MODEL = "tiny"
CONTEXT = 512
WEATHER_TOOL = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Current weather of a city",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"}}, "required": ["city"]},
    },
}


class LiveServer:
    """A uvicorn server for `app` in a background thread on a free 127.0.0.1 port; with
    `shutdown_timeout`, the server `ninfer serve` runs (its requests ended at that deadline)."""

    def __init__(self, app, shutdown_timeout: float | None = None) -> None:
        with socket.socket() as probe:
            probe.bind(("127.0.0.1", 0))
            self.port = probe.getsockname()[1]
        self.app = app
        if shutdown_timeout is None:
            self.server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=self.port, log_level="warning"))
        else:
            self.server = graceful_server(app, "127.0.0.1", self.port, "warning", shutdown_timeout)
        self.thread = threading.Thread(target=self.server.run, daemon=True)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def __enter__(self) -> LiveServer:
        self.thread.start()
        deadline = time.monotonic() + 30
        while not self.server.started:
            assert time.monotonic() < deadline and self.thread.is_alive(), "server did not start"
            time.sleep(0.02)
        return self

    def __exit__(self, *exc) -> None:
        self.server.should_exit = True
        self.thread.join(30)

    def client(self, api_key: str = "unused") -> openai.OpenAI:
        return openai.OpenAI(base_url=f"{self.url}/v1", api_key=api_key, max_retries=0, timeout=60)

    def health(self) -> dict:
        return httpx.get(f"{self.url}/health").json()

    def post(self, path: str, body, **kwargs) -> httpx.Response:
        content = body if isinstance(body, bytes) else json.dumps(body).encode()
        headers = {"content-type": "application/json", **kwargs.pop("headers", {})}
        return httpx.post(f"{self.url}{path}", content=content, headers=headers, timeout=kwargs.pop("timeout", 60), **kwargs)

    def wait_idle(self, timeout: float = 10.0) -> float:
        """Seconds until no sequence is active or waiting."""
        start = time.monotonic()
        while (stats := self.health())["active"] or stats["waiting"]:
            assert time.monotonic() - start < timeout, f"server still busy: {stats}"
            time.sleep(0.02)
        return time.monotonic() - start


class ScriptedSession:
    """A real engine session whose next outputs follow `script` (a large bias on each scripted id)."""

    def __init__(self, inner, script: list[int]) -> None:
        self.inner = inner
        self.script = deque(script)

    def force(self, logits: torch.Tensor) -> torch.Tensor:
        if not self.script:
            return logits
        logits = logits.clone()
        logits[self.script.popleft()] += 1e4
        return logits

    @property
    def length(self) -> int:
        return self.inner.length

    def prefill(self, token_ids):
        return self.force(self.inner.prefill(token_ids))

    def close(self) -> None:
        self.inner.close()


class ScriptedEngine:
    """The real engine; each new session takes the next queued script (none: unchanged outputs)."""

    def __init__(self, engine) -> None:
        self.engine = engine
        self.scripts: deque[list[int]] = deque()

    def __getattr__(self, name: str):
        return getattr(self.engine, name)  # everything else is the real engine's

    def session(self) -> ScriptedSession:
        return ScriptedSession(self.engine.session(), self.scripts.popleft() if self.scripts else [])

    def step_batch(self, sessions, token_ids):
        logits = self.engine.step_batch([s.inner for s in sessions], token_ids)
        return torch.stack([s.force(row) for s, row in zip(sessions, logits)])

    def step_on_device(self, sessions, tokens):
        logits = self.engine.step_on_device([s.inner for s in sessions], tokens)
        return torch.stack([s.force(row) for s, row in zip(sessions, logits)])


@pytest.fixture(scope="module")
def oracle(tiny_artifact, frontend):
    """Greedy generation by a separate Engine, one sequence at a time: (token ids, completion tokens)."""
    engine = Engine.load(tiny_artifact, device="cpu", max_sequences=8, spec="none")

    def run(prompt_ids: list[int], max_tokens: int) -> tuple[list[int], int]:
        generation = generate(engine, prompt_ids, max_tokens, SamplingParams(greedy=True), frontend.stop_ids)
        ids = list(generation)
        return ids, len(ids) + (generation.result.stop_id is not None)

    return run


@pytest.fixture(scope="module")
def server(tiny_artifact, frontend):
    engine = Engine.load(tiny_artifact, device="cpu", max_sequences=8, spec="none")
    with LiveServer(create_app(engine, frontend, MODEL, CONTEXT, max_concurrency=8, max_queue=16)) as live:
        yield live


@pytest.fixture(scope="module")
def speculating(tiny_artifact, frontend):
    """3 MTP drafts per step."""
    engine = Engine.load(tiny_artifact, device="cpu", max_sequences=4, spec="mtp")
    with LiveServer(create_app(engine, frontend, MODEL, CONTEXT, max_concurrency=4, max_queue=4)) as live:
        yield live


@pytest.fixture(scope="module")
def scripted(tiny_artifact, frontend):
    engine = ScriptedEngine(Engine.load(tiny_artifact, device="cpu", max_sequences=8, spec="none"))
    with LiveServer(create_app(engine, frontend, MODEL, 4096, max_concurrency=1, max_queue=1)) as live:
        live.engine = engine
        yield live


@pytest.fixture(scope="module")
def guarded(tiny_artifact, frontend):
    engine = Engine.load(tiny_artifact, device="cpu", max_sequences=8, spec="none")
    with LiveServer(create_app(engine, frontend, MODEL, CONTEXT, api_key="sekret", max_body_bytes=2048)) as live:
        yield live


def chat_prompt(frontend, messages, **kwargs) -> list[int]:
    return frontend.encode(frontend.render(messages, **kwargs))


def script(frontend, text: str, stop: bool = True) -> list[int]:
    """Token ids the scripted engine will emit: `text`, then the end-of-turn id."""
    return frontend.encode(text) + ([frontend.encode("<|im_end|>")[0]] if stop else [])


USER = [{"role": "user", "content": "Tell me about the lighthouse keeper."}]


# -- models, chat, completions against the engine's greedy output ----------------------------------


def test_models(server):
    models = server.client().models.list()
    assert [m.id for m in models.data] == [MODEL]
    assert httpx.get(f"{server.url}/v1/models/{MODEL}").json()["id"] == MODEL
    missing = httpx.get(f"{server.url}/v1/models/other")
    assert missing.status_code == 404 and missing.json()["error"]["code"] == "model_not_found"


def test_speculative_server_gives_the_greedy_text_and_counts_drafts(speculating, frontend, oracle):
    ids, completion_tokens = oracle(chat_prompt(frontend, USER, enable_thinking=False), 12)
    kwargs = dict(model=MODEL, messages=USER, max_tokens=12, temperature=0, extra_body={"chat_template_kwargs": {"enable_thinking": False}})
    response = speculating.client().chat.completions.create(**kwargs)
    assert response.choices[0].message.content == frontend.decode(ids, skip_special_tokens=True)
    usage = response.usage.model_dump()
    assert usage["completion_tokens"] == completion_tokens
    assert usage["speculation"]["rounds"] > 0 and usage["speculation"]["drafted"] >= usage["speculation"]["accepted"]


def test_chat_equals_engine_greedy(server, frontend, oracle):
    ids, completion_tokens = oracle(chat_prompt(frontend, USER, enable_thinking=False), 12)
    expected = frontend.decode(ids, skip_special_tokens=True)
    kwargs = dict(model=MODEL, messages=USER, max_tokens=12, temperature=0, extra_body={"chat_template_kwargs": {"enable_thinking": False}})
    response = server.client().chat.completions.create(**kwargs)
    choice = response.choices[0]
    assert (choice.message.content or "") == expected
    assert getattr(choice.message, "reasoning_content", None) is None
    assert choice.finish_reason == ("length" if completion_tokens == 12 and len(ids) == 12 else "stop")
    prompt_tokens = len(chat_prompt(frontend, USER, enable_thinking=False))
    assert (response.usage.prompt_tokens, response.usage.completion_tokens) == (prompt_tokens, completion_tokens)

    chunks = list(server.client().chat.completions.create(**kwargs, stream=True, stream_options={"include_usage": True}))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == expected
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == choice.finish_reason
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == completion_tokens
    assert all(c.usage is None for c in chunks[:-1])


def test_thinking_on_splits_reasoning(server, frontend, oracle):
    ids, _ = oracle(chat_prompt(frontend, USER), 12)
    text = frontend.decode(ids, skip_special_tokens=True)
    response = server.client().chat.completions.create(model=MODEL, messages=USER, max_tokens=12, temperature=0)
    reasoning, content = split_reasoning(text)
    assert getattr(response.choices[0].message, "reasoning_content", None) == reasoning
    assert response.choices[0].message.content == content


def test_completions_text_and_token_prompt(server, frontend, oracle):
    prompt = "Once upon a time there was"
    ids, completion_tokens = oracle(frontend.encode(prompt), 10)
    expected = frontend.decode(ids, skip_special_tokens=True)
    client = server.client()
    response = client.completions.create(model=MODEL, prompt=prompt, max_tokens=10, temperature=0)
    assert response.choices[0].text == expected
    assert response.usage.completion_tokens == completion_tokens
    by_ids = client.completions.create(model=MODEL, prompt=frontend.encode(prompt), max_tokens=10, temperature=0)
    assert by_ids.choices[0].text == expected
    streamed = list(client.completions.create(model=MODEL, prompt=prompt, max_tokens=10, temperature=0, stream=True))
    assert "".join(c.choices[0].text for c in streamed) == expected
    assert streamed[-1].choices[0].finish_reason == response.choices[0].finish_reason


def test_stop_string_cuts_the_output(server, frontend, oracle):
    prompt = "Once upon a time there was"
    ids, _ = oracle(frontend.encode(prompt), 10)
    full = frontend.decode(ids, skip_special_tokens=True)
    stop = full[3:5] if len(full) >= 5 else None
    if stop is None or not stop.strip():
        pytest.skip("greedy output too short to cut")
    response = server.client().completions.create(model=MODEL, prompt=prompt, max_tokens=10, temperature=0, stop=[stop])
    assert response.choices[0].text == full[: full.find(stop)]
    assert response.choices[0].finish_reason == "stop"


def test_seeded_sampling_repeats(server):
    kwargs = dict(model=MODEL, prompt="The harbour", max_tokens=8, temperature=1.0, top_p=0.9, seed=1234)
    first = server.client().completions.create(**kwargs).choices[0].text
    assert server.client().completions.create(**kwargs).choices[0].text == first


def test_concurrent_clients_are_batched_and_batch_independent(server, frontend, oracle):
    prompts = [
        "The small engine reads",
        "Every evening she wrote",
        "Her brother, a baker",
        "def add(a, b):",
        "Question: What is 12 plus 30?",
        "Unicode text also matters",
        "They talked about the weather",
        "A good plan puts the busy experts",
    ]
    expected = [frontend.decode(oracle(frontend.encode(p), 16)[0], skip_special_tokens=True) for p in prompts]

    def ask(prompt: str) -> str:
        return server.client().completions.create(model=MODEL, prompt=prompt, max_tokens=16, temperature=0).choices[0].text

    with ThreadPoolExecutor(len(prompts)) as pool:
        answers = list(pool.map(ask, prompts))
    assert answers == expected
    assert server.health()["largest_batch"] > 1


# -- reasoning and tool calls, produced on demand by the scripted engine --------------------------


def test_reasoning_content_stream_and_non_stream(scripted, frontend):
    text = "The keeper counts ships.\n</think>\n\nShe counted three on Monday."
    client = scripted.client()
    scripted.engine.scripts.append(script(frontend, text))
    message = client.chat.completions.create(model=MODEL, messages=USER, max_tokens=60, temperature=0).choices[0].message
    assert message.reasoning_content == "The keeper counts ships.\n"
    assert message.content == "\n\nShe counted three on Monday."

    scripted.engine.scripts.append(script(frontend, text))
    chunks = list(client.chat.completions.create(model=MODEL, messages=USER, max_tokens=60, temperature=0, stream=True))
    deltas = [c.choices[0].delta for c in chunks]
    assert "".join(getattr(d, "reasoning_content", None) or "" for d in deltas) == message.reasoning_content
    assert "".join(d.content or "" for d in deltas) == message.content
    assert chunks[-1].choices[0].finish_reason == "stop"


def test_reply_cut_off_while_thinking_is_reasoning_in_both_modes(scripted, frontend):
    text = "The keeper counts ships and then"
    client = scripted.client()
    max_tokens = len(frontend.encode(text))
    scripted.engine.scripts.append(script(frontend, text, stop=False))
    response = client.chat.completions.create(model=MODEL, messages=USER, max_tokens=max_tokens, temperature=0)
    message = response.choices[0].message
    assert (message.reasoning_content, message.content, response.choices[0].finish_reason) == (text, None, "length")

    scripted.engine.scripts.append(script(frontend, text, stop=False))
    chunks = list(client.chat.completions.create(model=MODEL, messages=USER, max_tokens=max_tokens, temperature=0, stream=True))
    deltas = [c.choices[0].delta for c in chunks]
    assert "".join(getattr(d, "reasoning_content", None) or "" for d in deltas) == text
    assert "".join(d.content or "" for d in deltas) == ""
    assert chunks[-1].choices[0].finish_reason == "length"


def test_tool_call_round_trip(scripted, frontend):
    call_text = (
        "<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n"
        "<parameter=days>\n2\n</parameter>\n</function>\n</tool_call>"
    )
    messages = [{"role": "user", "content": "What is the weather in Paris?"}]
    client = scripted.client()
    scripted.engine.scripts.append(script(frontend, "I should call the tool.\n</think>\n\n" + call_text))
    response = client.chat.completions.create(model=MODEL, messages=messages, tools=[WEATHER_TOOL], max_tokens=80, temperature=0)
    choice = response.choices[0]
    assert choice.finish_reason == "tool_calls"
    assert choice.message.reasoning_content == "I should call the tool.\n"
    (call,) = choice.message.tool_calls
    assert call.function.name == "get_weather"
    assert json.loads(call.function.arguments) == {"city": "Paris", "days": 2}
    assert response.usage.prompt_tokens == len(chat_prompt(frontend, messages, tools=[WEATHER_TOOL]))

    scripted.engine.scripts.append(script(frontend, "I should call the tool.\n</think>\n\n" + call_text))
    chunks = list(
        client.chat.completions.create(model=MODEL, messages=messages, tools=[WEATHER_TOOL], max_tokens=80, temperature=0, stream=True)
    )
    streamed = [tc for c in chunks for tc in (c.choices[0].delta.tool_calls or [])]
    assert [(tc.index, tc.function.name, json.loads(tc.function.arguments)) for tc in streamed] == [
        (0, "get_weather", {"city": "Paris", "days": 2})
    ]
    assert chunks[-1].choices[0].finish_reason == "tool_calls"

    follow_up = messages + [
        {"role": "assistant", "content": None, "tool_calls": [call.model_dump(exclude_none=True)]},
        {"role": "tool", "tool_call_id": call.id, "content": '{"temperature": 21, "sky": "clear"}'},
    ]
    scripted.engine.scripts.append(script(frontend, "</think>\n\nIt is 21 degrees and clear in Paris."))
    answer = client.chat.completions.create(model=MODEL, messages=follow_up, tools=[WEATHER_TOOL], max_tokens=80, temperature=0)
    assert answer.choices[0].message.content == "\n\nIt is 21 degrees and clear in Paris."
    assert answer.choices[0].message.tool_calls is None
    rendered = frontend.render(follow_up, tools=[WEATHER_TOOL])
    assert "<tool_response>" in rendered and "<function=get_weather>" in rendered
    assert answer.usage.prompt_tokens == len(frontend.encode(rendered))


# -- disconnects and the queue limit ---------------------------------------------------------------


def test_disconnect_mid_stream_frees_the_slot(scripted, frontend):
    scripted.engine.scripts.append(frontend.encode(" a") * 3000)
    body = {"model": MODEL, "prompt": "Once", "max_tokens": 3000, "temperature": 0, "stream": True}
    with httpx.stream("POST", f"{scripted.url}/v1/completions", json=body, timeout=60) as stream:
        lines = stream.iter_lines()
        for _ in range(3):
            assert next(line for line in lines if line).startswith("data:")
        assert scripted.health()["active"] == 1
    assert scripted.wait_idle(5.0) < 5.0
    start = time.monotonic()
    response = scripted.client().completions.create(model=MODEL, prompt="Once", max_tokens=4, temperature=0)
    assert response.usage.completion_tokens >= 1 and time.monotonic() - start < 10


def test_non_streaming_client_that_gives_up_is_cancelled(scripted, frontend):
    scripted.engine.scripts.append(frontend.encode(" a") * 3000)
    with pytest.raises(httpx.ReadTimeout):
        scripted.post("/v1/completions", {"model": MODEL, "prompt": "Once", "max_tokens": 3000, "temperature": 0}, timeout=1.0)
    assert scripted.wait_idle(5.0) < 5.0  # well before the 3000 tokens it asked for


def test_full_queue_answers_429(scripted, frontend):
    scripted.engine.scripts.append(frontend.encode(" a") * 3000)
    body = {"model": MODEL, "prompt": "Once", "max_tokens": 3000, "temperature": 0, "stream": True}
    with httpx.stream("POST", f"{scripted.url}/v1/completions", json=body, timeout=60) as stream:
        lines = stream.iter_lines()
        assert next(line for line in lines if line).startswith("data:")
        with ThreadPoolExecutor(1) as pool:
            queued = pool.submit(scripted.post, "/v1/completions", {"model": MODEL, "prompt": "Hi", "max_tokens": 2})
            while scripted.health()["waiting"] == 0:
                time.sleep(0.01)
            refused = scripted.post("/v1/completions", {"model": MODEL, "prompt": "Hi", "max_tokens": 2})
            assert refused.status_code == 429
            assert refused.json()["error"]["type"] == "rate_limit_error"
            stream.close()
            assert queued.result(timeout=30).status_code == 200
    scripted.wait_idle()


# -- malformed requests ----------------------------------------------------------------------------

GOOD = {"model": MODEL, "messages": USER, "max_tokens": 2}


@pytest.mark.parametrize(
    ("path", "body", "status", "param"),
    [
        ("/v1/chat/completions", {"model": MODEL}, 422, "messages"),
        ("/v1/chat/completions", {**GOOD, "messages": "hello"}, 422, "messages"),
        ("/v1/chat/completions", {**GOOD, "messages": []}, 422, "messages"),
        ("/v1/chat/completions", {**GOOD, "messages": [{"role": "wizard", "content": "x"}]}, 422, "messages.0.role"),
        ("/v1/chat/completions", {**GOOD, "temperature": "hot"}, 422, "temperature"),
        ("/v1/chat/completions", {**GOOD, "messages": [{"role": "user", "content": 5}]}, 422, "messages.0.content"),
        ("/v1/chat/completions", {**GOOD, "stop": 5}, 422, "stop"),
        ("/v1/chat/completions", {**GOOD, "seed": 2**70}, 422, "seed"),
        ("/v1/chat/completions", {**GOOD, "max_tokens": 0}, 422, "max_tokens"),
        ("/v1/chat/completions", {**GOOD, "max_tokens": -3}, 422, "max_tokens"),
        ("/v1/chat/completions", {**GOOD, "max_completion_tokens": 0}, 422, "max_completion_tokens"),
        ("/v1/chat/completions", {**GOOD, "model": "gpt-4o"}, 404, "model"),
        ("/v1/chat/completions", {**GOOD, "messages": [{"role": "user", "content": "lighthouse " * 400}]}, 400, "messages"),
        ("/v1/chat/completions", {**GOOD, "max_tokens": CONTEXT}, 400, "max_tokens"),
        ("/v1/chat/completions", {**GOOD, "n": 2}, 400, "n"),
        ("/v1/chat/completions", {**GOOD, "tool_choice": {"type": "function", "function": {"name": "nope"}}, "tools": [WEATHER_TOOL]}, 400,
         "tool_choice"),
        ("/v1/chat/completions", {**GOOD, "tool_choice": "required"}, 400, "tool_choice"),
        (
            "/v1/chat/completions",
            {**GOOD, "messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]},
            400,
            "messages.0.content",
        ),
        ("/v1/chat/completions", {**GOOD, "chat_template_kwargs": {"tools": []}}, 400, "chat_template_kwargs"),
        ("/v1/completions", {"model": MODEL, "prompt": "lighthouse " * 600}, 400, "prompt"),
        ("/v1/completions", {"model": MODEL, "prompt": [5, 100000]}, 400, "prompt"),
        ("/v1/completions", {"model": MODEL, "prompt": ""}, 400, "prompt"),
        ("/v1/completions", {"model": MODEL}, 422, "prompt"),
    ],
)
def test_malformed_requests_get_openai_errors(server, path, body, status, param):
    response = server.post(path, body)
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["param"] == param and error["message"]


def test_bad_json_wrong_method_unknown_route(server):
    bad = server.post("/v1/chat/completions", b'{"model": "tiny", "messages": [')
    assert bad.status_code == 400 and bad.json()["error"]["code"] == "invalid_json"
    assert httpx.get(f"{server.url}/v1/chat/completions").status_code == 405
    unknown = httpx.get(f"{server.url}/v1/engines")
    assert unknown.status_code == 404 and unknown.json()["error"]["type"] == "not_found_error"


def test_unknown_fields_are_ignored(server):
    body = {**GOOD, "user": "someone", "logit_bias": {}, "parallel_tool_calls": True, "service_tier": "auto", "store": False}
    assert server.post("/v1/chat/completions", body).status_code == 200


def test_top_k_follows_the_cli_rule(server):
    """0 or -1 (vLLM's spelling) turns top-k off, as `ninfer generate --top-k` reads them; below that is the sampler's 422."""
    for top_k in (0, -1):
        assert server.post("/v1/chat/completions", {**GOOD, "top_k": top_k}).status_code == 200
    refused = server.post("/v1/chat/completions", {**GOOD, "top_k": -2})
    assert refused.status_code == 422
    assert refused.json()["error"] | {"code": None} == {
        "message": "top_k must be an integer >= 0 (0 or -1 disables it)", "type": "invalid_request_error", "param": "top_k", "code": None
    }


def test_errors_raised_by_the_client_library(server):
    client = server.client()
    with pytest.raises(openai.NotFoundError):
        client.chat.completions.create(model="nope", messages=USER)
    with pytest.raises(openai.BadRequestError):
        client.chat.completions.create(model=MODEL, messages=USER, max_tokens=CONTEXT * 2)


# -- API key and body size -------------------------------------------------------------------------


def test_api_key_enforced(guarded):
    with pytest.raises(openai.AuthenticationError):
        guarded.client().models.list()
    with pytest.raises(openai.AuthenticationError):
        guarded.client("wrong").chat.completions.create(model=MODEL, messages=USER, max_tokens=2)
    assert [m.id for m in guarded.client("sekret").models.list().data] == [MODEL]
    response = guarded.client("sekret").chat.completions.create(model=MODEL, messages=USER, max_tokens=2)
    assert response.usage.completion_tokens >= 1
    assert guarded.post("/v1/completions", b"{bad").status_code == 401  # the key is checked first
    assert httpx.get(f"{guarded.url}/health").status_code == 200


def test_rehearsal_goes_through_the_routes_and_guards_quietly(tiny_artifact, frontend, oracle, caplog):
    """A server that rehearses (`serve.rehearsal`, what CUDA servers do) sends its requests through the API
    key and body guards before it listens: none is refused or left active, none is logged as a client's,
    and the first client request then gets the engine's greedy text and its own log line."""
    engine = Engine.load(tiny_artifact, device="cpu", max_sequences=4, spec="none")
    app = create_app(engine, frontend, MODEL, CONTEXT, api_key="sekret", max_body_bytes=2048, rehearse_routes=True)
    with caplog.at_level(logging.INFO, logger="ninfer.serve"), LiveServer(app) as live:
        messages = [record.getMessage() for record in caplog.records]
        assert any(message.startswith("serving path rehearsed") and "(3 requests)" in message for message in messages)
        assert not [message for message in messages if "warning" in message or " prompt=" in message]
        assert live.health()["active"] == 0
        prompt = frontend.encode("The lighthouse keeper")
        text = live.client("sekret").completions.create(model=MODEL, prompt=prompt, max_tokens=8, temperature=0).choices[0].text
        assert text == frontend.decode(oracle(prompt, 8)[0], skip_special_tokens=True)
    assert any(" prompt=%d " % len(prompt) in record.getMessage() for record in caplog.records)


def test_body_limit_413(guarded):
    body = {"model": MODEL, "prompt": "x" * 4096}
    response = guarded.post("/v1/completions", body, headers={"authorization": "Bearer sekret"})
    assert response.status_code == 413
    assert response.json()["error"]["message"].startswith("request body is larger")

    def chunks():  # no content-length: the streamed size is counted
        yield json.dumps(body).encode()

    headers = {"authorization": "Bearer sekret", "content-type": "application/json"}
    streamed = httpx.post(f"{guarded.url}/v1/completions", content=chunks(), headers=headers)
    assert streamed.status_code == 413


# -- no state growth over many requests ------------------------------------------------------------


def live_sessions() -> int:
    gc.collect()
    return sum(1 for obj in gc.get_objects() if type(obj).__name__ == "Session" and type(obj).__module__.startswith("ninfer_offload"))


def test_many_sequential_requests_leave_no_state(server):
    client = server.client()

    def burst(n: int) -> None:
        for i in range(n):
            client.completions.create(model=MODEL, prompt=f"Request number {i}", max_tokens=2, temperature=0)

    burst(20)
    process = psutil.Process()
    rss, threads, sessions = process.memory_info().rss, process.num_threads(), live_sessions()
    burst(200)
    server.wait_idle()
    assert server.health()["active"] == 0
    assert live_sessions() == sessions
    assert process.num_threads() <= threads
    assert process.memory_info().rss - rss < 32 * 2**20
