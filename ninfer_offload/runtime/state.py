"""Per-sequence model state: KV cache of the attention layers, conv window and FP32 recurrent state of
the Gated DeltaNet layers. Buffers are allocated once at full capacity and updated in place, so a
decode step never reallocates (a prerequisite for CUDA-graph capture)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ninfer_offload.model.config import FULL_ATTENTION, ModelConfig


class SequenceState:
    """State of one sequence for the layers `layer_kinds` (state key -> "full_attention"/"linear_attention")."""

    def __init__(
        self, config: ModelConfig, layer_kinds: dict[int, str], capacity: int, device: torch.device, dtype: torch.dtype
    ):
        self.capacity = capacity
        self.length = 0
        self.kv: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        self.conv: dict[int, torch.Tensor] = {}
        self.recurrent: dict[int, torch.Tensor] = {}
        for key, kind in layer_kinds.items():
            if kind == FULL_ATTENTION:
                shape = (capacity, config.num_kv_heads, config.head_dim)
                self.kv[key] = (torch.zeros(shape, device=device, dtype=dtype), torch.zeros(shape, device=device, dtype=dtype))
            else:
                self.conv[key] = torch.zeros(config.linear_conv_kernel - 1, config.conv_channels, device=device, dtype=dtype)
                self.recurrent[key] = torch.zeros(
                    config.linear_num_value_heads,
                    config.linear_key_head_dim,
                    config.linear_value_head_dim,
                    device=device,
                    dtype=torch.float32,
                )


@dataclass(frozen=True)
class Segment:
    """`count` consecutive tokens of one sequence inside a forward batch: rows [offset, offset+count),
    positions [start, start+count) of `state`."""

    state: SequenceState
    start: int
    offset: int
    count: int

    @property
    def rows(self) -> slice:
        return slice(self.offset, self.offset + self.count)


def positions_of(segments: list[Segment], device: torch.device) -> torch.Tensor:
    """Absolute positions [T] of the batch rows (built on the host from Python ints, no device sync)."""
    positions = torch.cat([torch.arange(s.start, s.start + s.count) for s in segments])
    return positions.to(device, non_blocking=True)
