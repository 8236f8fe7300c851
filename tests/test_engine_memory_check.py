"""The device-memory check that runs before a CUDA load: its footprint equals what a load and a
session really allocate, and a load that cannot fit is refused in one line."""

from __future__ import annotations

import pytest
import torch

from ninfer_offload import Engine, NinferError, open_artifact
from ninfer_offload.artifact.inventory import Inventory
from ninfer_offload.model.config import ModelConfig
from ninfer_offload.runtime.memory_check import check_fits, load_footprint

CAPACITY = 96


def footprint(path, experts: str, num_slots=None) -> dict[str, int]:
    with open_artifact(path) as artifact:
        config = ModelConfig.from_component(artifact.components["text"].config)
        return load_footprint(Inventory.from_artifact(artifact), config, experts, CAPACITY, torch.float32, False, num_slots)


def test_footprint_matches_what_a_load_and_a_session_allocate(tiny_artifact_official):
    engine = Engine.load(tiny_artifact_official, experts="host", num_slots=5, max_context=CAPACITY)
    try:
        host = footprint(tiny_artifact_official, "host", num_slots=5)
        assert host["experts"] == engine.store.pool.numel()  # slots x record bytes
        state = engine.session().state
        assert host["kv_cache"] == sum(k.nbytes + v.nbytes for k, v in state.kv.values())
        assert host["gdn_state"] == sum(t.nbytes for t in [*state.conv.values(), *state.recurrent.values()])
    finally:
        engine.close()
    resident = footprint(tiny_artifact_official, "resident")
    with open_artifact(tiny_artifact_official) as artifact:
        text_bytes = sum(t.bytes for t in Inventory.from_artifact(artifact).tensors if t.component == "text")
    assert resident["weights"] + resident["experts"] == text_bytes
    assert resident["experts"] > host["experts"] and resident["weights"] == host["weights"]


def test_a_load_that_cannot_fit_is_one_line_naming_the_remedy():
    items = {"weights": 3 << 30, "experts": 17 << 30, "kv_cache": 1 << 30, "gdn_state": 1 << 20}
    check_fits(items, 22 << 30, torch.device("cuda:0"))
    with pytest.raises(NinferError) as err:
        check_fits(items, 16 << 30, torch.device("cuda:0"))
    message = str(err.value)
    assert "\n" not in message
    assert message.startswith("needs 21.00 GiB of VRAM (experts 17.00 GiB")
    assert "16.00 GiB free" in message and "--experts host" in message
