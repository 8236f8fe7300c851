"""Planning a real artifact file (directory only) equals planning the generated inventory, and the
inventory classifies files written by our converter."""

from __future__ import annotations

import pytest

from ninfer_offload.artifact.inventory import Inventory
from ninfer_offload.artifact.reader import open_artifact
from ninfer_offload.artifact.writer import write_directory
from ninfer_offload.artifact.contract import official_directory
from ninfer_offload.planner import PlanOptions, plan
from ninfer_offload.profiles import load_profile


@pytest.fixture(scope="module")
def official_file(tmp_path_factory):
    path = tmp_path_factory.mktemp("official") / "qwen3_6_35b_a3b.ninfer"
    return write_directory(official_directory(), path)  # tensors are holes


@pytest.fixture(scope="module")
def file_inventory(official_file) -> Inventory:
    with open_artifact(official_file) as artifact:
        root = official_directory()
        assert [(o.id, o.offset, o.bytes) for o in artifact.objects] == [(o["id"], o["offset"], o["bytes"]) for o in root["objects"]]
        assert len(artifact.bindings) == len(root["bindings"])
        return Inventory.from_artifact(artifact)


def test_sparse_file_is_the_official_size(official_file):
    # The model card's size of the official v3 file. The placeholder resource sizes were chosen so the
    # payload ends where docs/format.md §10.3 infers; the match also checks the directory's JSON size
    # (~7.39 MB, same 4 KiB page as §10.3's estimate).
    assert official_file.stat().st_size == 22_790_484_480


@pytest.mark.parametrize(
    "profile, options",
    [
        ("rtx5090", PlanOptions()),
        ("rtx5060ti", PlanOptions()),
        ("rtx5060ti", PlanOptions(speculative="none", max_context=32768, kv_dtype="bf16")),
        ("rtxpro6000", PlanOptions(vision=True, concurrency=4)),
    ],
)
def test_file_plan_equals_generated_plan(file_inventory, profile, options):
    from_file = file_inventory
    generated = Inventory.from_directory(official_directory())
    assert from_file.bytes_by_role() == generated.bytes_by_role()
    assert from_file.banks == generated.banks
    device = load_profile(profile)
    assert plan(from_file, device, options).to_json() == plan(generated, device, options).to_json()


def test_converted_tiny_artifact_classifies_and_plans(tiny_artifact_official):
    with open_artifact(tiny_artifact_official) as artifact:
        inventory = Inventory.from_artifact(artifact)
        layers = artifact.components["text"].config["num_hidden_layers"]
        experts = artifact.components["text"].config["num_experts"]
    assert "unbound" not in inventory.bytes_by_component()
    assert sum(inventory.bytes_by_component().values()) == inventory.total_bytes
    assert [b.layer for b in inventory.banks_of("text")] == list(range(layers))
    assert all(b.num_experts == experts for b in inventory.banks)
    roles = inventory.bytes_by_role()
    assert roles["token_embedding"] > 0 and roles["output_head"] > 0 and roles["routed_gate_up"] > 0
    placement = plan(
        inventory,
        load_profile("rtx5090"),
        PlanOptions(speculative="none" if not inventory.select("mtp") else "mtp", proposal_head=bool(inventory.select("proposal"))),
    )
    assert placement.feasible and placement.routing_stats == "uniform"
    assert placement.experts_resident == layers * experts
