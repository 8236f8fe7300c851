"""The OpenAI `logprobs` objects of a reply, from the per-token log-probabilities the engine
thread records (`RequestHandle.logprobs`, aligned with the tokens handed out)."""

from __future__ import annotations

from typing import Any


def _entry(frontend: Any, token: int, logprob: float) -> dict:
    text = frontend.decode([token])
    return {"token": text, "logprob": logprob, "bytes": list(text.encode("utf-8"))}


def chat_logprobs(frontend: Any, generation: Any, start: int) -> dict:
    """`choices[].logprobs` of a chat reply for the tokens from `start` on."""
    pairs = list(zip(generation.tokens, generation.handle.logprobs))[start:]
    return {
        "content": [
            {**_entry(frontend, token, lp.logprob), "top_logprobs": [_entry(frontend, t, v) for t, v in lp.top]}
            for token, lp in pairs
        ]
    }


def completion_logprobs(frontend: Any, generation: Any, start: int, offset: int) -> dict:
    """The legacy completions `logprobs` object for the tokens from `start` on, whose text begins
    at character `offset` of the reply."""
    pairs = list(zip(generation.tokens, generation.handle.logprobs))[start:]
    texts = [frontend.decode([token]) for token, _ in pairs]
    offsets = []
    for text in texts:
        offsets.append(offset)
        offset += len(text)
    return {
        "tokens": texts,
        "token_logprobs": [lp.logprob for _, lp in pairs],
        "top_logprobs": [{frontend.decode([t]): v for t, v in lp.top} for _, lp in pairs],
        "text_offset": offsets,
    }
