"""Device-memory check before a load: refuse what cannot fit before any weight moves.

The footprint counts what `load_model` and one session put on the device: the non-expert
weights as stored, the routed-expert records (all of them, or the staging slots in host mode),
one sequence's KV cache at full capacity and its GDN state. Activations of a forward are not
counted; `ninfer plan` gives the full budget including workspace and reserve.
"""

from __future__ import annotations

import torch

from ninfer_offload.artifact.inventory import Inventory
from ninfer_offload.errors import NinferError
from ninfer_offload.model.config import ModelConfig
from ninfer_offload.runtime.expert_store import slot_count

_GIB = 1024**3
_ROUTED = ("routed_gate_up", "routed_down")


def load_footprint(
    inventory: Inventory,
    config: ModelConfig,
    experts: str,
    capacity: int,
    dtype: torch.dtype,
    mtp: bool,
    num_slots: int | None,
) -> dict[str, int]:
    """Device bytes of a load, by item: weights, experts, kv_cache, gdn_state."""
    components = ("text", "mtp") if mtp else ("text",)
    word = torch.finfo(dtype).bits // 8
    banks = [bank for c in components for bank in inventory.banks_of(c)]
    if experts == "resident":
        expert_bytes = sum(bank.bank_bytes for bank in banks)
    else:
        expert_bytes = slot_count(config.top_k, config.num_experts, num_slots) * max((bank.expert_bytes for bank in banks), default=0)
    attention_layers = len(config.attention_layers) + (1 if mtp else 0)
    gdn_layers = len(config.gdn_layers)
    return {
        "weights": sum(t.bytes for t in inventory.tensors if t.component in components and t.role not in _ROUTED),
        "experts": expert_bytes,
        "kv_cache": attention_layers * 2 * capacity * config.num_kv_heads * config.head_dim * word,
        "gdn_state": gdn_layers
        * (
            (config.linear_conv_kernel - 1) * config.conv_channels * word
            + config.linear_num_value_heads * config.linear_key_head_dim * config.linear_value_head_dim * 4
        ),
    }


def check_fits(footprint: dict[str, int], free_bytes: int, device: torch.device) -> None:
    """NinferError naming the biggest items and the options that shrink them when the load cannot fit."""
    need = sum(footprint.values())
    if need <= free_bytes:
        return
    items = ", ".join(f"{name} {size / _GIB:.2f} GiB" for name, size in sorted(footprint.items(), key=lambda kv: -kv[1]))
    raise NinferError(
        f"needs {need / _GIB:.2f} GiB of VRAM ({items}), {device} has {free_bytes / _GIB:.2f} GiB free; "
        "use --experts host, a lower --max-context, or see `ninfer plan` for what fits"
    )
