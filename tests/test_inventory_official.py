"""The generated official inventory matches docs/format.md §8.4-8.6 exactly, and every byte is counted once."""

from __future__ import annotations

from collections import Counter

import pytest

from ninfer_offload.artifact.formats import align_up, encoded_size
from ninfer_offload.artifact.inventory import Inventory, classify
from ninfer_offload.artifact.contract import official_directory


@pytest.fixture(scope="module")
def root() -> dict:
    return official_directory()


@pytest.fixture(scope="module")
def inventory(root) -> Inventory:
    return Inventory.from_directory(root)


def test_object_counts_and_formats(root):
    tensors = [o for o in root["objects"] if o["kind"] == "tensor"]
    resources = [o for o in root["objects"] if o["kind"] == "resource"]
    assert (len(tensors), len(resources)) == (934, 6)
    assert Counter(o["format"] for o in tensors) == {
        "bf16": 487, "fp32": 60, "int32": 1, "q4_g64_fp16": 95, "q5_g64_fp16": 91, "q6_g64_fp16": 5, "q8_g32_fp16": 195,
    }
    assert sum(align_up(o["bytes"], 256) for o in tensors) == 22_770_260_992
    assert len(root["bindings"]) == 32_713
    assert len(root["uses"]) == 32_184
    assert len({(u["parameter"], u["input"]) for u in root["uses"]}) == 32_184


def test_objects_are_ordered_aligned_and_sized(root):
    end = 0
    for o in root["objects"]:
        assert o["offset"] >= end
        if o["kind"] == "tensor":
            assert o["offset"] % 256 == 0
            assert o["bytes"] == encoded_size(o["layout"], o["format"], o["shape"])
        end = o["offset"] + o["bytes"]
    assert root["files"] == [{"path": None, "payload_bytes": end}]
    assert [o["id"] for o in root["objects"][6:]] == [f"weight/{i:06d}" for i in range(934)]


@pytest.mark.parametrize(
    "name, object_id, shape, fmt, nbytes, part",
    [
        ("text/layers/0/gdn/value", "weight/000000", [12288, 2048], "q8_g32_fp16", 26_738_688, [8388608, 16777216]),
        ("text/layers/0/gdn/b_projection", "weight/000001", [64, 2048], "bf16", 262_144, [65536, 131072]),
        ("text/layers/0/moe/shared_score", "weight/000002", [257, 2048], "bf16", 1_052_672, [524288, 526336]),
        ("text/layers/0/moe/experts/255/up", "weight/000003", [262144, 2048], "q4_g64_fp16", 285_212_672, [535822336, 536870912]),
        ("text/layers/0/moe/experts/255/down", "weight/000004", [524288, 512], "q5_g64_fp16", 176_160_768, [267386880, 268435456]),
        ("text/layers/3/attention/gate", "weight/000018", [9216, 2048], "q8_g32_fp16", 20_054_016, [9437184, 17825792]),
        ("text/layers/3/moe/experts/5/gate", "weight/000020", [262144, 2048], "q4_g64_fp16", 285_212_672, [10485760, 11534336]),
        ("text/layers/39/moe/experts/0/down", None, [524288, 512], "q6_g64_fp16", 209_715_200, [0, 1048576]),
        ("mtp/layers/0/moe/experts/1/gate", None, [262144, 2048], "q8_g32_fp16", 570_425_344, [2097152, 3145728]),
        ("mtp/layers/0/moe/experts/1/down", None, [524288, 512], "q8_g32_fp16", 285_212_672, [1048576, 2097152]),
        ("vision/layers/0/attention/key", None, [3456, 1152], "q4_g64_fp16", 2_115_072, [1327104, 2654208]),
        ("dflash/layers/0/attention/context_key", None, [6144, 2048], "q8_g32_fp16", 13_369_344, [8388608, 10485760]),
        ("dflash/layers/2/mlp/up", None, [12288, 2048], "q8_g32_fp16", 26_738_688, [12582912, 25165824]),
    ],
)
def test_parents_and_ranges(root, name, object_id, shape, fmt, nbytes, part):
    objects = {o["id"]: o for o in root["objects"]}
    [p] = root["bindings"][name]["parts"]
    obj = objects[p["object"]]
    assert object_id in (None, obj["id"])
    assert (obj["shape"], obj["format"], obj["bytes"], p["range"]) == (shape, fmt, nbytes, part)


