"""Session fixtures shared by every test: one tiny HF model, its checkpoint, and its converted artifacts.

Where flash-linear-attention or causal-conv1d is installed, transformers' qwen3_5_moe modeling
module is imported here, before any test module can import it, so that the oracle is bound to its
pure-PyTorch kernels (see `tiny_hf.oracle_module`). Everything is built once per session under a
session temporary directory.
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import kernels_support  # noqa: F401  (first: without CUDA it turns the Triton interpreter on before anything imports a kernel)
import pytest
import tiny_hf
import torch

# With the source tree's root on sys.path (`python -m pytest` there), its top-level `kernels/` folder (installed as
# `ninfer_offload.kernels`) would shadow the `kernels` distribution that transformers imports; tests use the install.
_SOURCE_ROOT = Path(__file__).resolve().parent.parent
sys.path[:] = [entry for entry in sys.path if Path(entry or ".").resolve() != _SOURCE_ROOT]

if any(importlib.util.find_spec(name) for name in ("fla", "causal_conv1d")):
    tiny_hf.oracle_module()

TINY_SEED = 1  # seed 0 puts a router near-tie in test_engine_steps' fp8 KV prompt (logits move by 16%, 1.5% here)
GREEDY_PROMPT = [11, 42, 7, 300, 5, 99, 23]
PROPOSAL_ROWS = 256  # of the tiny vocabulary's 512 ids


@pytest.fixture(scope="session")
def tiny_hf_model():
    """The float32 `Qwen3_5MoeForCausalLM` (6 layers, 8 experts, top-2) every tiny artifact is made from."""
    return tiny_hf.build_tiny_model(seed=TINY_SEED, layout="fused")


@pytest.fixture(scope="session")
def tiny_checkpoint(tmp_path_factory):
    """Its Hugging Face checkpoint directory: fused experts, `model.*` prefix, `mtp.*` tensors, tokenizer files."""
    return tiny_hf.save_checkpoint(tmp_path_factory.mktemp("tiny_checkpoint"), "fused", seed=TINY_SEED)


def _convert(checkpoint, tmp_path_factory, recipe: str, **options):
    from ninfer_offload.convert import convert

    out = tmp_path_factory.mktemp(f"tiny_{recipe}") / f"tiny_{recipe}.ninfer"
    return convert(checkpoint, out, recipe=recipe, progress=False, **options)


@pytest.fixture(scope="session")
def tiny_artifact(tiny_checkpoint, tmp_path_factory):
    """`tiny_checkpoint` converted with the lossless `bf16` recipe (components text + mtp)."""
    return _convert(tiny_checkpoint, tmp_path_factory, "bf16")


@pytest.fixture(scope="session")
def tiny_artifact_official(tiny_checkpoint, tmp_path_factory):
    """`tiny_checkpoint` converted with the `official` recipe (Q4/Q5/Q6/Q8 groupwise)."""
    return _convert(tiny_checkpoint, tmp_path_factory, "official")


@pytest.fixture(scope="session")
def tiny_artifact_proposal(tiny_checkpoint, tmp_path_factory):
    """`tiny_checkpoint` converted with the `official` recipe and a proposal head (Q4, like the
    official file's) over the 256 most frequent of its 512 token ids by the checkpoint's ranking."""
    from ninfer_offload.convert.tiny import RANKING_FILE

    return _convert(tiny_checkpoint, tmp_path_factory, "official", proposal=tiny_checkpoint / RANKING_FILE, proposal_rows=PROPOSAL_ROWS)


@pytest.fixture(scope="session")
def tiny_artifact_q8(tiny_checkpoint, tmp_path_factory):
    """`tiny_checkpoint` converted with the `q8` recipe."""
    return _convert(tiny_checkpoint, tmp_path_factory, "q8")


@pytest.fixture(scope="session")
def tiny_nvfp4_checkpoint(tmp_path_factory):
    """A tiny checkpoint whose experts NVFP4 can store (`tiny_config(nvfp4=True)`: hidden size and expert widths
    128, 4 experts), with per-expert tensors like the published NVFP4 checkpoints."""
    from ninfer_offload.convert.tiny import tiny_config, write_checkpoint

    return write_checkpoint(tmp_path_factory.mktemp("tiny_nvfp4_checkpoint"), tiny_config(nvfp4=True), "per_expert", seed=TINY_SEED)


@pytest.fixture(scope="session")
def tiny_artifact_nvfp4(tiny_nvfp4_checkpoint, tmp_path_factory):
    """`tiny_nvfp4_checkpoint` converted with the `nvfp4` recipe (NVFP4 routed and shared experts)."""
    return _convert(tiny_nvfp4_checkpoint, tmp_path_factory, "nvfp4")


@pytest.fixture(scope="session")
def tiny_artifact_nvfp4_matrices(tiny_nvfp4_checkpoint, tmp_path_factory):
    """`tiny_nvfp4_checkpoint` with its routed and shared experts, attention outputs, embedding and output
    head stored as nvfp4 with various divisor counts, the rest bf16 (`nvfp4_support.build_nvfp4_artifact`)."""
    from nvfp4_support import build_nvfp4_artifact

    return build_nvfp4_artifact(tiny_nvfp4_checkpoint, tmp_path_factory.mktemp("tiny_nvfp4_matrices"))


@pytest.fixture(scope="session")
def small_card(tmp_path_factory):
    """A device profile file (the RTX 5060 Ti without a VRAM reserve) that tiny models can be planned on."""
    path = tmp_path_factory.mktemp("profiles") / "small_card.toml"
    path.write_text('base = "rtx5060ti"\n[gpu]\nreserve_bytes = 0\n')
    return path


@pytest.fixture(scope="session")
def speculating_card(tmp_path_factory):
    """A device profile (the RTX 5090's) on which drafting and a round's host work cost next to nothing (a round is
    its verification's launches), so that the cost model projects speculation to pay and `--spec auto` speculates."""
    path = tmp_path_factory.mktemp("profiles") / "speculating_card.toml"
    path.write_text('base = "rtx5090"\n[engine]\nmtp_draft_step_s = 1e-6\nspec_round_s = 1e-6\n')
    return path


@pytest.fixture(scope="session")
def half_expert_budget(tiny_artifact_official, small_card) -> int:
    """A VRAM budget on `small_card` that holds everything of the official tiny artifact but half of the
    routed experts (and the embedding), plus the prefill staging buffer and span an offloaded load sets aside."""
    from ninfer_offload import Engine
    from ninfer_offload.planner.memory import prefill_span_bytes, prefill_staging_slots

    full = Engine.load(tiny_artifact_official, profile=str(small_card), spec="none")
    plan, experts = full.expert_plan.plan, full.config.num_experts
    full.close()
    assert plan.components["routed_experts"].host_bytes == 0
    staging = prefill_staging_slots(experts) * max(plan.expert_bytes) + prefill_span_bytes(full.config, plan.options)
    return plan.vram_used_bytes - plan.components["token_embedding"].bytes - plan.components["routed_experts"].bytes // 2 + staging


@pytest.fixture(scope="session")
def frontend(tiny_artifact):
    """The bf16-recipe artifact's text frontend: tokenizer, chat template, stop ids."""
    from ninfer_offload import open_artifact
    from ninfer_offload.frontend import Frontend

    with open_artifact(tiny_artifact) as artifact:
        return Frontend.from_artifact(artifact)


@pytest.fixture(scope="session")
def tiny_engine(tiny_artifact):
    """The bf16-recipe artifact loaded on the CPU, decoding plainly (an Engine holds no per-sequence
    state: safe to share)."""
    from ninfer_offload import Engine

    engine = Engine.load(tiny_artifact, max_sequences=8, spec="none")
    yield engine
    engine.close()


@pytest.fixture(scope="session")
def reprefill_greedy(tiny_engine):
    """16 greedy tokens after GREEDY_PROMPT, each by a full re-prefill (no session state involved)."""
    ids = list(GREEDY_PROMPT)
    for _ in range(16):
        ids.append(int(torch.argmax(tiny_engine.logits(ids)[-1])))
    return ids[len(GREEDY_PROMPT) :]
