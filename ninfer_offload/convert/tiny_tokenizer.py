"""Tiny Qwen-style tokenizer files for the tiny checkpoint (`ninfer tiny`), built without downloads.

`write_tokenizer_files(directory)` trains a byte-level BPE with the `tokenizers` library on a
small built-in English text and writes the four files a Qwen3.5/3.6 checkpoint ships:
`tokenizer.json`, `tokenizer_config.json`, `chat_template.jinja` and `generation_config.json`.
The tokenizer pipeline (NFC, Qwen's split regex, byte-level) is the one transformers'
`Qwen2Tokenizer` builds, so transformers and `tokenizers` give the same ids.
"""

from __future__ import annotations

import json
from pathlib import Path

from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers

SPLIT_REGEX = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)

# (token, special): control tokens are special (skipped when decoding with skip_special_tokens);
# the tag-like tokens the model writes as text are not, as in the Qwen3 tokenizers.
ADDED_TOKENS: tuple[tuple[str, bool], ...] = (
    ("<|endoftext|>", True),
    ("<|im_start|>", True),
    ("<|im_end|>", True),
    ("<|vision_start|>", True),
    ("<|vision_end|>", True),
    ("<|image_pad|>", True),
    ("<|video_pad|>", True),
    ("<tool_call>", False),
    ("</tool_call>", False),
    ("<tool_response>", False),
    ("</tool_response>", False),
    ("<think>", False),
    ("</think>", False),
)

CORPUS = """\
The small engine reads its weights from one file and keeps the experts it needs close at hand.
When a token arrives, the router picks a few experts, and the runtime copies them to the card
before the layer runs. Most of the time the same experts come back again, so the copies are rare.
A good plan puts the busy experts in fast memory and leaves the quiet ones on the host.

Once upon a time there was a lighthouse keeper who counted ships. Every evening she wrote the
number in a thick blue book: three on Monday, seven on Tuesday, none at all on the stormy Friday.
Her brother, a baker in the town below, sent bread up the hill with the postman, who complained
about the stairs but always stayed for tea. They talked about the weather, the harbour, the price
of flour, and the strange lights that some sailors claimed to see far out at sea.

def add(a, b):
    return a + b

for i in range(10):
    print(i * i, "squared")

{"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}

Question: What is 12 plus 30? Answer: 42. Question: Is the sky green? Answer: No, it is blue.
Please think step by step, then give a short answer. I think the answer is yes, because the
evidence points that way; however, let me check the numbers again before I decide.
Numbers like 3.14159, 2.71828 and 1,000,000 appear in text; so do dates such as 2026-11-29.
Hello! How are you today? I'm fine, thanks. We're going to the market; they'll be there too.
Unicode text also matters: café, naïve, Zürich, São Paulo, 東京, Москва, and a smile 🙂.
"""


def _train(vocab_size: int) -> Tokenizer:
    tokenizer = Tokenizer(models.BPE(unk_token=None, fuse_unk=False, byte_fallback=False))
    tokenizer.normalizer = normalizers.NFC()
    tokenizer.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(SPLIT_REGEX), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size - len(ADDED_TOKENS),
        min_frequency=1,
        show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tokenizer.train_from_iterator(CORPUS.splitlines(keepends=True), trainer=trainer)
    tokenizer.add_tokens([AddedToken(text, special=special, normalized=False) for text, special in ADDED_TOKENS])
    return tokenizer


