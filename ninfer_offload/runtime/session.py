"""One sequence of an engine: its state slot, its length, and the pending tokens of a multi-token step.

    s = engine.session()
    s.prefill(prompt)             # logits of the last prompt token
    s.step(token)                 # one decode step, committed at once
    engine.step([s], [[a, b, c]]) # a multi-token step (speculative verification) stays pending...
    s.commit(2)                   # ...until the caller keeps its first 2 tokens (or s.rollback(1))
"""

from __future__ import annotations

import weakref
from collections.abc import Iterable

import torch

from ninfer_offload.errors import NinferError


class Session:
    """A sequence in one slot of the engine's state pool; `close` (or garbage collection) frees the slot."""

    def __init__(self, engine, slot: int):
        self.engine = engine
        self.slot: int | None = slot
        self.length = 0  # tokens in the sequence (committed)
        self.mtp_length = 0  # tokens in the MTP layer's own cache
        self.pending = 0  # tokens of the last multi-token step not yet committed or rolled back
        self._release = weakref.finalize(self, engine.release_slot, slot)

    def live_slot(self) -> int:
        """The slot; an error if the session is closed or a multi-token step awaits `commit`."""
        if self.slot is None:
            raise NinferError("this session is closed")
        if self.pending:
            raise NinferError(f"commit or roll back the pending {self.pending}-token step first")
        return self.slot

    def append(self, token_ids: Iterable[int]) -> tuple[torch.Tensor, torch.Tensor]:
        """Append `token_ids` as a prefill: (logits [T, vocab] float32 of every one, final-normed hidden states [T, H])."""
        hidden = self.engine.prefill(self, token_ids)
        return self.engine.logits_of(hidden), hidden

    def prefill(self, token_ids: Iterable[int]) -> torch.Tensor:
        """Append `token_ids` (may be called repeatedly: chunked prefill); logits [vocab] of the last one."""
        return self.engine.logits_of(self.engine.prefill(self, token_ids)[-1:])[0]

    def resume(self, match) -> None:
        """Start this (empty) session from a prompt cache match (`Engine.resume`): it then holds `match.tokens` tokens."""
        self.engine.resume(self, match)

    def remember(self, token_ids: Iterable[int], hidden: torch.Tensor | None = None) -> None:
        """Save this session's state in the engine's prompt cache under `token_ids`, the tokens it holds (`Engine.remember`)."""
        self.engine.remember(self, token_ids, hidden)

    def step(self, token_id: int) -> torch.Tensor:
        """Append one token as a decode step; its logits [vocab]."""
        return self.engine.step([self], [[token_id]])[0, 0]

    def commit(self, n: int) -> None:
        """Keep the first `n` tokens of the pending step (1 <= n <= pending): the sequence grows by n and
        its state becomes the state after its n-th token, as if the rest had never been seen."""
        if self.slot is None:
            raise NinferError("this session is closed")
        if not 1 <= n <= self.pending:
            raise NinferError(
                f"commit takes 1..{self.pending} tokens of the pending step, got {n}" if self.pending else "no step is pending"
            )
        if n < self.pending:
            self.engine.state.restore(self.slot, n - 1)
        self.length += n
        self.pending = 0

    def rollback(self, n: int) -> None:
        """Forget the last `n` tokens of the pending step (0 <= n < pending)."""
        if not 0 <= n < self.pending:
            raise NinferError(f"rollback takes 0..{self.pending - 1} tokens of the pending step, got {n}")
        self.commit(self.pending - n)

    def mtp(self, hidden: torch.Tensor, next_ids: Iterable[int], all_logits: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
        """Run the MTP module on target hidden states `hidden` [T, H] (positions continuing this
        session's MTP cache) and the tokens that follow them: (draft logits [T, vocab] (`all_logits` off: [1,
        vocab], the last position's), MTP hidden [T, H])."""
        return self.engine.mtp_prefill(self, hidden, next_ids, all_logits)

    def forget_mtp(self, n: int) -> None:
        """Drop the last `n` entries of the MTP layer's cache (speculative drafts)."""
        if not 0 <= n <= self.mtp_length:
            raise NinferError(f"the MTP cache holds {self.mtp_length} entries, cannot forget {n}")
        self.mtp_length -= n

    def close(self) -> None:
        """Free the slot (the session cannot be used afterwards)."""
        self.slot = None
        self.pending = 0
        self._release()
