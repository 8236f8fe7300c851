"""`POST /v1/responses` through a real uvicorn server with the tiny model, driven by the official
`openai` client: the same text as chat completions (whole and streamed, with the documented event
sequence), reasoning on and off, a forced tool call and its result sent back, `text.format` JSON,
the token limit, and malformed bodies answered with 4xx OpenAI errors naming the field."""

from __future__ import annotations

import json

import pytest

from ninfer_offload.runtime.engine import Engine
from ninfer_offload.serve.app import create_app
from test_serve_api import MODEL, LiveServer, chat_prompt
from test_serve_structured import SCHEMA

WEATHER = {
    "type": "function",
    "name": "get_weather",
    "description": "Current weather of a city",
    "parameters": {"type": "object", "properties": {"city": {"enum": ["Paris", "Rome"]}, "days": {"type": "boolean"}},
                   "required": ["city"]},
}
ASK = "What is the weather in Paris?"
GREEDY = dict(model=MODEL, temperature=0, reasoning={"effort": "none"})
NO_THINKING = {"chat_template_kwargs": {"enable_thinking": False}}


@pytest.fixture(scope="module")
def server(tiny_artifact, frontend):
    engine = Engine.load(tiny_artifact, device="cpu", max_sequences=4, spec="none")
    with LiveServer(create_app(engine, frontend, MODEL, 512, max_concurrency=4, max_queue=8)) as live:
        yield live


def test_text_matches_chat_whole_and_streamed(server, frontend):
    client = server.client()
    reply = client.responses.create(**GREEDY, instructions="Be brief.", input=ASK, max_output_tokens=5)
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": ASK}]
    chat = client.chat.completions.create(model=MODEL, messages=messages, temperature=0, max_tokens=5, extra_body=NO_THINKING)
    assert reply.output_text == chat.choices[0].message.content and reply.output_text
    assert [item.type for item in reply.output] == ["message"]
    assert reply.usage.input_tokens == chat.usage.prompt_tokens == len(chat_prompt(frontend, messages, enable_thinking=False))
    assert chat.choices[0].finish_reason == "length" and reply.usage.output_tokens == 5 and reply.status == "incomplete"
    assert reply.incomplete_details.reason == "max_output_tokens"

    events = list(client.responses.create(**GREEDY, instructions="Be brief.", input=ASK, max_output_tokens=5, stream=True))
    kinds = [event.type for event in events]
    assert kinds[:4] == ["response.created", "response.in_progress", "response.output_item.added", "response.content_part.added"]
    assert kinds[-4:] == ["response.output_text.done", "response.content_part.done", "response.output_item.done", "response.incomplete"]
    assert [event.sequence_number for event in events] == list(range(len(events)))
    assert "".join(event.delta for event in events if event.type == "response.output_text.delta") == reply.output_text
    assert events[-1].response.output_text == reply.output_text and events[-1].response.usage.output_tokens == 5


def test_stop_at_the_end_of_turn_completes(server):
    reply = server.client().responses.create(**GREEDY, instructions="Be brief.", input=ASK, max_output_tokens=60)
    assert reply.status == "completed" and reply.incomplete_details is None and reply.usage.output_tokens < 60


def test_reasoning_on_and_off(server):
    client = server.client()
    thinking = client.responses.create(model=MODEL, temperature=0, input=ASK, max_output_tokens=6, reasoning={"effort": "high"})
    chat = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": ASK}], temperature=0, max_tokens=6)
    (reasoning,) = [item for item in thinking.output if item.type == "reasoning"]
    assert reasoning.content[0].text == chat.choices[0].message.reasoning_content
    events = list(client.responses.create(model=MODEL, temperature=0, input=ASK, max_output_tokens=6, reasoning={"effort": "high"},
                                          stream=True))
    assert events[2].item.type == "reasoning" and events[3].part.type == "reasoning_text"
    assert "".join(e.delta for e in events if e.type == "response.reasoning_text.delta") == reasoning.content[0].text
    plain = client.responses.create(**GREEDY, input=ASK, max_output_tokens=6)
    assert [item.type for item in plain.output] == ["message"]


