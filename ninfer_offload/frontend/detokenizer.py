"""Incremental detokenization: text deltas for a growing list of token ids."""

from __future__ import annotations

from collections.abc import Iterable

from tokenizers import Tokenizer

_INCOMPLETE = "\ufffd"


class IncrementalDecoder:
    """Feed token ids one batch at a time and get the new text.

    A delta never ends inside a UTF-8 character: while the decoded tail ends with U+FFFD (bytes
    of a character still missing) the text is held back. `flush()` returns whatever is held
    (with replacement characters if the sequence really ended mid-character). Only a short
    window of recent ids is decoded per call, so the cost per token is constant.
    """

    def __init__(self, tokenizer: Tokenizer, skip_special_tokens: bool = False):
        self._tokenizer = tokenizer
        self._skip_special_tokens = skip_special_tokens
        self._ids: list[int] = []
        self._prefix = 0  # window start: ids before it are already emitted
        self._read = 0  # ids up to here are emitted

    def _decode(self, ids: list[int]) -> str:
        return self._tokenizer.decode(ids, skip_special_tokens=self._skip_special_tokens)

    def feed(self, ids: int | Iterable[int]) -> str:
        """Append ids; return the text they complete (possibly empty)."""
        self._ids.extend([ids] if isinstance(ids, int) else ids)
        emitted = self._decode(self._ids[self._prefix : self._read])
        text = self._decode(self._ids[self._prefix :])
        if not text:  # ids that decode to nothing (skipped special tokens) leave the window
            self._prefix = self._read = len(self._ids)
            return ""
        if len(text) <= len(emitted) or text.endswith(_INCOMPLETE):
            return ""
        self._prefix, self._read = self._read, len(self._ids)
        return text[len(emitted) :]

    def flush(self) -> str:
        """The text still held back at the end of the sequence."""
        emitted = self._decode(self._ids[self._prefix : self._read])
        text = self._decode(self._ids[self._prefix :])
        self._prefix = self._read = len(self._ids)
        return text[len(emitted) :]