@pytest.mark.parametrize(
    "name, object_id, nbytes",
    [
        ("text/token_embedding", "weight/000301", 540_344_320),
        ("text/output_head", "weight/000302", 397_312_000),
        ("text/final_norm", "weight/000303", 4096),
        ("text/layers/0/input_norm", "weight/000304", 4096),
        ("text/layers/0/gdn/a_log", "weight/000305", 128),
        ("text/layers/0/gdn/dt_bias", "weight/000306", 128),
        ("text/layers/0/gdn/convolution", "weight/000307", 65_536),
        ("text/layers/0/gdn/norm", "weight/000308", 256),
        ("text/layers/0/gdn/output", "weight/000309", 8_912_896),
        ("text/layers/0/post_attention_norm", "weight/000310", 4096),
        ("text/layers/0/moe/shared/down", "weight/000311", 1_114_112),
        ("mtp/input_projection", "weight/000604", 8_912_896),
        ("vision/patch_embedding", "weight/000614", None),
        ("vision/layers/4/mlp/fc2", None, 3_290_112),
        ("dflash/feature_projection", "weight/000893", None),
        ("proposal/head", "weight/000932", 142_606_336),
        ("proposal/token_ids", "weight/000933", 524_288),
    ],
)
def test_single_parents(root, name, object_id, nbytes):
    obj = {o["id"]: o for o in root["objects"]}[root["bindings"][name]["object"]]
    assert object_id in (None, obj["id"])
    assert nbytes in (None, obj["bytes"])


def test_every_byte_counted_once(inventory):
    assert sum(inventory.bytes_by_component().values()) == inventory.total_bytes
    assert sum(inventory.bytes_by_role().values()) == inventory.total_bytes
    assert sum(inventory.bytes_by_format().values()) == inventory.total_bytes
    assert "unbound" not in inventory.bytes_by_component()
    assert inventory.aligned_bytes == 22_770_260_992


def test_roles_and_banks(inventory):
    roles = inventory.bytes_by_role()
    assert roles["token_embedding"] == 540_344_320
    assert roles["output_head"] == 397_312_000
    assert roles["proposal_head"] == 142_606_336
    text = inventory.banks_of("text")
    assert [b.layer for b in text] == list(range(40))
    assert all(b.num_experts == 256 for b in inventory.banks)
    assert {b.expert_bytes for b in text if b.layer not in (34, 38, 39)} == {1_802_240}
    assert {b.expert_bytes for b in text if b.layer in (34, 38, 39)} == {1_114_112 + 819_200}
    assert sum(b.bank_bytes for b in text) == roles["routed_gate_up"] + roles["routed_down"] - inventory.banks_of("mtp")[0].bank_bytes
    assert all(b.bank_bytes == b.num_experts * b.expert_bytes for b in inventory.banks)


@pytest.mark.parametrize(
    "name, expected",
    [
        ("text/layers/7/moe/experts/12/up", ("text", "routed_gate_up", 7)),
        ("mtp/layers/0/moe/experts/3/down", ("mtp", "routed_down", 0)),
        ("text/layers/2/gdn/norm", ("text", "norm", 2)),
        ("text/layers/2/gdn/z", ("text", "gdn", 2)),
        ("text/layers/3/attention/query_norm", ("text", "norm", 3)),
        ("text/layers/3/moe/shared/up", ("text", "shared_expert", 3)),
        ("text/layers/3/moe/router", ("text", "router", 3)),
        ("mtp/input_projection", ("mtp", "input_projection", None)),
        ("vision/layers/1/mlp/fc1_bias", ("vision", "mlp", 1)),
        ("proposal/token_ids", ("proposal", "proposal_token_ids", None)),
    ],
)
def test_classify(name, expected):
    assert classify(name) == expected