CHAT_TEMPLATE = """\
{#- Qwen3-style chat template: system, user, assistant (reasoning in <think>, XML tool calls), tool. -#}
{%- macro render_content(content) -%}
{%- if content is string -%}
{{- content -}}
{%- elif content is iterable and content is not mapping -%}
{%- for part in content -%}
{%- if part is mapping and part.type == 'text' -%}
{{- part.text -}}
{%- elif part is string -%}
{{- part -}}
{%- else -%}
{{- raise_exception('only text content parts are supported') -}}
{%- endif -%}
{%- endfor -%}
{%- elif content is none -%}
{%- else -%}
{{- raise_exception('message content must be a string or a list of text parts') -}}
{%- endif -%}
{%- endmacro -%}
{%- if not messages -%}
{{- raise_exception('no messages') -}}
{%- endif -%}
{%- set has_system = messages[0].role == 'system' -%}
{%- if tools %}
{{- '<|im_start|>system\\n' -}}
{%- if has_system and render_content(messages[0].content) %}
{{- render_content(messages[0].content) + '\\n\\n' -}}
{%- endif %}
{{- '# Tools\\n\\nYou may call one or more functions. Their signatures are listed in <tools></tools>:\\n<tools>' -}}
{%- for tool in tools %}
{{- '\\n' + (tool | tojson) -}}
{%- endfor %}
{{- '\\n</tools>\\n\\nTo call a function, reply with:\\n<tool_call>\\n<function=NAME>\\n<parameter=ARGUMENT>\\n'
    + 'VALUE\\n</parameter>\\n</function>\\n</tool_call><|im_end|>\\n' -}}
{%- elif has_system %}
{{- '<|im_start|>system\\n' + render_content(messages[0].content) + '<|im_end|>\\n' -}}
{%- endif %}
{%- set state = namespace(last_query=messages | length - 1, searching=true) -%}
{%- for message in messages[::-1] %}
{%- set index = messages | length - 1 - loop.index0 -%}
{%- if state.searching and message.role == 'user' %}
{%- set text = render_content(message.content) -%}
{%- if not (text.startswith('<tool_response>') and text.endswith('</tool_response>')) %}
{%- set state.last_query = index -%}
{%- set state.searching = false -%}
{%- endif %}
{%- endif %}
{%- endfor %}
{%- for message in messages %}
{%- set text = render_content(message.content) | trim -%}
{%- if message.role == 'system' %}
{%- if not loop.first %}
{{- '<|im_start|>system\\n' + text + '<|im_end|>\\n' -}}
{%- endif %}
{%- elif message.role == 'user' %}
{{- '<|im_start|>user\\n' + text + '<|im_end|>\\n' -}}
{%- elif message.role == 'assistant' %}
{%- set reasoning = '' -%}
{%- if message.reasoning_content is string %}
{%- set reasoning = message.reasoning_content | trim -%}
{%- elif '</think>' in text %}
{%- set reasoning = text.split('</think>')[0].split('<think>')[-1] | trim -%}
{%- set text = text.split('</think>')[-1] | trim -%}
{%- endif %}
{{- '<|im_start|>assistant\\n' -}}
{%- if loop.index0 > state.last_query %}
{{- '<think>\\n' + reasoning + '\\n</think>\\n\\n' -}}
{%- endif %}
{{- text -}}
{%- for call in message.tool_calls or [] %}
{%- set function = call.function if call.function is defined else call -%}
{%- if not loop.first or text %}
{{- '\\n' -}}
{%- endif %}
{{- '<tool_call>\\n<function=' + function.name + '>\\n' -}}
{%- if function.arguments is not mapping %}
{{- raise_exception('tool call arguments must be an object') -}}
{%- endif %}
{%- set arguments = function.arguments -%}
{%- for name, value in arguments.items() %}
{{- '<parameter=' + name + '>\\n' -}}
{%- if value is string %}
{{- value -}}
{%- else %}
{{- value | tojson -}}
{%- endif %}
{{- '\\n</parameter>\\n' -}}
{%- endfor %}
{{- '</function>\\n</tool_call>' -}}
{%- endfor %}
{{- '<|im_end|>\\n' -}}
{%- elif message.role == 'tool' %}
{%- if loop.first or messages[loop.index0 - 1].role != 'tool' %}
{{- '<|im_start|>user' -}}
{%- endif %}
{{- '\\n<tool_response>\\n' + text + '\\n</tool_response>' -}}
{%- if loop.last or messages[loop.index0 + 1].role != 'tool' %}
{{- '<|im_end|>\\n' -}}
{%- endif %}
{%- else %}
{{- raise_exception('unknown role: ' + message.role) -}}
{%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
{{- '<|im_start|>assistant\\n' -}}
{%- if enable_thinking is defined and not enable_thinking %}
{{- '<think>\\n\\n</think>\\n\\n' -}}
{%- else %}
{{- '<think>\\n' -}}
{%- endif %}
{%- endif %}
"""


def write_tokenizer_files(directory: str | Path, vocab_size: int = 512, template_in_config: bool = False) -> Path:
    """Write tokenizer.json, tokenizer_config.json, generation_config.json and the chat template.

    The template goes to `chat_template.jinja`, or inside `tokenizer_config.json` when
    `template_in_config` is true (the older checkpoint layout). Every id is < `vocab_size`.
    """
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    tokenizer = _train(vocab_size)
    if tokenizer.get_vocab_size() > vocab_size:
        raise ValueError(f"tokenizer has {tokenizer.get_vocab_size()} ids, more than vocab_size={vocab_size}")
    tokenizer.save(str(directory / "tokenizer.json"))

    ids = {text: tokenizer.token_to_id(text) for text, _ in ADDED_TOKENS}
    config = {
        "tokenizer_class": "Qwen2Tokenizer",
        "add_prefix_space": False,
        "bos_token": None,
        "eos_token": "<|im_end|>",
        "pad_token": "<|endoftext|>",
        "unk_token": None,
        "errors": "replace",
        "model_max_length": 262144,
        "split_special_tokens": False,
        "clean_up_tokenization_spaces": False,
        "added_tokens_decoder": {
            str(ids[text]): {
                "content": text,
                "lstrip": False,
                "normalized": False,
                "rstrip": False,
                "single_word": False,
                "special": special,
            }
            for text, special in ADDED_TOKENS
        },
    }
    if template_in_config:
        config["chat_template"] = CHAT_TEMPLATE
    else:
        (directory / "chat_template.jinja").write_text(CHAT_TEMPLATE, encoding="utf-8")
    (directory / "tokenizer_config.json").write_text(json.dumps(config, indent=2, ensure_ascii=False), encoding="utf-8")

    generation = {
        "bos_token_id": ids["<|endoftext|>"],
        "eos_token_id": [ids["<|im_end|>"], ids["<|endoftext|>"]],
        "pad_token_id": ids["<|endoftext|>"],
        "do_sample": True,
        "temperature": 0.6,
        "top_k": 20,
        "top_p": 0.95,
    }
    (directory / "generation_config.json").write_text(json.dumps(generation, indent=2), encoding="utf-8")
    return directory
