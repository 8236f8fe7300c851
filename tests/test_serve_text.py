"""Stop strings, reasoning split and Qwen3 XML tool calls: whole-text and streamed forms agree."""

from __future__ import annotations

import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ninfer_offload.serve.reasoning import ReasoningStream, prompt_leaves_thinking_open, split_reasoning
from ninfer_offload.serve.stops import StopMatcher, partial_match_length
from ninfer_offload.serve.tool_calls import ToolCallStream, parse_tool_calls

WEATHER_TOOL = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "parameters": {
            "type": "object", "properties": {"city": {"type": "string"}, "zip": {"type": "string"}, "days": {"type": "integer"}}
        },
    },
}


def chunked(text: str, size: int) -> list[str]:
    return [text[i : i + size] for i in range(0, len(text), size)] or [""]


# -- stop strings ----------------------------------------------------------------------------------


def test_partial_match_length():
    assert partial_match_length("hello wor", ["world"]) == 3
    assert partial_match_length("hello", ["world"]) == 0
    assert partial_match_length("ab", ["abc", "b"]) == 2
    assert partial_match_length("xyz", ["z"]) == 0  # a whole match is not a partial one


@pytest.mark.parametrize("size", [1, 2, 3, 100])
def test_stop_string_cuts_output_in_any_chunking(size):
    matcher = StopMatcher(["STOP", "\n\n"])
    out = "".join(matcher.feed(piece) for piece in chunked("one two STO three STOP four", size))
    assert matcher.stopped
    assert out == "one two STO three "
    assert matcher.flush() == ""


def test_held_back_prefix_is_released_at_the_end():
    matcher = StopMatcher(["END"])
    assert matcher.feed("the EN") == "the "
    assert matcher.flush() == "EN"
    assert not matcher.stopped


@settings(max_examples=60, deadline=None)
@given(text=st.text(alphabet="abc\n", max_size=30), stop=st.text(alphabet="abc\n", min_size=1, max_size=3), size=st.integers(1, 5))
def test_stop_matcher_equals_cutting_at_first_occurrence(text, stop, size):
    matcher = StopMatcher([stop])
    out = "".join(matcher.feed(piece) for piece in chunked(text, size)) + matcher.flush()
    cut = text.find(stop)
    assert out == (text if cut < 0 else text[:cut])
    assert matcher.stopped == (cut >= 0)


# -- reasoning -------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("plan it\n</think>\n\nThe answer.", ("plan it\n", "\n\nThe answer.")),
        ("<think>plan it</think>The answer.", ("plan it", "The answer.")),
        ("cut off while thinking", ("cut off while thinking", None)),  # no </think>: all reasoning, as when streamed
        ("thought only</think>", ("thought only", None)),
        ("a</think>b</think>c", ("a", "b</think>c")),
        ("", ("", None)),
    ],
)
def test_split_reasoning(text, expected):
    assert split_reasoning(text) == expected


def test_split_reasoning_with_thinking_off_is_all_content():
    assert split_reasoning("a</think>b", thinking=False) == (None, "a</think>b")
    assert split_reasoning("", thinking=False) == (None, None)


def test_prompt_thinking_state():
    assert prompt_leaves_thinking_open("<|im_start|>assistant\n<think>\n")
    assert not prompt_leaves_thinking_open("<|im_start|>assistant\n<think>\n\n</think>\n\n")
    history = "<|im_start|>assistant\n<think>\nx\n</think>\n\nhi<|im_end|>\n"
    assert prompt_leaves_thinking_open(history + "<|im_start|>assistant\n<think>\n")
    assert not prompt_leaves_thinking_open(history + "<|im_start|>assistant\n")


def stream_reasoning(text: str, size: int, thinking: bool = True) -> tuple[str, str]:
    stream = ReasoningStream(thinking)
    parts = [stream.feed(piece) for piece in chunked(text, size)] + [stream.flush()]
    return "".join(p[0] for p in parts), "".join(p[1] for p in parts)


@pytest.mark.parametrize("size", [1, 2, 5, 100])
@pytest.mark.parametrize("text", ["plan it\n</think>\n\nThe answer.", "<think>plan it</think>The answer.", "x</think>", "no end <thi"])
def test_streamed_reasoning_matches_whole_text_split(text, size):
    reasoning, content = split_reasoning(text)
    assert stream_reasoning(text, size) == (reasoning or "", content or "")


def test_streamed_reasoning_without_end_tag_stays_reasoning_and_thinking_off_is_content():
    assert stream_reasoning("still thinking <thi", 3) == ("still thinking <thi", "")
    assert stream_reasoning("a</think>b", 2, thinking=False) == ("", "a</think>b")


# -- tool calls ------------------------------------------------------------------------------------

TOOL_TEXT = (
    "Let me look.\n"
    "<tool_call>\n<function=get_weather>\n<parameter=city>\nNew York\n</parameter>\n"
    "<parameter=zip>\n10001\n</parameter>\n<parameter=days>\n3\n</parameter>\n"
    "<parameter=options>\n{\"unit\": \"celsius\", \"hourly\": true}\n</parameter>\n</function>\n</tool_call>\n"
    "<tool_call>\n<function=get_time>\n<parameter=zone>\nUTC\n</parameter>\n</function>\n</tool_call>"
)


def test_parse_tool_calls():
    content, calls = parse_tool_calls(TOOL_TEXT, [WEATHER_TOOL])
    assert content == "Let me look.\n"
    assert [c["function"]["name"] for c in calls] == ["get_weather", "get_time"]
    assert json.loads(calls[0]["function"]["arguments"]) == {
        "city": "New York",
        "zip": "10001",  # declared a string: not turned into a number
        "days": 3,
        "options": {"unit": "celsius", "hourly": True},
    }
    assert json.loads(calls[1]["function"]["arguments"]) == {"zone": "UTC"}
    assert all(c["type"] == "function" and c["id"].startswith("call_") for c in calls)
    assert calls[0]["id"] != calls[1]["id"]


def test_multiline_value_keeps_inner_newlines():
    text = "<tool_call>\n<function=write>\n<parameter=body>\nline 1\nline 2\n</parameter>\n</function>\n</tool_call>"
    _, calls = parse_tool_calls(text, None)
    assert json.loads(calls[0]["function"]["arguments"]) == {"body": "line 1\nline 2"}


def test_text_without_a_valid_call_is_content():
    assert parse_tool_calls("no calls here", None) == ("no calls here", [])
    assert parse_tool_calls("broken <tool_call> nothing </tool_call>", None) == ("broken <tool_call> nothing </tool_call>", [])


def test_unterminated_last_call_is_still_parsed():
    content, calls = parse_tool_calls("<tool_call>\n<function=f>\n<parameter=a>\n1\n", None)
    assert content is None
    assert json.loads(calls[0]["function"]["arguments"]) == {"a": 1}


@pytest.mark.parametrize("size", [1, 3, 7, 1000])
def test_streamed_tool_calls_match_whole_text(size):
    stream = ToolCallStream([WEATHER_TOOL])
    content, calls = "", []
    for piece in chunked(TOOL_TEXT, size):
        text, new = stream.feed(piece)
        content += text
        calls += new
    text, new = stream.flush()
    content += text
    calls += new
    whole_content, whole_calls = parse_tool_calls(TOOL_TEXT, [WEATHER_TOOL])
    assert content == whole_content
    assert [c["function"] for c in calls] == [c["function"] for c in whole_calls]
