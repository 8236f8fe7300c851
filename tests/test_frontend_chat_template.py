"""Chat template rendering equals transformers' apply_chat_template on the same files."""

from __future__ import annotations

import json

import pytest
from transformers import AutoTokenizer

from ninfer_offload.errors import NinferError
from ninfer_offload.frontend import Frontend
from ninfer_offload.convert.tiny_tokenizer import write_tokenizer_files

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "Current weather of a city.",
            "parameters": {
                "type": "object",
                "properties": {"city": {"type": "string"}, "days": {"type": "integer"}},
                "required": ["city"],
            },
        },
    },
    {"type": "function", "function": {"name": "now", "description": "Time <now> & \"here\".", "parameters": {}}},
]

CONVERSATIONS = {
    "single_user": [{"role": "user", "content": "Hello!"}],
    "system_multi_turn": [
        {"role": "system", "content": "You are terse."},
        {"role": "user", "content": "Name a colour."},
        {"role": "assistant", "content": "Blue.", "reasoning_content": "Any colour works."},
        {"role": "user", "content": "Another one, café?"},
        {"role": "assistant", "content": "<think>\nPick again.\n</think>\n\nGreen."},
        {"role": "user", "content": [{"type": "text", "text": "And "}, {"type": "text", "text": "a third?"}]},
    ],
    "tools": [
        {"role": "system", "content": "Use tools when needed."},
        {"role": "user", "content": "Weather in Paris for 2 days?"},
        {
            "role": "assistant",
            "content": "Let me check.",
            "reasoning_content": "I need the tool.",
            "tool_calls": [
                {"type": "function", "function": {"name": "get_weather", "arguments": {"city": "Paris", "days": 2}}},
                {"type": "function", "function": {"name": "now", "arguments": {}}},
            ],
        },
        {"role": "tool", "content": "sunny, 20 C"},
        {"role": "tool", "content": "{\"time\": \"12:00\"}"},
        {"role": "assistant", "content": "Sunny and 20 C.", "reasoning_content": "Summarise."},
    ],
    "tools_no_system": [
        {"role": "user", "content": "What time is it?"},
        {"role": "assistant", "content": "", "tool_calls": [{"function": {"name": "now", "arguments": {"zone": ["UTC", 0]}}}]},
        {"role": "tool", "content": "12:00"},
    ],
}


@pytest.fixture(scope="module", params=["file", "config"])
def files(request, tmp_path_factory):
    directory = tmp_path_factory.mktemp(f"tok_{request.param}")
    return write_tokenizer_files(directory, template_in_config=request.param == "config")


@pytest.fixture(scope="module")
def frontend(files):
    return Frontend.from_directory(files)


@pytest.fixture(scope="module")
def hf(files):
    return AutoTokenizer.from_pretrained(str(files))


@pytest.mark.parametrize("name", sorted(CONVERSATIONS))
@pytest.mark.parametrize("thinking", [True, False])
@pytest.mark.parametrize("generation_prompt", [True, False])
def test_render_equals_transformers(frontend, hf, name, thinking, generation_prompt):
    messages = CONVERSATIONS[name]
    tools = TOOLS if name.startswith("tools") else None
    ours = frontend.render(messages, tools=tools, enable_thinking=thinking, add_generation_prompt=generation_prompt)
    theirs = hf.apply_chat_template(
        messages, tools=tools, tokenize=False, add_generation_prompt=generation_prompt, enable_thinking=thinking
    )
    assert ours == theirs
    ids = hf.apply_chat_template(
        messages, tools=tools, tokenize=True, return_dict=False, add_generation_prompt=generation_prompt,
        enable_thinking=thinking,
    )
    assert frontend.encode(ours) == list(ids)


def test_render_content_of_each_kind(frontend):
    text = frontend.render(CONVERSATIONS["tools"], tools=TOOLS, enable_thinking=False)
    assert text.startswith("<|im_start|>system\nUse tools when needed.\n\n# Tools")
    assert json.dumps(TOOLS[1], ensure_ascii=False) in text  # tojson does not escape HTML characters
    assert "<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n<parameter=days>\n2\n</parameter>" in text
    assert "<|im_start|>user\n<tool_response>\nsunny, 20 C\n</tool_response>\n<tool_response>" in text
    assert text.endswith("<|im_start|>assistant\n<think>\n\n</think>\n\n")
    assert frontend.render(CONVERSATIONS["single_user"]).endswith("<|im_start|>assistant\n<think>\n")


def test_reasoning_aliases_and_json_string_arguments(frontend):
    as_objects = frontend.render(CONVERSATIONS["tools"], tools=TOOLS)
    aliased = json.loads(json.dumps(CONVERSATIONS["tools"]))
    aliased[2]["reasoning"] = aliased[2].pop("reasoning_content")
    for call in aliased[2]["tool_calls"]:
        call["function"]["arguments"] = json.dumps(call["function"]["arguments"])
    aliased[1]["name"] = None  # None-valued keys are dropped, as transformers does
    assert frontend.render(aliased, tools=TOOLS) == as_objects


def test_override_template_and_generation_block(tmp_path, files, hf):
    template = (
        "{% for m in messages %}{% if m.role == 'assistant' %}{% generation %}[{{ m.content }}]{% endgeneration %}"
        "{% else %}{{ m.role }}: {{ m.content }}{{ eos_token }}\n{% endif %}{% endfor %}"
        "{% if add_generation_prompt %}>{% endif %}"
    )
    frontend = Frontend.from_directory(files, chat_template=template)
    messages = [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}]
    rendered = frontend.render(messages)
    assert rendered == "user: a<|im_end|>\n[b]>"
    assert rendered == hf.apply_chat_template(messages, chat_template=template, tokenize=False, add_generation_prompt=True)


def test_template_errors_are_one_line(files):
    with pytest.raises(NinferError, match="unknown role: robot"):
        Frontend.from_directory(files).render([{"role": "robot", "content": "beep"}])
    with pytest.raises(NinferError, match="syntax error at line 1"):
        Frontend.from_directory(files, chat_template="{% for m in messages %}")
    with pytest.raises(NinferError, match="non-empty list"):
        Frontend.from_directory(files).render([])
    with pytest.raises(NinferError, match="not valid JSON"):
        Frontend.from_directory(files).render(
            [{"role": "assistant", "content": "", "tool_calls": [{"function": {"name": "f", "arguments": "{oops"}}]}]
        )


def test_no_template_is_a_clear_error(tmp_path, files):
    for name in ("tokenizer.json", "generation_config.json"):
        (tmp_path / name).write_bytes((files / name).read_bytes())
    with pytest.raises(NinferError, match="no chat template"):
        Frontend.from_directory(tmp_path).render([{"role": "user", "content": "hi"}])


def test_sandbox_blocks_attribute_escapes(files):
    frontend = Frontend.from_directory(files, chat_template="{{ messages.__class__.__mro__ }}")
    with pytest.raises(NinferError):
        frontend.render([{"role": "user", "content": "x"}])
    mutate = Frontend.from_directory(files, chat_template="{{ messages.append(1) }}")
    with pytest.raises(NinferError):
        mutate.render([{"role": "user", "content": "x"}])
