"""`convert(..., proposal=RANKING)`: a proposal head whose token ids are the ranking's most frequent
ids (special tokens always among them) and whose rows are the output head's rows of those ids in
Q4; a checkpoint without MTP, a bad ranking file or a bad row count is a one-line error."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from conftest import PROPOSAL_ROWS
from safetensors.torch import load_file

from ninfer_offload import NinferError, open_artifact
from ninfer_offload.convert import convert
from ninfer_offload.convert.proposal import read_ranking, tokenizer_domain
from ninfer_offload.convert.tiny import RANKING_FILE, write_checkpoint


@pytest.fixture(scope="module")
def stored(tiny_artifact_proposal):
    with open_artifact(tiny_artifact_proposal) as artifact:
        head_object = artifact.object(artifact.bindings["proposal/head"].parts[0].object)
        yield {
            "record": artifact.components["text"].proposal,
            "ids": artifact.tensor("proposal/token_ids").numpy(),
            "head": artifact.tensor("proposal/head"),
            "head_format": head_object.format,
        }


def test_token_ids_are_the_most_frequent_with_every_special(stored, tiny_checkpoint):
    counts = read_ranking(tiny_checkpoint / RANKING_FILE)
    _, specials = tokenizer_domain((tiny_checkpoint / "tokenizer.json").read_bytes())
    ids = stored["ids"]
    assert stored["record"] == {"domain": "indexed", "rows": PROPOSAL_ROWS}
    assert ids.dtype == np.int32 and len(ids) == len(set(ids.tolist())) == PROPOSAL_ROWS
    full = np.zeros(512, dtype=np.int64)
    full[: len(counts)] = counts
    assert set(specials) <= set(ids.tolist()) and specials
    assert np.all(np.diff(full[ids]) <= 0)  # most frequent first
    chosen = [i for i in ids.tolist() if i not in specials]
    left_out = [i for i in range(512) if i not in set(ids.tolist())]
    assert full[left_out].max() <= full[chosen].min()


def test_head_rows_are_the_output_head_rows_in_q4(stored, tiny_checkpoint):
    lm_head = load_file(tiny_checkpoint / "model.safetensors")["lm_head.weight"].float()
    expected = lm_head[torch.from_numpy(stored["ids"]).long()]
    assert stored["head_format"] == "q4_g64_fp16" and stored["head"].shape == expected.shape
    error = (stored["head"] - expected).abs().amax(dim=1)
    assert torch.all(error <= expected.abs().amax(dim=1) / 7)


def test_bad_proposal_requests_are_one_line(tmp_path, tiny_checkpoint):
    ranking = tiny_checkpoint / RANKING_FILE
    with pytest.raises(NinferError, match="--proposal-rows must be between the 7 special tokens and the tokenizer's 512 ids, got 600"):
        convert(tiny_checkpoint, tmp_path / "rows.ninfer", proposal=ranking, proposal_rows=600, progress=False)
    (tmp_path / "short.i64").write_bytes(b"1234567")
    with pytest.raises(NinferError, match="is not a non-empty file of int64 token counts"):
        convert(tiny_checkpoint, tmp_path / "short.ninfer", proposal=tmp_path / "short.i64", progress=False)
    no_mtp = write_checkpoint(tmp_path / "no_mtp", mtp=False)
    with pytest.raises(NinferError, match="--proposal needs the checkpoint's MTP layer"):
        convert(no_mtp, tmp_path / "no_mtp.ninfer", proposal=ranking, proposal_rows=PROPOSAL_ROWS, progress=False)
    assert not list(tmp_path.glob("*.ninfer*"))
