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


def hf_state_from_artifact(artifact, config) -> dict[str, torch.Tensor]:
    """Hugging Face `Qwen3_5MoeForCausalLM` tensors rebuilt from the artifact's bindings."""
    t = artifact.tensor
    state = {
        "model.embed_tokens.weight": t("text/token_embedding"),
        "model.norm.weight": t("text/final_norm"),
        "lm_head.weight": t("text/output_head"),
    }
    heads, dim = config.num_attention_heads, config.head_dim
    for layer, kind in enumerate(config.layer_types):
        src, dst = f"text/layers/{layer}", f"model.layers.{layer}"
        state[f"{dst}.input_layernorm.weight"] = t(f"{src}/input_norm")
        state[f"{dst}.post_attention_layernorm.weight"] = t(f"{src}/post_attention_norm")
        if kind == "full_attention":
            a = f"{src}/attention"
            query = t(f"{a}/query").reshape(heads, 1, dim, -1)
            gate = t(f"{a}/gate").reshape(heads, 1, dim, -1)
            state[f"{dst}.self_attn.q_proj.weight"] = torch.cat([query, gate], dim=1).reshape(2 * heads * dim, -1)
            for ours, theirs in (("key", "k_proj"), ("value", "v_proj"), ("output", "o_proj")):
                state[f"{dst}.self_attn.{theirs}.weight"] = t(f"{a}/{ours}")
            state[f"{dst}.self_attn.q_norm.weight"] = t(f"{a}/query_norm").reshape(-1)
            state[f"{dst}.self_attn.k_norm.weight"] = t(f"{a}/key_norm").reshape(-1)
        else:
            g, out = f"{src}/gdn", f"{dst}.linear_attn"
            state[f"{out}.in_proj_qkv.weight"] = torch.cat([t(f"{g}/query"), t(f"{g}/key"), t(f"{g}/value")])
            state[f"{out}.in_proj_z.weight"] = t(f"{g}/z")
            state[f"{out}.in_proj_a.weight"] = t(f"{g}/a_projection").reshape(config.linear_num_value_heads, -1)
            state[f"{out}.in_proj_b.weight"] = t(f"{g}/b_projection").reshape(config.linear_num_value_heads, -1)
            state[f"{out}.A_log"] = t(f"{g}/a_log").reshape(-1)
            state[f"{out}.dt_bias"] = t(f"{g}/dt_bias").reshape(-1)
            state[f"{out}.conv1d.weight"] = t(f"{g}/convolution").T.unsqueeze(1).contiguous()
            state[f"{out}.norm.weight"] = t(f"{g}/norm").reshape(-1)
            state[f"{out}.out_proj.weight"] = t(f"{g}/output")
        m, out = f"{src}/moe", f"{dst}.mlp"
        state[f"{out}.gate.weight"] = t(f"{m}/router").reshape(config.num_experts, -1)
        state[f"{out}.shared_expert_gate.weight"] = t(f"{m}/shared_score").reshape(1, -1)
        for part in ("gate", "up", "down"):
            state[f"{out}.shared_expert.{part}_proj.weight"] = t(f"{m}/shared/{part}")
        experts = range(config.num_experts)
        state[f"{out}.experts.gate_up_proj"] = torch.stack(
            [torch.cat([t(f"{m}/experts/{e}/gate"), t(f"{m}/experts/{e}/up")]) for e in experts]
        )
        state[f"{out}.experts.down_proj"] = torch.stack([t(f"{m}/experts/{e}/down") for e in experts])
    return state


@pytest.fixture(scope="module", params=["official", "q8"])
def pair(request, tiny_hf_model):
    """(engine on the recipe's artifact, transformers model holding that artifact's decoded weights)."""
    path = request.getfixturevalue(f"tiny_artifact_{request.param}")
    with open_artifact(path) as artifact:
        state = hf_state_from_artifact(artifact, tiny_hf_model.config)
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
