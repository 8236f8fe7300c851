"""The text frontend of a model: tokenizer, chat template and stop ids from its resources."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

from tokenizers import Tokenizer

from ninfer_offload.errors import NinferError
from ninfer_offload.frontend.chat_template import ChatTemplate
from ninfer_offload.frontend.detokenizer import IncrementalDecoder

# The named special tokens transformers hands to chat templates as variables.
SPECIAL_TOKEN_NAMES = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token")


def _token_text(value: Any) -> str | None:
    """A special token from tokenizer_config.json: a string or a serialised AddedToken."""
    if isinstance(value, dict):
        value = value.get("content")
    return value if isinstance(value, str) else None


def _json(data: bytes | None, role: str) -> dict:
    if data is None:
        return {}
    try:
        value = json.loads(data)
    except (UnicodeDecodeError, json.JSONDecodeError) as err:
        raise NinferError(f"{role} is not valid JSON: {err}") from None
    if not isinstance(value, dict):
        raise NinferError(f"{role} must hold a JSON object")
    return value


def _config_template(config: dict) -> str | None:
    """The template stored inside tokenizer_config.json: a string, or the "default" entry of a
    list of {name, template}."""
    template = config.get("chat_template")
    if isinstance(template, list):
        templates = {item.get("name"): item.get("template") for item in template if isinstance(item, dict)}
        template = templates.get("default")
    return template if isinstance(template, str) else None


class Frontend:
    """Tokenizer (`tokenizers`), chat template (sandboxed jinja2) and stop ids of one model."""

    def __init__(
        self,
        tokenizer: Tokenizer,
        tokenizer_config: dict,
        generation_config: dict,
        chat_template: str | None,
    ):
        self.tokenizer = tokenizer
        self.tokenizer_config = tokenizer_config
        self.generation_config = generation_config
        self.special_tokens = {
            name: text for name in SPECIAL_TOKEN_NAMES if (text := _token_text(tokenizer_config.get(name))) is not None
        }
        self.template = ChatTemplate(chat_template, self.special_tokens) if chat_template is not None else None
        self.stop_ids = self._stop_ids()

    @classmethod
    def from_resources(cls, read: Callable[[str], bytes | None], chat_template: str | None = None) -> Frontend:
        """Build from a resource reader (role -> bytes, None when absent). `chat_template` (template
        text) overrides `chat_template.jinja`, which overrides the template in tokenizer_config.json."""
        data = read("tokenizer.json")
        if data is None:
            raise NinferError("the model has no tokenizer.json resource")
        try:
            tokenizer = Tokenizer.from_str(data.decode("utf-8"))
        except Exception as err:  # the tokenizers library raises its own exception types
            raise NinferError(f"tokenizer.json cannot be loaded: {err}") from None
        config = _json(read("tokenizer_config.json"), "tokenizer_config.json")
        generation = _json(read("generation_config.json"), "generation_config.json")
        if chat_template is None:
            template_file = read("chat_template.jinja")
            chat_template = template_file.decode("utf-8") if template_file is not None else _config_template(config)
        return cls(tokenizer, config, generation, chat_template)

    @classmethod
    def from_artifact(cls, artifact, chat_template: str | None = None) -> Frontend:
        """Build from the text resources of an opened `.ninfer` artifact."""
        roles = {role for component in artifact.components.values() for role in component.resources}
        return cls.from_resources(lambda role: artifact.resource(role) if role in roles else None, chat_template)

    @classmethod
    def from_directory(cls, directory: str | Path, chat_template: str | None = None) -> Frontend:
        """Build from a Hugging Face checkpoint directory (tokenizer.json, tokenizer_config.json, ...)."""
        root = Path(directory)

        def read(role: str) -> bytes | None:
            path = root / role
            return path.read_bytes() if path.is_file() else None

        return cls.from_resources(read, chat_template)

    def _stop_ids(self) -> set[int]:
        eos = self.generation_config.get("eos_token_id")
        ids = {eos} if isinstance(eos, int) else {i for i in eos or [] if isinstance(i, int)}
        if "eos_token" in self.special_tokens:
            token = self.tokenizer.token_to_id(self.special_tokens["eos_token"])
            if token is not None:
                ids.add(token)
        return ids

    @property
    def vocab_size(self) -> int:
        """Number of token ids the tokenizer knows (added tokens included)."""
        return self.tokenizer.get_vocab_size(with_added_tokens=True)

    def encode(self, text: str) -> list[int]:
        """Token ids of `text`; special-token strings in the text become their ids. (The batch call
        releases the GIL while it works, so other threads keep running during a long prompt.)"""
        return self.tokenizer.encode_batch_fast([text], add_special_tokens=False)[0].ids

    def decode(self, ids: list[int], skip_special_tokens: bool = False) -> str:
        """Text of `ids`."""
        return self.tokenizer.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def incremental_decoder(self, skip_special_tokens: bool = False) -> IncrementalDecoder:
        """A decoder that turns streamed ids into text deltas without splitting characters."""
        return IncrementalDecoder(self.tokenizer, skip_special_tokens)

    def render(
        self,
        messages: list[dict],
        tools: list[dict] | None = None,
        enable_thinking: bool = True,
        add_generation_prompt: bool = True,
        **options: Any,
    ) -> str:
        """The prompt text of a conversation, rendered with the model's chat template."""
        if self.template is None:
            raise NinferError("the model has no chat template; pass one with --chat-template FILE")
        return self.template.render(
            messages, tools=tools, add_generation_prompt=add_generation_prompt, enable_thinking=enable_thinking, **options
        )
