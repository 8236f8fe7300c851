"""Reasoning split for Qwen3-style output: one parser (`ReasoningStream`) for streamed and whole replies.

With thinking on, text before `</think>` is reasoning, whether or not the output repeats the
opening `<think>` (Qwen3.6's chat template already puts `<think>\\n` into the prompt); a reply that
never closes the block (cut off while thinking) is all reasoning. When the prompt itself closed
the thinking block (`enable_thinking=False`), everything is content.
"""

from __future__ import annotations

from ninfer_offload.serve.stops import partial_match_length

THINK_OPEN = "<think>"
THINK_CLOSE = "</think>"


def prompt_leaves_thinking_open(prompt: str) -> bool:
    """False when the prompt's last think tag is `</think>` (thinking switched off or already done)."""
    return THINK_CLOSE not in prompt or prompt.rfind(THINK_CLOSE) < prompt.rfind(THINK_OPEN)


def split_reasoning(text: str, thinking: bool = True) -> tuple[str | None, str | None]:
    """(reasoning, content) of a whole output, as the streamed split gives them; reasoning is None
    when thinking is off, content None when empty."""
    stream = ReasoningStream(thinking)
    parts = [stream.feed(text), stream.flush()]
    reasoning, content = "".join(p[0] for p in parts), "".join(p[1] for p in parts)
    return (reasoning if thinking else None), content or None


class ReasoningStream:
    """Streaming split: deltas before `</think>` are reasoning, after it content."""

    def __init__(self, thinking: bool) -> None:
        self.thinking = thinking
        self._pending = ""

    def feed(self, delta: str) -> tuple[str, str]:
        """(reasoning delta, content delta) for one text delta; tags themselves are dropped."""
        if not self.thinking:
            return "", delta
        text = self._pending + delta
        close = text.find(THINK_CLOSE)
        if close >= 0:
            self.thinking = False
            self._pending = ""
            return text[:close].replace(THINK_OPEN, ""), text[close + len(THINK_CLOSE) :]
        keep = partial_match_length(text, (THINK_OPEN, THINK_CLOSE))
        self._pending = text[len(text) - keep :]
        return text[: len(text) - keep].replace(THINK_OPEN, ""), ""

    def flush(self) -> tuple[str, str]:
        """What was held back as a possible tag start, at the end of the output."""
        text, self._pending = self._pending, ""
        return (text, "") if self.thinking else ("", text)
