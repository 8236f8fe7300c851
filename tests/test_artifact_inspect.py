"""`ninfer inspect`: report contents, --json, --verify validity checks, and no payload reads without --verify."""

import json
import os
import subprocess
import sys

import numpy as np
import pytest

import ninfer_offload
from ninfer_offload.artifact.codecs import encode_codes, encode_contiguous, encode_row_split
from ninfer_offload.artifact.formats import encoded_size
from ninfer_offload.artifact.records import ExpertRecordLayout
from ninfer_offload.artifact.verify import verify_artifact
from ninfer_offload.artifact.writer import ArtifactWriter
from ninfer_offload.commands.inspect import summarize

ROWS = "row_split_k128_v1"
CONTIG = "contiguous_le_v1"


def _inspect(*args):
    proc = subprocess.run([sys.executable, "-m", "ninfer_offload", "inspect", *map(str, args)], capture_output=True, text=True, timeout=120)
    return proc.returncode, proc.stdout, proc.stderr


def _moe_artifact(path, experts=4, hidden=128, inter=64, max_file_bytes=None, holes=False):
    """One MoE layer (expert banks bound per expert), a norm, and a resource; holes=True leaves banks unwritten."""
    rng = np.random.default_rng(0)
    w = ArtifactWriter(path, max_file_bytes=max_file_bytes)
    w.add_component("text", {"hidden_size": hidden, "num_experts": experts})
    w.add_resource("resource/text/tokenizer.json", b'{"model": {}}', role="tokenizer.json")
    gu = None if holes else (lambda: encode_row_split(rng.standard_normal((experts * 2 * inter, hidden)).astype(np.float32), "q4_g64_fp16"))
    dn = None if holes else (lambda: encode_row_split(rng.standard_normal((experts * hidden, inter)).astype(np.float32), "q5_g64_fp16"))
    w.add_tensor("weight/0", [experts * 2 * inter, hidden], "q4_g64_fp16", ROWS, gu)
    w.add_tensor("weight/1", [experts * hidden, inter], "q5_g64_fp16", ROWS, dn)
    w.add_tensor("weight/2", [hidden], "bf16", CONTIG, lambda: encode_contiguous(np.ones(hidden), "bf16"))
    for e in range(experts):
        g0 = 2 * inter * hidden * e
        w.bind_parts(f"text/layers/0/moe/experts/{e}/gate", [("weight/0", g0, g0 + inter * hidden)])
        w.bind_parts(f"text/layers/0/moe/experts/{e}/up", [("weight/0", g0 + inter * hidden, g0 + 2 * inter * hidden)])
        w.bind_parts(f"text/layers/0/moe/experts/{e}/down", [("weight/1", hidden * inter * e, hidden * inter * (e + 1))])
    w.bind("text/layers/0/input_norm", "weight/2")
    return w.write()


def test_inspect_report_and_json(tmp_path):
    path = _moe_artifact(tmp_path / "m.ninfer")
    code, out, err = _inspect(path)
    assert code == 0, err
    for text in ("container v3", "q4_g64_fp16", "q5_g64_fp16", "routed_gate_up", "routed experts:", "tokenizer.json", "bindings: 13"):
        assert text in out
    code, out, err = _inspect(path, "--json")
    assert code == 0, err
    report = json.loads(out)
    gu, dn = encoded_size(ROWS, "q4_g64_fp16", [512, 128]), encoded_size(ROWS, "q5_g64_fp16", [512, 64])
    assert report["container_version"] == 3 and report["objects"] == {"total": 4, "tensors": 3, "resources": 1}
    assert report["bytes_by_format"]["q4_g64_fp16"] == {"objects": 1, "bytes": gu}
    assert report["bytes_by_role"]["routed_gate_up"] == gu and report["bytes_by_role"]["norm"] == 256
    assert report["routed_expert_bytes"] == gu + dn and report["other_tensor_bytes"] == 256
    assert report["bytes_by_component"] == {"text": gu + dn + 256}
    record = ExpertRecordLayout.create("q4_g64_fp16", "q5_g64_fp16", 128, 64).nbytes
    assert report["expert_banks"] == [{"component": "text", "layer": 0, "experts": 4, "bank_bytes": gu + dn, "record_bytes": record}]
    assert report["components"]["text"]["config"] == {"hidden_size": 128, "num_experts": 4}
    assert report["resources"]["resource/text/tokenizer.json"] == {"component": "text", "role": "tokenizer.json", "bytes": 13}
    assert report["bindings"] == 13 and report["uses"] == 0 and "verify" not in report


def test_inspect_verify_valid_payload_of_a_file_that_cannot_load(tmp_path):
    """One MoE layer is a valid payload but no model: verify says both (tests/test_inspect_load.py: loadable files)."""
    path = _moe_artifact(tmp_path / "m.ninfer", max_file_bytes=8 * 4096)
    code, out, err = _inspect(path, "--verify")
    assert code == 2 and err.startswith("error: verify: generate and serve would refuse this artifact: resources:")
    assert "verify: all 3 tensors decode with valid codes and scales" in out
    code, out, _ = _inspect(path, "--verify", "--json")
    verified = json.loads(out)["verify"]
    assert verified["tensors"] == 3 and verified["problems"] == {}
    assert [p.split(":")[0] for p in verified["load_problems"]] == ["resources", "load"]


