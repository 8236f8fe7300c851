"""Tokenizer, stop ids and incremental detokenizer against transformers on the tiny tokenizer files."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from transformers import AutoTokenizer

from ninfer_offload.errors import NinferError
from ninfer_offload.frontend import Frontend
from ninfer_offload.convert.tiny_tokenizer import write_tokenizer_files

TEXTS = [
    "Hello world, the experts are busy today.",
    "<|im_start|>user\nWhat is 12 plus 30?<|im_end|>\n<|im_start|>assistant\n<think>\n",
    "café naïve Zürich 東京 Москва 🙂 and a tab\tthen  two spaces   \n\n\nnewlines",
    "def add(a, b):\n    return a + b  # it's fine, they'll see\r\n",
    "Numbers 3.14159 and 1,000,000 on 2026-11-29",
    "",
]


@pytest.fixture(scope="module")
def tokenizer_dir(tmp_path_factory):
    return write_tokenizer_files(tmp_path_factory.mktemp("tok"))


@pytest.fixture(scope="module")
def frontend(tokenizer_dir):
    return Frontend.from_directory(tokenizer_dir)


@pytest.fixture(scope="module")
def hf(tokenizer_dir):
    return AutoTokenizer.from_pretrained(str(tokenizer_dir))


def test_fixture_is_deterministic_and_within_vocab(tmp_path, tokenizer_dir):
    again = write_tokenizer_files(tmp_path / "again")
    assert (again / "tokenizer.json").read_bytes() == (tokenizer_dir / "tokenizer.json").read_bytes()
    small = Frontend.from_directory(write_tokenizer_files(tmp_path / "small", vocab_size=320))
    assert small.vocab_size <= 320
    assert max(small.encode(" ".join(TEXTS))) < 320


@pytest.mark.parametrize("text", TEXTS)
def test_ids_equal_transformers(frontend, hf, text):
    ids = frontend.encode(text)
    assert ids == hf.encode(text, add_special_tokens=False)
    assert frontend.decode(ids) == hf.decode(ids) == text
    assert frontend.decode(ids, skip_special_tokens=True) == hf.decode(ids, skip_special_tokens=True)


def test_special_tokens_are_single_ids(frontend):
    for token in ("<|im_start|>", "<|im_end|>", "<|endoftext|>", "<think>", "</think>", "<tool_call>", "</tool_response>"):
        ids = frontend.encode(token)
        assert len(ids) == 1 and ids[0] < 512


def test_stop_ids_from_generation_config_and_eos(frontend, hf):
    assert frontend.stop_ids == {hf.convert_tokens_to_ids("<|im_end|>"), hf.convert_tokens_to_ids("<|endoftext|>")}
    assert frontend.special_tokens == {"eos_token": "<|im_end|>", "pad_token": "<|endoftext|>"}


@pytest.mark.parametrize("text", TEXTS[:4])
def test_incremental_decoder_streams_whole_characters(frontend, text):
    ids = frontend.encode(text)
    decoder = frontend.incremental_decoder()
    deltas = [decoder.feed(token) for token in ids]
    deltas.append(decoder.flush())
    assert "".join(deltas) == text
    assert all("\ufffd" not in delta for delta in deltas)


@settings(max_examples=200, deadline=None)
@given(ids=st.lists(st.integers(0, 511), max_size=40), chunk=st.integers(1, 4))
def test_incremental_decoder_reassembles_any_id_sequence(frontend, ids, chunk):
    decoder = frontend.incremental_decoder()
    deltas = [decoder.feed(ids[i : i + chunk]) for i in range(0, len(ids), chunk)]
    assert "".join(deltas) + decoder.flush() == frontend.decode(ids)


def test_incremental_decoder_holds_split_character_until_complete(frontend):
    ids = frontend.encode("東")  # one character, several byte-level tokens
    assert len(ids) > 1
    decoder = frontend.incremental_decoder()
    assert [decoder.feed(token) for token in ids[:-1]] == [""] * (len(ids) - 1)
    assert decoder.feed(ids[-1]) == "東"


def test_incremental_decoder_flushes_an_unfinished_character(frontend):
    ids = frontend.encode("東")
    decoder = frontend.incremental_decoder()
    assert decoder.feed(ids[:1]) == ""
    assert decoder.flush() == "\ufffd"


def test_incremental_decoder_can_skip_special_tokens(frontend):
    ids = frontend.encode("<|im_start|>assistant\nhi<|im_end|>")
    decoder = frontend.incremental_decoder(skip_special_tokens=True)
    assert "".join(decoder.feed(token) for token in ids) + decoder.flush() == "assistant\nhi"


def test_missing_tokenizer_is_a_clear_error(tmp_path):
    with pytest.raises(NinferError, match="no tokenizer.json"):
        Frontend.from_directory(tmp_path)


def test_broken_resources_are_clear_errors(tmp_path, tokenizer_dir):
    (tmp_path / "tokenizer.json").write_text("{not json")
    with pytest.raises(NinferError, match="tokenizer.json cannot be loaded"):
        Frontend.from_directory(tmp_path)
    (tmp_path / "tokenizer.json").write_bytes((tokenizer_dir / "tokenizer.json").read_bytes())
    (tmp_path / "generation_config.json").write_text("[1, 2]")
    with pytest.raises(NinferError, match="generation_config.json must hold a JSON object"):
        Frontend.from_directory(tmp_path)


def test_from_artifact_reads_the_text_resources(tmp_path, tokenizer_dir, frontend):
    from ninfer_offload import open_artifact
    from ninfer_offload.artifact.writer import ArtifactWriter

    writer = ArtifactWriter(tmp_path / "resources.ninfer")
    writer.add_component("text", {"model_type": "qwen3_5_moe_text"})
    for role in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja", "generation_config.json"):
        writer.add_resource(f"resource/text/{role}", (tokenizer_dir / role).read_bytes(), component="text", role=role)
    with open_artifact(writer.write()) as artifact:
        loaded = Frontend.from_artifact(artifact)
        messages = [{"role": "user", "content": "Hello there"}]
        assert loaded.render(messages) == frontend.render(messages)
        assert loaded.encode(TEXTS[2]) == frontend.encode(TEXTS[2])
        assert loaded.stop_ids == frontend.stop_ids
        override = Frontend.from_artifact(artifact, chat_template="{{ messages[0].content }}!")
        assert override.render(messages) == "Hello there!"
