"""Structured outputs: JSON grammars compiled by llguidance against the model's tokenizer, applied
as a mask on each step's logits.

`GrammarCompiler(frontend, vocab)` builds llguidance's view of the tokenizer once per model (its
tokens and stop ids). `json(schema)` returns a `GrammarConstraint` for one generation:
`mask(logits)` sets the logits of the tokens the grammar forbids to -inf and `accept(token)`
advances it. After each accepted token the next mask is computed on a worker thread (llguidance
releases the GIL), so it overlaps the model's forward instead of following it. With thinking on,
the grammar starts after the reasoning closes (`</think>`): the model reasons freely, then
answers in the grammar.
"""

from __future__ import annotations

from concurrent.futures import Future, ThreadPoolExecutor

import llguidance
import numpy as np
import torch

from ninfer_offload.errors import NinferError

REASONING_END = "</think>"
_MASKS = ThreadPoolExecutor(max_workers=2, thread_name_prefix="ninfer-grammar")


class GrammarConstraint:
    """One generation's grammar state: masks logits, follows the sampled tokens."""

    def __init__(self, matcher: llguidance.LLMatcher, vocab: int, start_after: int | None):
        self.matcher = matcher
        self.vocab = vocab
        self.start_after = start_after  # the token that opens the grammar (None: from the first token)
        self._next: Future | None = None if start_after is not None else _MASKS.submit(self._allowed)

    @property
    def active(self) -> bool:
        return self.start_after is None

    def mask(self, logits: torch.Tensor) -> None:
        """Set the logits [vocab] of forbidden tokens to -inf, in place (nothing before the grammar starts)."""
        if not self.active:
            return
        allowed = torch.from_numpy(self._next.result()).to(logits.device)
        width = min(logits.shape[-1], allowed.shape[0])
        logits[..., width:] = -torch.inf
        logits[..., :width].masked_fill_(~allowed[:width], -torch.inf)

    def accept(self, token: int) -> None:
        """Advance past the sampled `token` and start computing the next mask."""
        if not self.active:
            if token == self.start_after:
                self.start_after = None
                self._next = _MASKS.submit(self._allowed)
            return
        self._next.result()  # the matcher is busy until the pending mask is computed
        if not self.matcher.consume_token(token):
            raise NinferError(f"the sampled token {token} breaks the response grammar: {self.matcher.get_error()}")
        self._next = _MASKS.submit(self._allowed)

    def _allowed(self) -> np.ndarray:
        bits = np.frombuffer(self.matcher.compute_bitmask(), dtype=np.uint8)
        return np.unpackbits(bits, bitorder="little")[: self.vocab].astype(bool)


class GrammarCompiler:
    """llguidance's tokenizer for one model, and grammars compiled against it."""

    def __init__(self, tokenizer_json: str, vocab: int, stop_ids: set[int], reasoning_end: int | None):
        self.vocab = vocab
        self.reasoning_end = reasoning_end
        self.tokenizer = llguidance.LLTokenizer(tokenizer_json, n_vocab=vocab, eos_token=sorted(stop_ids))

    @classmethod
    def for_frontend(cls, frontend, vocab: int) -> GrammarCompiler:
        """For `frontend` (a `Frontend`) and a model whose logits have `vocab` entries."""
        return cls(frontend.tokenizer.to_str(), vocab, frontend.stop_ids, frontend.tokenizer.token_to_id(REASONING_END))

    def json(self, schema: dict | None, thinking: bool) -> GrammarConstraint:
        """Output that is one JSON value matching `schema` (None: any JSON object); `thinking`: only
        after the reasoning closes. NinferError (a client error) for a schema llguidance refuses."""
        try:
            grammar = llguidance.LLMatcher.grammar_from_json_schema(schema if schema is not None else {"type": "object"})
        except (ValueError, TypeError) as err:
            raise NinferError(f"invalid JSON schema: {err}") from None
        problem = llguidance.LLMatcher.validate_grammar(grammar, self.tokenizer)
        if problem:
            raise NinferError(f"invalid JSON schema: {problem.splitlines()[0]}")
        matcher = llguidance.LLMatcher(self.tokenizer, grammar, log_level=0)
        if matcher.is_error():
            raise NinferError(f"invalid JSON schema: {matcher.get_error()}")
        return GrammarConstraint(matcher, self.vocab, self.reasoning_end if thinking else None)
