"""Structured outputs: JSON grammars compiled by llguidance against the model's tokenizer, applied
as a mask on each step's logits.

`GrammarCompiler(frontend, vocab)` builds llguidance's view of the tokenizer once per model (its
tokens and stop ids). `json(schema)` returns a `GrammarConstraint` for one generation:
`mask(logits)` sets the logits of the tokens the grammar forbids to -inf and `accept(token)`
advances it. After each accepted token the next mask is computed on a worker thread (llguidance
releases the GIL), so it overlaps the model's forward instead of following it. With thinking on,
the grammar starts after the reasoning closes (`</think>`): the model reasons freely (but cannot
end its turn there), then answers in the grammar. JSON is compact: no whitespace between its tokens (a
model cannot spend its budget on blank space).
"""

from __future__ import annotations

import json
import re
from concurrent.futures import Future, ThreadPoolExecutor

import llguidance
import numpy as np
import torch

from ninfer_offload.errors import NinferError

REASONING_START, REASONING_END = "<think>", "</think>"
_MASKS = ThreadPoolExecutor(max_workers=2, thread_name_prefix="ninfer-grammar")
_COMPACT = {"whitespace_flexible": False}  # llguidance's JSON options: fixed separators, no free whitespace
_CARET_LINE = re.compile(r"^\s*\^+\s*$")


def _one_line(problem: str) -> str:
    """llguidance's multi-line message (a regex error with a caret line under it) on one line."""
    return " ".join(line.strip() for line in problem.splitlines() if line.strip() and not _CARET_LINE.match(line))


def schema_problem(schema: dict) -> str | None:
    """Why llguidance cannot use `schema` as a JSON schema, in one line; None when it can."""
    try:
        problem = llguidance.LLMatcher.validate_grammar(llguidance.LLMatcher.grammar_from_json_schema(schema), None)
    except (ValueError, TypeError) as err:
        problem = str(err)
    return _one_line(problem) if problem else None


class GrammarConstraint:
    """One generation's grammar state: masks logits, follows the sampled tokens."""

    def __init__(self, matcher: llguidance.LLMatcher, vocab: int, start_after: int | None, stop_ids: list[int]):
        self.matcher = matcher
        self.vocab = vocab
        self.start_after = start_after  # the token that opens the grammar (None: from the first token)
        self.stop_ids = stop_ids  # forbidden before the grammar starts: the turn cannot end before its answer
        self._next: Future | None = None if start_after is not None else _MASKS.submit(self._allowed)

    @property
    def active(self) -> bool:
        return self.start_after is None

    def mask(self, logits: torch.Tensor) -> None:
        """Set the logits [vocab] of forbidden tokens to -inf, in place (only the stop ids before the grammar starts)."""
        if not self.active:
            logits[..., self.stop_ids] = -torch.inf
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

    def __init__(self, tokenizer_json: str, vocab: int, stop_ids: set[int], reasoning_end: int | None, reasoning_tags: list[str]):
        self.vocab = vocab
        self.stop_ids = sorted(stop_ids)
        self.reasoning_end = reasoning_end
        self.reasoning_tags = reasoning_tags  # the tokenizer's <think> and </think> tokens (free text may hold them)
        try:
            self.tokenizer = llguidance.LLTokenizer(tokenizer_json, n_vocab=vocab, eos_token=self.stop_ids)
        except Exception as err:  # noqa: BLE001 - llguidance raises its own types
            raise NinferError(f"llguidance cannot use the model's tokenizer: {_one_line(str(err))}") from None

    @classmethod
    def for_frontend(cls, frontend, vocab: int) -> GrammarCompiler:
        """For `frontend` (a `Frontend`) and a model whose logits have `vocab` entries; NinferError when
        llguidance cannot use its tokenizer."""
        tokenizer = frontend.tokenizer
        tags = [tag for tag in (REASONING_START, REASONING_END) if tokenizer.token_to_id(tag) is not None]
        return cls(tokenizer.to_str(), vocab, frontend.stop_ids, tokenizer.token_to_id(REASONING_END), tags)

    def json(self, schema: dict | None, thinking: bool) -> GrammarConstraint:
        """Output that is one JSON value matching `schema` (None: any JSON object); `thinking`: only
        after the reasoning closes. NinferError (a client error) for a schema llguidance refuses."""
        try:
            schema = schema if schema is not None else {"type": "object"}
            grammar = llguidance.LLMatcher.grammar_from_json_schema(schema, defaults=_COMPACT)
        except (ValueError, TypeError) as err:
            raise NinferError(f"invalid JSON schema: {err}") from None
        return self._constraint(grammar, self.reasoning_end if thinking else None, "JSON schema")

    def tool_calls(self, tools: list[dict], forced: bool = False, parallel: bool = True, thinking: bool = False) -> GrammarConstraint:
        """Free text (reasoning and content), then only well-formed tool calls (the model's XML format)
        to the given OpenAI `tools`, with each argument valid against its parameter's schema. `forced`:
        no content, at least one call (with `thinking`, after the reasoning closes); `parallel` False:
        at most one call."""
        grammar = llguidance.LLMatcher.grammar_from_lark(tool_call_grammar(tools, self.reasoning_tags, forced, parallel))
        return self._constraint(grammar, self.reasoning_end if forced and thinking else None, "tool schema")

    def _constraint(self, grammar: str, start_after: int | None, source: str) -> GrammarConstraint:
        """A constraint of a compiled grammar; NinferError naming `source` when llguidance refuses it."""
        problem = llguidance.LLMatcher.validate_grammar(grammar, self.tokenizer)
        matcher = None if problem else llguidance.LLMatcher(self.tokenizer, grammar, log_level=0)
        if problem or matcher.is_error():
            raise NinferError(f"invalid {source}: {_one_line(problem or matcher.get_error())}")
        return GrammarConstraint(matcher, self.vocab, start_after, self.stop_ids)


