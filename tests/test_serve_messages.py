"""`POST /v1/messages` and `/v1/messages/count_tokens` through a real uvicorn server with the tiny
model, driven by the official `anthropic` client: the same greedy text as chat completions and
responses (whole and streamed, with Anthropic's event sequence), thinking on and off, a forced tool
call and its result sent back, stop sequences and the token limit with their stop reasons, the
API key as `x-api-key`, and every refusal (body checks and guards alike) in Anthropic's error shape."""

from __future__ import annotations

import anthropic
import httpx
import pytest

from ninfer_offload.runtime.engine import Engine
from ninfer_offload.serve.app import create_app
from test_serve_api import MODEL, LiveServer

KEY = "sekret"
WEATHER = {
    "name": "get_weather",
    "description": "Current weather of a city",
    "input_schema": {"type": "object", "properties": {"city": {"enum": ["Paris", "Rome"]}, "days": {"type": "boolean"}},
                     "required": ["city"]},
}
ASK = "What is the weather in Paris?"
GREEDY = dict(model=MODEL, extra_body={"temperature": 0})  # this client no longer offers the sampling fields, the API still has them
NO_THINKING = {"chat_template_kwargs": {"enable_thinking": False}}


@pytest.fixture(scope="module")
def server(tiny_artifact, frontend):
    engine = Engine.load(tiny_artifact, device="cpu", max_sequences=4, spec="none")
    with LiveServer(create_app(engine, frontend, MODEL, 512, max_concurrency=4, max_queue=8, api_key=KEY, max_body_bytes=4096)) as live:
        yield live


def client(server) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=server.url, api_key=KEY, max_retries=0, timeout=60)


def post(server, path: str, body, **headers) -> httpx.Response:
    return server.post(path, body, headers={"x-api-key": KEY, **headers})


def test_same_greedy_text_through_all_three_endpoints(server):
    system, limit = "Be brief.", 5
    message = client(server).messages.create(**GREEDY, system=system, messages=[{"role": "user", "content": ASK}], max_tokens=limit)
    openai = server.client(KEY)
    chat = openai.chat.completions.create(
        model=MODEL, temperature=0, messages=[{"role": "system", "content": system}, {"role": "user", "content": ASK}], max_tokens=limit,
        extra_body=NO_THINKING,
    )
    response = openai.responses.create(
        model=MODEL, temperature=0, instructions=system, input=ASK, max_output_tokens=limit, reasoning={"effort": "none"}
    )
    (block,) = message.content
    assert block.type == "text" and block.text == chat.choices[0].message.content == response.output_text
    assert message.stop_reason == "max_tokens" and message.usage.output_tokens == limit
    assert message.usage.input_tokens == chat.usage.prompt_tokens == response.usage.input_tokens

    count = client(server).messages.count_tokens(model=MODEL, system=system, messages=[{"role": "user", "content": ASK}])
    assert count.input_tokens == message.usage.input_tokens


def test_streamed_events_and_text(server):
    kwargs = dict(**GREEDY, messages=[{"role": "user", "content": ASK}], max_tokens=5)
    whole = client(server).messages.create(**kwargs)
    events = list(client(server).messages.create(**kwargs, stream=True))
    kinds = [event.type for event in events]
    assert kinds[:2] == ["message_start", "content_block_start"] and kinds[-3:] == ["content_block_stop", "message_delta", "message_stop"]
    assert set(kinds[2:-3]) == {"content_block_delta"}
    assert "".join(event.delta.text for event in events if event.type == "content_block_delta") == whole.content[0].text
    assert events[-2].delta.stop_reason == "max_tokens" and events[-2].usage.output_tokens == 5
    with client(server).messages.stream(**kwargs) as stream:
        final = stream.get_final_message()
    assert final.content[0].text == whole.content[0].text and final.stop_reason == "max_tokens"


