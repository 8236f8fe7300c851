"""The tiny tokenizer files of the package's tiny checkpoint (`ninfer_offload.convert.tiny_tokenizer`), for tests."""

from ninfer_offload.convert.tiny_tokenizer import ADDED_TOKENS, CHAT_TEMPLATE, write_tokenizer_files

__all__ = ["ADDED_TOKENS", "CHAT_TEMPLATE", "write_tokenizer_files"]