def test_large_sparse_file_reads_no_payload(tmp_path):
    """A full-size layer (35B routed banks, ~440 MB) written as holes, its parts deleted: inspect still works."""
    path = _moe_artifact(tmp_path / "big.ninfer", experts=256, hidden=2048, inter=512, max_file_bytes=64 << 20, holes=True)
    parts = [p for p in os.listdir(tmp_path) if ".part-" in p]
    assert len(parts) >= 6
    for p in parts:
        (tmp_path / p).unlink()
    code, out, err = _inspect(path, "--json")
    assert code == 0, err
    report = json.loads(out)
    assert report["routed_expert_bytes"] == 285_212_672 + 176_160_768
    assert report["expert_banks"][0]["experts"] == 256
    with ninfer_offload.open_artifact(path) as art:
        summarize(art)
        assert all(seg.view is None for seg in art._storage.segments)  # nothing was even mapped
    code, _, err = _inspect(path, "--verify")
    assert code == 2 and "is missing" in err


def _bad_objects():
    """(object id, format, layout, shape, raw bytes, expected problems)."""
    q8 = np.zeros((2, 32), np.int8)
    q8[1, 3] = -128
    q4 = np.ones((1, 64), np.int8)
    pad = encode_codes(np.ones((1, 100), np.int8), np.ones((1, 2), np.float16), "q5_g64_fp16")
    pad[50] = 0x11  # lanes 100 and 101 (padding) get code 1
    pad_group = encode_codes(np.ones((1, 64), np.int8), np.ones((1, 1), np.float16), "q6_g64_fp16")
    pad_group[-2:] = np.frombuffer(np.float16(1).tobytes(), np.uint8)  # scale of the wholly padding group
    nvfp4 = np.zeros(encoded_size("block_scale_k16_m128x4_v1", "nvfp4", [128, 64]), np.uint8)
    nvfp4[4096] = 0x80  # a negative block scale; the divisor stays 0.0
    fp8 = np.zeros(encoded_size("row_scale_v1", "fp8_e4m3fn_row_bf16", [2, 4]), np.uint8)
    fp8[5] = 0x7F
    fp8[256:258] = [0x80, 0xBF]  # row 0 scale -1.0
    bf16 = encode_contiguous(np.array([1.0, np.nan, np.inf, 2.0], np.float32), "bf16")
    return [
        ("w8", "q8_g32_fp16", ROWS, [2, 32], encode_codes(q8, np.ones((2, 1), np.float16), "q8_g32_fp16"), ["1 W8 codes equal to -128"]),
        ("neg", "q4_g64_fp16", ROWS, [1, 64], encode_codes(q4, -np.ones((1, 1), np.float16), "q4_g64_fp16"), ["1 negative scales"]),
        ("nan", "q4_g64_fp16", ROWS, [1, 64], encode_codes(q4, np.full((1, 1), np.nan, np.float16), "q4_g64_fp16"), ["1 NaN/Inf scales"]),
        (
            "zero", "q4_g64_fp16", ROWS, [1, 64], encode_codes(q4, np.zeros((1, 1), np.float16), "q4_g64_fp16"),
            ["1 zero scales with non-zero codes"],
        ),
        ("pad", "q5_g64_fp16", ROWS, [1, 100], pad, ["2 non-zero padding lanes"]),
        ("padgroup", "q6_g64_fp16", ROWS, [1, 64], pad_group, ["1 non-zero padding-group scales"]),
        ("floats", "bf16", CONTIG, [4], bf16, ["2 NaN/Inf values"]),
        (
            "nvfp4", "nvfp4", "block_scale_k16_m128x4_v1", [128, 64], nvfp4,
            ["1 negative block scales", "1 divisors that are not finite and > 0"],
        ),
        ("fp8", "fp8_e4m3fn_row_bf16", "row_scale_v1", [2, 4], fp8, ["1 FP8 NaN codes (0x7F/0xFF)", "1 negative row scales"]),
    ]


def test_verify_finds_each_invalid_payload(tmp_path):
    w = ArtifactWriter(tmp_path / "bad.ninfer")
    w.add_component("text", {})
    expected = {}
    for oid, fmt, layout, shape, raw, problems in _bad_objects():
        w.add_tensor(oid, shape, fmt, layout, lambda raw=raw: raw)
        expected[oid] = problems
    ok = encode_row_split(np.random.default_rng(1).standard_normal((3, 200)).astype(np.float32), "q8_g32_fp16")
    w.add_tensor("ok", [3, 200], "q8_g32_fp16", ROWS, lambda: ok)
    path = w.write()
    seen = []
    with ninfer_offload.open_artifact(path) as art:
        assert verify_artifact(art, seen.append) == expected
        assert sum(seen) == sum(o.bytes for o in art.objects)
    code, out, err = _inspect(path, "--verify")
    assert code == 2 and err.startswith("error: verify found invalid payload in 9 objects") and err.count("\n") == 1
    assert "invalid w8: 1 W8 codes equal to -128" in out


@pytest.mark.parametrize("args", [[], ["--json"]])
def test_inspect_v1_file(tmp_path, args):
    text = json.dumps(
        {"model_id": "qwen3.6-35b-a3b", "objects": [{"name": "text/final_norm", "kind": "tensor", "shape": [4], "format": "BF16",
                                                     "layout": "contiguous-le-v1", "offset": 0, "bytes": 8}]}
    ).encode()
    path = tmp_path / "v1.ninfer"
    path.write_bytes(b"NINFER\x00\x01" + len(text).to_bytes(8, "little") + text + bytes(4096 - 16 - len(text)) + bytes(8))
    code, out, err = _inspect(path, *args)
    assert code == 0, err
    assert ("container v1" in out and "qwen3.6-35b-a3b" in out) if not args else json.loads(out)["model_id"] == "qwen3.6-35b-a3b"
