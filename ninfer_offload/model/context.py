"""The step context: what one forward knows about its tokens, built once by the runtime and read by
every layer (positions, state slots, lengths, KV write rows as device tensors), and what kind of
step it is (a prefill chunk, one whose host experts are staged): the one place a step's mode is read.

Rows are grouped by sequence. A decode step holds B sequences of T tokens each (sequence b owns
rows [b*T, (b+1)*T)); a prefill chunk holds one sequence of any number of tokens. Layers choose
their kernels from that shape alone: chunked prefill kernels for a prefill chunk of more than one
token, the batched decode kernels (indexed by slot) for everything else.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class StepContext:
    positions: torch.Tensor  # [N] int64: absolute position of each token row
    slots: torch.Tensor  # [B] int64: state slot of each sequence
    lengths: torch.Tensor  # [B] int64: tokens of each sequence after this step (its valid KV rows)
    # [B] int64: how many of each sequence's T rows are real tokens: T, but in a padded prefill (a short
    # prompt run as a captured step of a bucket's length), whose padding rows after the real ones are
    # computed and leave no GDN state behind (their KV rows lie past the real tokens and get overwritten).
    valid: torch.Tensor
    kv_rows: torch.Tensor  # [N] int64: row of the flat KV pool each token's keys and values go to
    tokens_per_sequence: int  # T (a prefill chunk: all of its rows)
    prefill: bool  # one sequence whose T tokens take the chunked prefill kernels
    keep_states: bool  # write each token's GDN state but the last (rollback of a multi-token step)
    # Host copies of `slots` and of the lengths before this step, for ops that slice on the host
    # (the reference backend, prefill). None in a captured step, whose device values change per replay.
    host_slots: tuple[int, ...] | None
    host_starts: tuple[int, ...] | None
    # A prompt chunk of the target run eagerly: the expert store copies the host experts its layers need into its
    # staging slots (`runtime.prefill_staging`, begun by `ExpertStore.around_step`). Never set in a captured step.
    staged: bool = False
    # A staged chunk of a span (`TextModel.hidden_chunks`: every layer runs over the span's chunks before the next
    # layer): the span's token rows, for which a layer's host experts are staged once (0: this chunk's own), and
    # where its rows start in the span (the chunk ending it closes each layer's staging).
    stage_tokens: int = 0
    span_row: int = 0

    @property
    def batch(self) -> int:
        return self.slots.shape[0]

    @property
    def chunked(self) -> bool:
        """Whether the mixers take their chunked prefill kernels."""
        return self.prefill and self.tokens_per_sequence > 1

    def host_view(self) -> tuple[tuple[int, ...], tuple[int, ...]]:
        """(slots, starts) on the host; an error in a captured step (whose values live on the device)."""
        if self.host_slots is None or self.host_starts is None:
            raise RuntimeError("this op reads host-side lengths and cannot run inside a captured step")
        return self.host_slots, self.host_starts