def test_end_turn_and_stop_sequences(server):
    ask = [{"role": "user", "content": ASK}]
    brief = dict(**GREEDY, system="Be brief.", messages=ask, max_tokens=60)  # the tiny model ends this turn after a few tokens
    ended = client(server).messages.create(**brief)
    assert ended.stop_reason == "end_turn" and ended.stop_sequence is None and ended.usage.output_tokens < 60
    text = ended.content[0].text
    stop = text[len(text) // 2 : len(text) // 2 + 2]
    stopped = client(server).messages.create(**brief, stop_sequences=["\u2603", stop])
    assert stopped.stop_reason == "stop_sequence" and stopped.stop_sequence == stop
    assert stopped.content[0].text == text[: text.index(stop)]
    events = list(client(server).messages.create(**brief, stop_sequences=[stop], stream=True))
    assert events[-2].delta.stop_reason == "stop_sequence" and events[-2].delta.stop_sequence == stop


def test_thinking_on_and_off(server):
    openai = server.client(KEY)
    ask = [{"role": "user", "content": ASK}]
    thinking = client(server).messages.create(**GREEDY, messages=ask, max_tokens=6, thinking={"type": "enabled", "budget_tokens": 1024})
    chat = openai.chat.completions.create(model=MODEL, temperature=0, messages=ask, max_tokens=6)
    assert thinking.content[0].type == "thinking" and thinking.content[0].thinking == chat.choices[0].message.reasoning_content
    events = list(client(server).messages.create(**GREEDY, messages=ask, max_tokens=6, thinking={"type": "enabled", "budget_tokens": 1024},
                                                 stream=True))
    assert events[1].content_block.type == "thinking"
    assert "".join(e.delta.thinking for e in events if e.type == "content_block_delta") == thinking.content[0].thinking
    plain = client(server).messages.create(**GREEDY, messages=ask, max_tokens=6, thinking={"type": "disabled"})
    assert [block.type for block in plain.content] == ["text"]


def test_forced_tool_use_round_trip(server, frontend):
    choice = {"type": "tool", "name": "get_weather", "disable_parallel_tool_use": True}
    kwargs = dict(**GREEDY, tools=[WEATHER], max_tokens=60, tool_choice=choice)
    ask = [{"role": "user", "content": ASK}]
    message = client(server).messages.create(**kwargs, messages=ask)
    (use,) = message.content
    assert message.stop_reason == "tool_use" and use.type == "tool_use" and use.name == "get_weather"
    assert use.input["city"] in ("Paris", "Rome") and set(use.input) <= {"city", "days"}
    with client(server).messages.stream(**kwargs, messages=ask) as stream:
        streamed = stream.get_final_message()
    assert streamed.content[0].input == use.input and streamed.stop_reason == "tool_use"

    turn = [
        *ask,
        {"role": "assistant", "content": [{"type": "tool_use", "id": use.id, "name": use.name, "input": use.input}]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": use.id, "content": [{"type": "text", "text": "Sunny, 24 C"}]}]},
    ]
    answer = client(server).messages.create(**GREEDY, tools=[WEATHER], messages=turn, max_tokens=4)
    assert answer.stop_reason in ("max_tokens", "end_turn")
    seen = [
        *ask,
        {"role": "assistant", "content": "",
         "tool_calls": [{"id": use.id, "type": "function", "function": {"name": use.name, "arguments": use.input}}]},
        {"role": "tool", "tool_call_id": use.id, "content": "Sunny, 24 C"},
    ]
    function = {"name": WEATHER["name"], "description": WEATHER["description"], "parameters": WEATHER["input_schema"]}
    tools = [{"type": "function", "function": function}]
    prompt = frontend.render(seen, tools=tools, enable_thinking=False)
    assert "Sunny, 24 C" in prompt and answer.usage.input_tokens == len(frontend.encode(prompt))


GOOD = {"model": MODEL, "max_tokens": 2, "messages": [{"role": "user", "content": ASK}]}


def _user(*blocks) -> dict:
    return {**GOOD, "messages": [{"role": "user", "content": list(blocks)}]}


@pytest.mark.parametrize(
    "body, status, error_type, field",
    [
        ({"model": MODEL, "messages": GOOD["messages"]}, 400, "invalid_request_error", "max_tokens"),
        ({**GOOD, "max_tokens": 0}, 400, "invalid_request_error", "max_tokens"),
        ({**GOOD, "max_tokens": 600}, 400, "invalid_request_error", "max_tokens"),
        (_user({"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": "AA=="}}), 400, "invalid_request_error",
         "messages.0.content.0.type"),
        (_user({"type": "hologram"}), 400, "invalid_request_error", "messages.0.content.0.type"),
        (_user({"type": "tool_result", "tool_use_id": "toolu_9", "content": "x"}), 400, "invalid_request_error",
         "messages.0.content.0.tool_use_id"),
        (_user({"type": "text"}), 400, "invalid_request_error", "messages.0.content.0.text"),
        ({**GOOD, "messages": [{"role": "robot", "content": ASK}]}, 400, "invalid_request_error", "messages.0.role"),
        ({**GOOD, "system": [{"type": "image"}]}, 400, "invalid_request_error", "system"),
        ({**GOOD, "tools": [{"type": "web_search_20250305", "name": "web_search"}]}, 400, "invalid_request_error", "tools.0.type"),
        ({**GOOD, "tools": [{"name": "f"}]}, 400, "invalid_request_error", "tools.0.input_schema"),
        ({**GOOD, "tools": [WEATHER], "tool_choice": {"type": "tool", "name": "nope"}}, 400, "invalid_request_error", "tool_choice"),
        ({**GOOD, "tool_choice": {"type": "any"}}, 400, "invalid_request_error", "tool_choice"),
        ({**GOOD, "thinking": {"type": "sometimes"}}, 400, "invalid_request_error", "thinking.type"),
        ({**GOOD, "temperature": -1}, 400, "invalid_request_error", "temperature"),
        ({**GOOD, "top_k": -1}, 400, "invalid_request_error", "top_k"),
        ({**GOOD, "stop_sequences": "END"}, 400, "invalid_request_error", "stop_sequences"),
        ({**GOOD, "model": "claude-sonnet"}, 404, "not_found_error", "model"),
    ],
)
def test_malformed_bodies_get_anthropic_errors(server, body, status, error_type, field):
    response = post(server, "/v1/messages", body)
    assert response.status_code == status, response.text
    error = response.json()
    assert error["type"] == "error" and error["error"]["type"] == error_type and field in error["error"]["message"], error


def test_guard_refusals_take_anthropic_shape(server):
    missing_key = server.post("/v1/messages", GOOD)
    assert missing_key.status_code == 401 and missing_key.json()["error"]["type"] == "authentication_error"
    bearer = server.post("/v1/messages", GOOD, headers={"authorization": f"Bearer {KEY}"})
    assert bearer.status_code == 200 and bearer.json()["type"] == "message"
    too_large = post(server, "/v1/messages", {**GOOD, "system": "x" * 5000})
    assert too_large.status_code == 413 and too_large.json() == {
        "type": "error", "error": {"type": "request_too_large", "message": "request body is larger than 4096 bytes"}}
    counted = post(server, "/v1/messages/count_tokens", {"model": MODEL, "messages": [{"role": "user", "content": [{"type": "nope"}]}]})
    assert counted.status_code == 400 and counted.json()["error"]["type"] == "invalid_request_error"
    not_json = post(server, "/v1/messages", b"{")
    assert not_json.status_code == 400 and not_json.json()["type"] == "error"
    wrong_method = httpx.get(f"{server.url}/v1/messages", headers={"x-api-key": KEY})
    assert wrong_method.status_code == 405 and wrong_method.json()["type"] == "error"
    with pytest.raises(anthropic.AuthenticationError):
        wrong_key = anthropic.Anthropic(base_url=server.url, api_key="wrong", max_retries=0)
        wrong_key.messages.create(**GREEDY, messages=GOOD["messages"], max_tokens=2)
    chat = post(server, "/v1/chat/completions", {"model": MODEL, "messages": GOOD["messages"], "max_tokens": 0})
    assert chat.status_code == 422 and chat.json()["error"]["param"] == "max_tokens"  # OpenAI routes keep OpenAI's shape
