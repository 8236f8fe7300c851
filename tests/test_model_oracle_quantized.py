"""Quantized recipes (`official`: Q4/Q5/Q6/Q8, `q8`) against transformers run on the weights the
artifact stores, decoded by the artifact reader's codecs and mapped back to Hugging Face names
(the inverse of docs/format.md §9). This checks the torch decoder, the quantized linear/embedding/expert
paths and the converter's bindings end to end. CPU, float32."""

from __future__ import annotations

import copy

import pytest
import tiny_hf
import torch

from ninfer_offload import Engine, open_artifact

PROMPT = torch.randint(0, 512, (24,), generator=torch.Generator().manual_seed(5)).tolist()


@pytest.fixture(scope="module", params=["official", "q8"])
def pair(request, tiny_hf_model):
    """(engine on the recipe's artifact, transformers model holding that artifact's decoded weights)."""
    path = request.getfixturevalue(f"tiny_artifact_{request.param}")
    with open_artifact(path) as artifact:
        state = tiny_hf.hf_state_from_artifact(artifact, tiny_hf_model.config)
    oracle = copy.deepcopy(tiny_hf_model)
    oracle.load_state_dict(state, strict=True)
    engine = Engine.load(path)
    yield engine, oracle, request.param
    engine.close()


def test_artifact_is_really_quantized(pair, tiny_hf_model):
    """The decoded weights differ from the float originals (else this file would test nothing new)."""
    _, oracle, _ = pair
    drift = (oracle.lm_head.weight - tiny_hf_model.lm_head.weight).abs().max().item()
    assert drift > 1e-4


def test_prefill_and_decode_match_transformers_on_decoded_weights(pair):
    engine, oracle, _ = pair
    ref, cache = tiny_hf.oracle_forward(oracle, PROMPT)
    ours = engine.logits(PROMPT)
    tolerance = 1e-4 * max(1.0, ref.abs().max().item())
    assert (ours - ref).abs().max().item() <= tolerance
    assert torch.equal(ours.argmax(-1), ref.argmax(-1))
    session = engine.session()
    session.prefill(PROMPT)
    token = int(ref[-1].argmax())
    for _ in range(8):
        ref_step, cache = tiny_hf.oracle_forward(oracle, [token], cache)
        step = session.step(token)
        assert (step - ref_step[0]).abs().max().item() <= 1e-4 * max(1.0, ref_step.abs().max().item())
        assert int(step.argmax()) == int(ref_step[0].argmax())
        token = int(ref_step[0].argmax())
