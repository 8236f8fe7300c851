"""One request's token stream turned into text: detokenize, apply stop strings, count, log."""

from __future__ import annotations

import logging
import time
from collections.abc import AsyncIterator

from ninfer_offload.serve.errors import APIError
from ninfer_offload.serve.scheduler import SHUTTING_DOWN, RequestHandle
from ninfer_offload.serve.stops import StopMatcher

log = logging.getLogger("ninfer.serve")


class TextGeneration:
    """Text deltas of one request; after `deltas()` ends: `finish_reason`, token counts.

    A stop string ends the request at once (the engine frees its state); the text returned
    excludes it. Leaving `deltas()` early (client gone) cancels the request.
    """

    def __init__(self, handle: RequestHandle, decoder, stop_strings: list[str]) -> None:
        self.handle = handle
        self.prompt_tokens = len(handle.request.prompt_ids)
        self.completion_tokens = 0
        self.finish_reason: str | None = None
        self.tokens: list[int] = []  # the ids handed out so far
        self._decoder = decoder
        self._stops = StopMatcher(stop_strings)

    async def deltas(self) -> AsyncIterator[str]:
        try:
            async for token in self.handle.tokens():
                self.completion_tokens += 1
                self.tokens.append(token)
                text = self._stops.feed(self._decoder.feed(token))
                if text:
                    yield text
                if self._stops.stopped:
                    self.finish_reason = "stop"
                    return
            finished = self.handle.finished
            if finished.reason == "error":
                raise APIError(500, f"generation failed: {finished.error}", code="engine_error")
            if finished.reason == "cancelled":
                raise APIError(503, finished.error or "request cancelled", code="cancelled")
            if finished.reason == "shutdown":
                raise APIError(503, finished.error or SHUTTING_DOWN, code="shutting_down")
            self.completion_tokens = finished.completion_tokens
            text = self._stops.feed(self._decoder.flush())
            text += self._stops.flush()
            if text:
                yield text
            self.finish_reason = "stop" if self._stops.stopped else finished.reason
        finally:
            self.handle.cancel()
            self._log()

    @property
    def stop_string(self) -> str | None:
        """The stop string that ended the text, None when none did."""
        return self._stops.matched

    def usage(self) -> dict:
        """The OpenAI `usage` object: token counts, the prompt tokens resumed from the prompt cache
        (`prompt_tokens_details.cached_tokens`), and `speculation` counts when the request decoded speculatively."""
        total = self.prompt_tokens + self.completion_tokens
        finished = self.handle.finished
        usage = {
            "prompt_tokens": self.prompt_tokens, "completion_tokens": self.completion_tokens, "total_tokens": total,
            "prompt_tokens_details": {"cached_tokens": finished.cached_tokens if finished is not None else 0},
        }
        if finished is not None and finished.speculation:
            usage["speculation"] = finished.speculation
        return usage

    def _log(self) -> None:
        t = self.handle.timings
        end = t.finished or time.perf_counter()
        ttft = f"{t.first_token - t.submitted:.3f}s" if t.first_token else "-"
        decode = end - t.first_token if t.first_token else 0.0
        rate = f"{(self.completion_tokens - 1) / decode:.1f} tok/s" if decode > 0 and self.completion_tokens > 1 else "-"
        finished = self.handle.finished
        hit_rate = finished.expert_hit_rate if finished else None
        speculation = finished.speculation if finished else None
        log.info(
            "%s prompt=%d cached=%d completion=%d queued=%.3fs ttft=%s total=%.3fs decode=%s finish=%s%s",
            self.handle.id,
            self.prompt_tokens,
            finished.cached_tokens if finished else 0,
            self.completion_tokens,
            (t.started or end) - t.submitted,
            ttft,
            end - t.submitted,
            rate,
            self.finish_reason or "cancelled",
            (f" expert_hit_rate={hit_rate:.3f}" if hit_rate is not None else "")
            + (f" drafts_accepted={speculation['accepted']}/{speculation['drafted']}" if speculation else ""),
        )