def test_forced_tool_call_round_trip(server, frontend):
    client = server.client()
    kwargs = dict(**GREEDY, tools=[WEATHER], tool_choice={"type": "function", "name": "get_weather"}, parallel_tool_calls=False,
                  max_output_tokens=60)
    reply = client.responses.create(**kwargs, input=ASK)
    assert reply.status == "completed"
    (call,) = reply.output
    assert call.type == "function_call" and call.name == "get_weather"
    arguments = json.loads(call.arguments)
    assert arguments["city"] in ("Paris", "Rome") and set(arguments) <= {"city", "days"}

    events = list(client.responses.create(**kwargs, input=ASK, stream=True))
    (streamed,) = [e for e in events if e.type == "response.function_call_arguments.done"]
    assert streamed.arguments == call.arguments
    assert "".join(e.delta for e in events if e.type == "response.function_call_arguments.delta") == call.arguments

    turn = [
        {"role": "user", "content": ASK},
        {"type": "function_call", "call_id": call.call_id, "name": call.name, "arguments": call.arguments},
        {"type": "function_call_output", "call_id": call.call_id, "output": "Sunny, 24 C"},
    ]
    answer = client.responses.create(**GREEDY, tools=[WEATHER], input=turn, max_output_tokens=4)
    seen = [
        {"role": "user", "content": ASK},
        {"role": "assistant", "content": None, "tool_calls": [{"id": call.call_id, "type": "function",
                                                               "function": {"name": call.name, "arguments": call.arguments}}]},
        {"role": "tool", "tool_call_id": call.call_id, "content": "Sunny, 24 C"},
    ]
    tools = [{"type": "function", "function": {key: WEATHER[key] for key in ("name", "description", "parameters")}}]
    prompt = frontend.render(seen, tools=tools, enable_thinking=False)
    assert "Sunny, 24 C" in prompt and answer.usage.input_tokens == len(frontend.encode(prompt))


def test_text_format_json_schema(server):
    reply = server.client().responses.create(
        **GREEDY, input="Weather as JSON, please.", max_output_tokens=50,
        text={"format": {"type": "json_schema", "name": "weather", "schema": SCHEMA}},
    )
    value = json.loads(reply.output_text)
    assert set(value) == {"city", "sunny", "days"} and value["city"] in SCHEMA["properties"]["city"]["enum"]


GOOD = {"model": MODEL, "input": ASK, "max_output_tokens": 2}


@pytest.mark.parametrize(
    "body, status, param",
    [
        ({**GOOD, "input": [{"type": "web_search_call", "id": "x"}]}, 400, "input.0.type"),
        ({**GOOD, "input": [{"role": "user", "content": [{"type": "input_image", "image_url": "http://x/y.png"}]}]}, 400,
         "input.0.content.0.type"),
        ({**GOOD, "input": [{"role": "user", "content": [{"type": "holo"}]}]}, 400, "input.0.content.0.type"),
        ({**GOOD, "input": [{"role": "user", "content": ASK}, {"type": "function_call_output", "call_id": "c9", "output": "x"}]}, 400,
         "input.1.call_id"),
        ({**GOOD, "input": [{"type": "function_call", "call_id": "c1", "name": "f"}]}, 422, "input.0.arguments"),
        ({**GOOD, "input": [{"type": "function_call", "call_id": "c1", "name": "f", "arguments": "{"}]}, 400, "input"),
        ({**GOOD, "tool_choice": "required"}, 400, "tool_choice"),
        ({**GOOD, "input": [{"role": "robot", "content": ASK}]}, 422, "input.0.role"),
        ({**GOOD, "input": 7}, 422, "input"),
        ({**GOOD, "previous_response_id": "resp_1"}, 400, "previous_response_id"),
        ({**GOOD, "tools": [{"type": "web_search"}]}, 400, "tools.0.type"),
        ({**GOOD, "tools": [{"type": "function"}]}, 422, "tools.0.name"),
        ({**GOOD, "tools": [WEATHER], "tool_choice": {"type": "function", "name": "nope"}}, 400, "tool_choice"),
        ({**GOOD, "text": {"format": {"type": "json_schema", "name": "x"}}}, 400, "text.format.schema"),
        ({**GOOD, "text": {"format": {"type": "json_schema", "name": "x", "schema": {"type": "objectx"}}}}, 400, "text.format"),
        ({**GOOD, "reasoning": {"effort": "extreme"}}, 422, "reasoning.effort"),
        ({**GOOD, "max_output_tokens": 0}, 422, "max_output_tokens"),
        ({**GOOD, "max_output_tokens": 600}, 400, "max_output_tokens"),
        ({**GOOD, "temperature": -1}, 422, "temperature"),
        ({**GOOD, "model": "gpt-5"}, 404, "model"),
        ({"model": MODEL}, 422, "input"),
    ],
)
def test_malformed_bodies_get_openai_errors(server, body, status, param):
    response = server.post("/v1/responses", body)
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert error["param"] == param and param in error["message"], error
