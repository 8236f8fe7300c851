"""NVFP4 artifacts in the planner and `ninfer inspect`: expert record bytes, placement, verify of
scales and divisors, and a DFlash2 drafter that is reported and left unused."""

from __future__ import annotations

import json
import subprocess
import sys

import numpy as np
import pytest

from ninfer_offload import open_artifact
from ninfer_offload.artifact.codecs import decode_nvfp4
from ninfer_offload.artifact.contract import nvfp4_directory, official_directory
from ninfer_offload.artifact.formats import BlockScaleGeometry, encoded_size
from ninfer_offload.artifact.inventory import Inventory
from ninfer_offload.artifact.records import ExpertRecordLayout
from ninfer_offload.artifact.verify import verify_artifact
from ninfer_offload.artifact.writer import write_directory
from ninfer_offload.commands.inspect import summarize
from ninfer_offload.planner import PlanOptions, plan
from ninfer_offload.planner.memory import loaded_weight_bytes
from ninfer_offload.profiles import load_profile


def _ninfer(*args) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "ninfer_offload", *map(str, args)], capture_output=True, text=True, timeout=300)


def nvfp4_record_bytes(hidden: int, width: int) -> int:
    return ExpertRecordLayout.create("nvfp4", "nvfp4", hidden, width).nbytes


def test_record_bytes_of_the_35b_model():
    # gate/up [1024, 2048] with 8 divisors (one per row tile): 1,048,576 code + 131,072 scale + 32 -> 1,179,680,
    # next 256: 1,179,904; down [2048, 512] with 16: 524,288 + 65,536 + 64 = 589,888; total 1,769,792, padded to 1,769,984
    assert nvfp4_record_bytes(2048, 512) == 1_769_984


def test_nvfp4_directory_plans_with_nvfp4_records():
    inventory = Inventory.from_directory(nvfp4_directory())
    official = Inventory.from_directory(official_directory())
    text = inventory.banks_of("text")
    assert len(text) == 40 and {b.expert_bytes for b in text} == {1_769_984}
    assert {b.bank_bytes for b in text} == {encoded_size("block_scale_k16_m128x4_v1", "nvfp4", [262144, 2048], 512)
                                            + encoded_size("block_scale_k16_m128x4_v1", "nvfp4", [524288, 512], 256)}
    assert inventory.banks_of("mtp")[0].expert_bytes == official.banks_of("mtp")[0].expert_bytes  # the MTP stays Q8
    shared = [t for t in inventory.select("text", ["shared_expert"])]
    assert {t.format for t in shared} == {"nvfp4"} and len(shared) == 80
    # quantized weights are kept as stored, NVFP4 shared experts included
    assert loaded_weight_bytes(inventory, ("text",), 2) < loaded_weight_bytes(official, ("text",), 2)
    options = PlanOptions(max_context=32768, speculative="none")
    placement = plan(inventory, load_profile("rtx5060ti"), options)
    reference = plan(official, load_profile("rtx5060ti"), options)
    assert placement.feasible and placement.expert_bytes == [1_769_984] * 40
    assert placement.runtime["kv_cache"] == reference.runtime["kv_cache"]
    assert 0 < placement.experts_resident < placement.experts_total
    assert placement.experts_resident > reference.experts_resident  # smaller records, more of them fit
    assert plan(inventory, load_profile("h200"), options).experts_resident == 40 * 256


def test_nvfp4_record_cut_from_a_bank_holds_the_experts_weights(tiny_artifact_nvfp4):
    """A record as the planner counts it and the loader cuts it (`ExpertRecordLayout`) holds exactly the
    expert's weights: its size is the planned one, and it decodes to the bank's rows."""
    with open_artifact(tiny_artifact_nvfp4) as artifact:
        gate_id, _, _ = artifact.rows("text/layers/3/moe/experts/2/gate")
        down_id, d0, d1 = artifact.rows("text/layers/3/moe/experts/2/down")
        width, hidden, experts = d1 - d0, artifact.object(gate_id).shape[1], artifact.object(gate_id).shape[0] // (2 * (d1 - d0))
        layout = ExpertRecordLayout.create("nvfp4", "nvfp4", hidden, width)
        record = layout.pack(artifact.payload(gate_id), artifact.payload(down_id), experts, 2)
        gate_up = decode_nvfp4(record[: layout.gate_up.encoded_size], 2 * width, hidden, layout.gate_up.divisors)
        down = decode_nvfp4(record[layout.down_offset : layout.down_offset + layout.down.encoded_size], hidden, width, layout.down.divisors)
        expected = [artifact.tensor(f"text/layers/3/moe/experts/2/{k}").numpy() for k in ("gate", "up", "down")]
        planned = Inventory.from_artifact(artifact).banks_of("text")[3].expert_bytes
    assert np.array_equal(gate_up, np.concatenate(expected[:2])) and np.array_equal(down, expected[2])
    assert record.size == planned == nvfp4_record_bytes(hidden, width)