def _is_free_string(spec: object) -> bool:
    """A plain string parameter (no enum, pattern or limits): its value is free text."""
    return isinstance(spec, dict) and spec.get("type") == "string" and not set(spec) - {"type", "description", "title"}


def tool_call_grammar(tools: list[dict], reasoning_tags: list[str], forced: bool = False, parallel: bool = True) -> str:
    """A Lark grammar (llguidance dialect) of free text followed by tool calls in the model's format

        <tool_call>⏎<function=NAME>⏎<parameter=P>⏎VALUE⏎</parameter>⏎...</function>⏎</tool_call>[⏎]

    Parameters come in their schema's order, the required ones mandatory; a plain string value is
    free text, any other value is compact JSON valid against its schema. The text before the calls may hold
    the `reasoning_tags` tokens. `forced`: no free text, one call or more; `parallel` False: one call at most."""
    newline, close_parameter, close_function = json.dumps("\n"), json.dumps("\n</parameter>\n"), json.dumps("</function>\n")
    functions = " | ".join(f"function_{i}" for i in range(len(tools)))
    calls = ("call+" if parallel else "call") if forced else ("call*" if parallel else "call?")
    rules = [f"start: {calls}" if forced else f"start: free {calls}"]
    if not forced:
        rules += ["free: (" + " | ".join(["TEXT", *reasoning_tags]) + ")*", r"TEXT: /(?s:.*)/ & ~/(?s:.*<tool_call>.*)/"]
    rules += [
        r"free_value[lazy]: /(?s:.*)\n<\/parameter>\n/",  # the shortest text that closes the parameter
        f"call: <tool_call> {newline} ({functions}) </tool_call> {newline}?",
    ]
    for i, tool in enumerate(tools):
        function = tool["function"]
        schema = function.get("parameters") or {}
        required = set(schema.get("required") or [])
        parameters = []
        for j, (name, spec) in enumerate((schema.get("properties") or {}).items()):
            if _is_free_string(spec):
                value = "free_value"
            else:
                value = f"value_{i}_{j} {close_parameter}"
                value_schema = {**(spec if isinstance(spec, dict) else {}), "x-guidance": _COMPACT}
                rules.append(f"value_{i}_{j}: %json {json.dumps(value_schema)}")
            rules.append(f"parameter_{i}_{j}: {json.dumps(f'<parameter={name}>')} {newline} {value}")
            parameters.append(f"parameter_{i}_{j}" + ("" if name in required else "?"))
        opening = json.dumps(f"<function={function['name']}>")
        rules.append(f"function_{i}: {opening} {newline} {' '.join(parameters)} {close_function}")
    return "\n".join(rules) + "\n"
