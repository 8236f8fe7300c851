"""Stop strings over a stream of text deltas, holding back only what could still become a match."""

from __future__ import annotations

from collections.abc import Iterable


def partial_match_length(text: str, needles: Iterable[str]) -> int:
    """Length of the longest suffix of `text` that is a proper prefix of one of `needles`."""
    best = 0
    for needle in needles:
        for k in range(min(len(needle) - 1, len(text)), best, -1):
            if text.endswith(needle[:k]):
                best = k
                break
    return best


class StopMatcher:
    """Feed text deltas; get back the text safe to emit and whether a stop string was reached.

    The returned text never contains a stop string (OpenAI semantics: the stop string itself is
    not part of the output); text that might be the start of one is held until it is decided.
    """

    def __init__(self, stops: list[str]) -> None:
        self._stops = [s for s in stops if s]
        self._pending = ""
        self.matched: str | None = None  # the stop string that ended the text

    @property
    def stopped(self) -> bool:
        return self.matched is not None

    def feed(self, delta: str) -> str:
        if self.stopped:
            return ""
        text = self._pending + delta
        hits = [(at, stop) for stop in self._stops if (at := text.find(stop)) >= 0]
        if hits:
            at, self.matched = min(hits, key=lambda hit: hit[0])
            self._pending = ""
            return text[:at]
        keep = partial_match_length(text, self._stops)
        self._pending = text[len(text) - keep :]
        return text[: len(text) - keep]

    def flush(self) -> str:
        """The held-back text, once generation ended without completing a stop string."""
        text, self._pending = self._pending, ""
        return "" if self.stopped else text
