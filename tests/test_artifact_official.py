"""The official Qwen3.6-35B-A3B directory written as a full-size sparse file: sizes, reader and `inspect` agree with docs/format.md."""

import json
import subprocess
import sys

import pytest

import ninfer_offload
from ninfer_offload.artifact.writer import write_directory
from ninfer_offload.artifact.contract import official_directory


@pytest.fixture(scope="module")
def official(tmp_path_factory):
    root = official_directory()
    path = write_directory(root, tmp_path_factory.mktemp("official") / "qwen3_6_35b_a3b.ninfer")  # tensors are holes
    return path, root


def test_full_size_file_matches_the_model_card(official):
    path, root = official
    assert path.stat().st_size == 22_790_484_480  # the official v3 file size (docs/format.md §10.3)
    with open(path, "rb") as f:
        assert int.from_bytes(f.read(16)[8:], "little") == 7_389_152  # json_bytes predicted by docs/format.md §10.3
    with ninfer_offload.open_artifact(path) as art:
        assert art.directory == root
        assert (len(art.objects), len(art.bindings), len(art.uses)) == (940, 32_713, 32_184)
        assert art.payload_bytes == 22_783_095_296
        bank = art.object(art.bindings["text/layers/39/moe/experts/0/down"].parts[0].object)
        assert (bank.shape, bank.format) == ((524288, 512), "q6_g64_fp16")
        assert art.rows("text/layers/39/moe/experts/255/down") == (bank.id, 2048 * 255, 2048 * 256)
        codes, scales = art.quantized("text/layers/5/moe/experts/17/gate")
        assert codes.shape == (512, 2048) and scales.shape == (512, 32) and not codes.any()


def test_inspect_reports_official_totals(official):
    path, _ = official
    proc = subprocess.run(
        [sys.executable, "-m", "ninfer_offload", "inspect", str(path), "--json"], capture_output=True, text=True, timeout=300
    )
    assert proc.returncode == 0, proc.stderr
    report = json.loads(proc.stdout)
    counts = {f: row["objects"] for f, row in report["bytes_by_format"].items()}
    assert counts == {"bf16": 487, "fp32": 60, "int32": 1, "q4_g64_fp16": 95, "q5_g64_fp16": 91, "q6_g64_fp16": 5, "q8_g32_fp16": 195}
    assert report["objects"] == {"total": 940, "tensors": 934, "resources": 6}
    assert report["routed_expert_bytes"] == 40 * 285_212_672 + 37 * 176_160_768 + 3 * 209_715_200 + 570_425_344 + 285_212_672
    assert [b["experts"] for b in report["expert_banks"]] == [256] * 41
    assert report["components"]["text"]["proposal"] == {"domain": "indexed", "rows": 131072}
