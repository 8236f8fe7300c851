"""Pooled sequence state: per layer one tensor over every sequence slot, allocated once at load.

Attention layers keep K and V as flat row pools `[slots * capacity + scratch rows, Hkv, D]`: slot s
owns rows [s * capacity, (s + 1) * capacity). Gated DeltaNet layers keep their conv window
`[slots + 1, W - 1, C]` and FP32 recurrent state `[slots + 1, Hv, Dk, Dv]`, plus, when the engine
can roll back multi-token steps, the state after each token but the last
(`[slots + 1, draft_tokens, ...]`); each of these four is a view of one tensor over the GDN layers, so a
slot's reset (a new sequence) and restore (a rollback) are one copy per kind. Slot `slots` is a scratch slot: padded rows of a captured
batch write there (its KV rows are the last rows of the pool: as many as the longest captured step writes
per sequence, `scratch_rows` or the step tokens if more), so padding never touches a live sequence. Buffers
never move, so captured steps stay valid.
"""

from __future__ import annotations

import torch

from ninfer_offload.artifact.dims import FULL_ATTENTION, ModelDims


class StatePool:
    """State of `sequences` slots (plus the scratch slot) for the layers `layer_kinds` (key -> kind)."""

    def __init__(
        self,
        config: ModelDims,
        layer_kinds: dict[int, str],
        sequences: int,
        capacity: int,
        draft_tokens: int,
        device: torch.device,
        dtype: torch.dtype,
        kv_dtype: torch.dtype,
        scratch_rows: int,
        prompt_rows: int,
    ):
        self.sequences = sequences
        self.capacity = capacity
        self.draft_tokens = draft_tokens
        self.scratch_rows = scratch_rows
        self.prompt_rows = prompt_rows  # a captured prompt chunk's rows (one sequence's)
        self.scratch_slot = sequences
        self.kv: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        slots = sequences + 1
        gdn = [key for key, kind in layer_kinds.items() if kind != FULL_ATTENTION]
        conv_shape = (config.linear_conv_kernel - 1, config.conv_channels)
        recurrent_shape = (config.linear_num_value_heads, config.linear_key_head_dim, config.linear_value_head_dim)
        # Each kind of GDN state is one tensor over the layers ([layers, slots, ...]; a layer's is a contiguous view),
        # so a slot is reset or restored in one launch per kind rather than one per layer.
        self._conv = torch.zeros(len(gdn), slots, *conv_shape, device=device, dtype=dtype)
        self._recurrent = torch.zeros(len(gdn), slots, *recurrent_shape, device=device, dtype=torch.float32)
        self._conv_snapshots = torch.zeros(len(gdn), slots, draft_tokens, *conv_shape, device=device, dtype=dtype)
        self._recurrent_snapshots = torch.zeros(len(gdn), slots, draft_tokens, *recurrent_shape, device=device, dtype=torch.float32)
        self.conv = {key: self._conv[i] for i, key in enumerate(gdn)}
        self.recurrent = {key: self._recurrent[i] for i, key in enumerate(gdn)}
        self.conv_snapshots = {key: self._conv_snapshots[i] for i, key in enumerate(gdn)} if draft_tokens else {}
        self.recurrent_snapshots = {key: self._recurrent_snapshots[i] for i, key in enumerate(gdn)} if draft_tokens else {}
        for key, kind in layer_kinds.items():
            if kind == FULL_ATTENTION:
                rows = (sequences * capacity + max(scratch_rows, self.step_tokens), config.num_kv_heads, config.head_dim)
                self.kv[key] = (torch.zeros(rows, device=device, dtype=kv_dtype), torch.zeros(rows, device=device, dtype=kv_dtype))

    @property
    def step_tokens(self) -> int:
        """Most tokens one sequence may add in one step (1 + the drafts a step can verify)."""
        return 1 + self.draft_tokens

    @property
    def attention_rows(self) -> int:
        """Most token rows one step attends with: every sequence's step tokens, or a captured prompt chunk (the
        decode attention's split follows it; a batched prefill of more rows splits by its own)."""
        return max(self.sequences * self.step_tokens, self.prompt_rows)

    def tensors(self) -> list[torch.Tensor]:
        """Every buffer of the pool."""
        groups = (self.conv, self.recurrent, self.conv_snapshots, self.recurrent_snapshots)
        return [t for pair in self.kv.values() for t in pair] + [t for group in groups for t in group.values()]

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.tensors())

    def kv_of(self, key: int, slot: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Views [capacity, Hkv, D] of one slot's K and V rows."""
        k, v = self.kv[key]
        rows = slice(slot * self.capacity, (slot + 1) * self.capacity)
        return k[rows], v[rows]

    def reset(self, slot: int) -> None:
        """Zero the GDN state of `slot` (a new sequence starts from zero state; its KV rows need no reset)."""
        self._conv[:, slot].zero_()
        self._recurrent[:, slot].zero_()

    def gdn_state(self, slot: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Views of the GDN conv windows [layers, W - 1, C] and recurrent states [layers, Hv, Dk, Dv] of `slot`."""
        return self._conv[:, slot], self._recurrent[:, slot]

    def set_gdn_state(self, slot: int, conv: torch.Tensor, recurrent: torch.Tensor) -> None:
        """Make the GDN state of `slot` a saved one (`gdn_state`'s shapes; a copy queued on the device's stream)."""
        self._conv[:, slot].copy_(conv, non_blocking=True)
        self._recurrent[:, slot].copy_(recurrent, non_blocking=True)

    def restore(self, slot: int, token: int) -> None:
        """Make the GDN state of `slot` the state kept after token `token` of the last multi-token step."""
        self._conv[:, slot].copy_(self._conv_snapshots[:, slot, token])
        self._recurrent[:, slot].copy_(self._recurrent_snapshots[:, slot, token])