def test_plan_and_inspect_a_converted_nvfp4_artifact(tiny_artifact_nvfp4, small_card):
    done = _ninfer("plan", tiny_artifact_nvfp4, "--profile", small_card, "--json")
    assert done.returncode == 0, done.stderr
    document = json.loads(done.stdout)
    assert document["feasible"] and document["expert_bytes_per_layer"] == [nvfp4_record_bytes(128, 128)] * 6
    with open_artifact(tiny_artifact_nvfp4) as artifact:
        report = summarize(artifact)
    assert report["bytes_by_format"]["nvfp4"]["objects"] == 6 * 4  # per layer: both banks, shared gate/up and down
    assert {b["record_bytes"] for b in report["expert_banks"] if b["component"] == "text"} == {nvfp4_record_bytes(128, 128)}
    assert report["components"]["text"]["run"] and report["components"]["mtp"]["run"]


def _corrupt(path, artifact, object_id: str, offset: int, data: bytes) -> None:
    start = path.stat().st_size - artifact.payload_bytes
    with open(path, "r+b") as f:
        f.seek(start + artifact.object(object_id).offset + offset)
        f.write(data)


def test_verify_checks_nvfp4_scales_and_divisors(tiny_artifact_nvfp4, tmp_path):
    path = tmp_path / "bad.ninfer"
    path.write_bytes(tiny_artifact_nvfp4.read_bytes())
    with open_artifact(path) as artifact:
        bank = artifact.object(artifact.rows("text/layers/1/moe/experts/0/up")[0])
        geometry = BlockScaleGeometry(*bank.shape, bank.divisors)
        _corrupt(path, artifact, bank.id, geometry.scale_offset + 5, b"\x7f\xff\x85")
        _corrupt(path, artifact, bank.id, geometry.divisor_offset + 4, np.array([0.0, np.inf], "<f4").tobytes())
    with open_artifact(path) as artifact:
        problems = verify_artifact(artifact)
    assert problems == {bank.id: ["2 negative block scales", "2 NaN block scales", "2 divisors that are not finite and > 0"]}
    done = _ninfer("inspect", path, "--verify")
    assert done.returncode == 2
    assert done.stderr.strip().splitlines() == [
        f"error: verify found invalid payload in 1 objects (first: '{bank.id}': 2 negative block scales)"
    ]


@pytest.fixture(scope="module")
def with_dflash2(tiny_artifact_nvfp4, tmp_path_factory):
    """The tiny NVFP4 artifact plus a DFlash2 drafter component (one Q8 projection), as the published NVFP4 file carries one."""
    with open_artifact(tiny_artifact_nvfp4) as artifact:
        root = json.loads(json.dumps(artifact.directory))
        payloads = {o.id: artifact.payload(o.id).copy() for o in artifact.objects}
        resources = {role: artifact.resource(role) for role in artifact.components["text"].resources}
    config = {"architectures": ["DFlashDraftModel"], "dflash_config": {"target_layer_ids": [1, 4], "mask_token_id": 500}}
    root["components"]["dflash2"] = {"config": config, "target": "text"}
    fc = np.random.default_rng(0).standard_normal((128, 256)).astype(np.float32)
    from ninfer_offload.artifact.codecs import encode_row_split

    payloads["weight/dflash2"] = encode_row_split(fc, "q8_g32_fp16")
    root["objects"].append({"id": "weight/dflash2", "shape": [128, 256], "format": "q8_g32_fp16", "layout": "row_split_k128_v1",
                            "offset": 0, "bytes": payloads["weight/dflash2"].size, "kind": "tensor"})
    root["bindings"]["dflash2/feature_projection"] = {"object": "weight/dflash2"}
    path = tmp_path_factory.mktemp("dflash2") / "with_dflash2.ninfer"
    return write_directory(root, path, lambda obj: (lambda: payloads[obj["id"]]), resources)


def test_dflash2_is_reported_and_left_unused(with_dflash2, small_card):
    with open_artifact(with_dflash2) as artifact:
        report = summarize(artifact)
        inventory = Inventory.from_artifact(artifact)
    assert report["components"]["dflash2"]["run"] is False
    assert report["bytes_by_component"]["dflash2"] == encoded_size("row_split_k128_v1", "q8_g32_fp16", [128, 256])
    placement = plan(inventory, load_profile(str(small_card)), PlanOptions(max_context=1024, speculative="none"))
    assert placement.components["dflash2"].placement == "unused"
    assert placement.components["dflash2"].bytes == report["bytes_by_component"]["dflash2"]
    assert "other" not in placement.components
    shown = _ninfer("inspect", with_dflash2)
    assert shown.returncode == 0 and "dflash2" in shown.stdout and "no (carried, unused)" in shown.stdout


@pytest.mark.parametrize("command", ["generate", "serve"])
def test_spec_dflash2_is_refused_in_one_line(command, with_dflash2):
    args = ["--prompt", "hi"] if command == "generate" else []
    done = _ninfer(command, with_dflash2, *args, "--spec", "dflash2")
    assert done.returncode == 2
    assert done.stderr.strip().splitlines() == [
        "error: --spec dflash2: drafting with a DFlash model is not supported; an artifact's dflash2 component is carried "
        "but never run: use --spec auto, mtp or none"
    ]
