"""The inventory classifies v1 files (through the reader's synthesised bindings) like v3 ones."""

from __future__ import annotations

import json
import struct

from ninfer_offload.artifact.formats import V1_FORMAT_NAMES, V1_LAYOUT_NAMES, align_up, encoded_size
from ninfer_offload.artifact.inventory import Inventory
from ninfer_offload.artifact.reader import open_artifact

EXPERTS, INTER, HIDDEN, VOCAB = 4, 64, 128, 96
V1_LAYOUTS = {v: k for k, v in V1_LAYOUT_NAMES.items()}
V1_FORMATS = {v: k for k, v in V1_FORMAT_NAMES.items()}


def write_v1(path, tensors: list[tuple[str, str, list[int]]]) -> None:
    """A v1 file (16-byte header, `{model_id, objects}`, payload at 4096) with zero payload."""
    objects, end = [], 0
    for name, fmt, shape in tensors:
        layout = "contiguous_le_v1" if fmt in ("bf16", "fp32", "int32") else "row_split_k128_v1"
        size = encoded_size(layout, fmt, shape)
        offset = align_up(end, 256)
        objects.append(
            {
                "name": name, "kind": "tensor", "shape": shape, "format": V1_FORMATS[fmt], "layout": V1_LAYOUTS[layout],
                "offset": offset, "bytes": size,
            }
        )
        end = offset + size
    text = json.dumps({"model_id": "qwen3.6-35b-a3b", "objects": objects}).encode()
    start = align_up(16 + len(text), 4096)
    path.write_bytes(b"NINFER\x00\x01" + struct.pack("<Q", len(text)) + text + bytes(start - 16 - len(text)) + bytes(end))


def test_v1_file_classifies_by_logical_names(tmp_path):
    path = tmp_path / "v1.ninfer"
    write_v1(
        path,
        [
            ("text/token_embedding", "q8_g32_fp16", [VOCAB, HIDDEN]),
            ("text/output_head", "q6_g64_fp16", [VOCAB, HIDDEN]),
            ("text/final_norm", "bf16", [HIDDEN]),
            ("text/layers/0/moe/router_shared_gate", "bf16", [EXPERTS + 1, HIDDEN]),
            ("text/layers/0/moe/routed_gate_up", "q4_g64_fp16", [EXPERTS * 2 * INTER, HIDDEN]),
            ("text/layers/0/moe/routed_down", "q5_g64_fp16", [EXPERTS * HIDDEN, INTER]),
            ("text/draft_head", "q4_g64_fp16", [32, HIDDEN]),
            ("text/draft_head_token_ids", "int32", [32]),
        ],
    )
    with open_artifact(path) as artifact:
        inventory = Inventory.from_artifact(artifact)
    by_id = {t.id: (t.component, t.role, t.layer) for t in inventory.tensors}
    assert by_id["text/layers/0/moe/routed_gate_up"] == ("text", "routed_gate_up", 0)
    assert by_id["text/layers/0/moe/routed_down"] == ("text", "routed_down", 0)
    assert by_id["text/layers/0/moe/router_shared_gate"] == ("text", "router", 0)
    assert by_id["text/draft_head"] == ("proposal", "proposal_head", None)
    assert by_id["text/token_embedding"] == ("text", "token_embedding", None)
    assert "other" not in inventory.bytes_by_role()
    [bank] = inventory.banks
    assert (bank.component, bank.layer, bank.num_experts) == ("text", 0, EXPERTS)
    assert bank.expert_bytes * EXPERTS == bank.bank_bytes
    assert sum(inventory.bytes_by_component().values()) == inventory.total_bytes
