"""The options `generate` and `serve` share for placing the model (experts, profile, VRAM budget,
cache policy, miss path) and for speculation, checked before the slow load and turned into
`Engine.load` arguments."""

from __future__ import annotations

import typer

from ninfer_offload.errors import NinferError
from ninfer_offload.planner.cache_policy import POLICIES
from ninfer_offload.planner.options import MAX_DRAFTS, MISS_PATHS, parse_size
from ninfer_offload.runtime.spec_choice import SPEC_CHOICES

EXPERTS_OPTION = typer.Option(
    "auto", "--experts",
    help="auto (all in VRAM where they fit, else as planned), resident (all in VRAM) or host (all in host memory, read over PCIe).",
)
PROFILE_OPTION = typer.Option(
    None, "--profile", help="Plan the load for this card: a profile name, TOML file or auto (this GPU's stored or detected profile)."
)
VRAM_BUDGET_OPTION = typer.Option(
    None, "--vram-budget", help="Use at most this much VRAM (e.g. 15GiB); the experts that do not fit stay in host memory."
)
CACHE_POLICY_OPTION = typer.Option(
    "decayed", "--cache-policy", help="Expert cache in VRAM: decayed (frequency), lru or static (the plan's experts only)."
)
MISS_PATH_OPTION = typer.Option(
    "pcie", "--miss-path",
    help="Experts not in VRAM: pcie (read by the GPU from host memory), cpu (computed on the host) "
    "or auto (both, split by measured rates).",
)


SPEC_OPTION = typer.Option(
    "none", "--spec",
    help="none (default): one token per step; mtp: decode speculatively, drafting with the model's MTP layer (server: requests "
    "without a grammar or logprobs); auto: mtp when the artifact has MTP weights, else none. An artifact's DFlash/DFlash2 "
    "drafter is never run.",
)
DRAFT_TOKENS_OPTION = typer.Option(3, "--draft-tokens", help="MTP drafts verified per step when speculating (1..5).")
PROPOSAL_HEAD_OPTION = typer.Option(
    False, "--proposal-head", help="Draft with the artifact's proposal head (a subset of the vocabulary) instead of the output head."
)


# Draft models some artifacts carry (components of these names) that this engine never runs.
DRAFT_MODELS = ("dflash", "dflash2")


def engine_speculation(spec: str, draft_tokens: int, proposal_head: bool) -> dict:
    """`Engine.load` keyword arguments of the speculation options, or a NinferError naming the bad flag
    (what depends on the artifact, such as its MTP weights, is checked by the load)."""
    if spec in DRAFT_MODELS:
        raise NinferError(
            f"--spec {spec}: drafting with a DFlash model is not supported; an artifact's {spec} component is carried "
            "but never run: use --spec auto, mtp or none"
        )
    if spec not in SPEC_CHOICES:
        raise NinferError(f"--spec must be one of {', '.join(SPEC_CHOICES)}, got {spec!r}")
    if spec != "none" and not 1 <= draft_tokens <= MAX_DRAFTS:
        raise NinferError(f"--draft-tokens must be 1..{MAX_DRAFTS}, got {draft_tokens}")
    return {"spec": spec, "draft_tokens": draft_tokens if spec != "none" else 0, "proposal_head": proposal_head}


def engine_placement(experts: str, profile: str | None, vram_budget: str | None, cache_policy: str, miss_path: str) -> dict:
    """`Engine.load` keyword arguments of the placement options, or a NinferError naming the bad flag."""
    from ninfer_offload.runtime.expert_store import MODES

    if experts not in MODES:
        raise NinferError(f"--experts must be one of {', '.join(MODES)}, got {experts!r}")
    if miss_path not in MISS_PATHS:
        raise NinferError(f"--miss-path must be one of {', '.join(MISS_PATHS)}, got {miss_path!r}")
    if cache_policy not in POLICIES:
        raise NinferError(f"--cache-policy must be one of {', '.join(POLICIES)}, got {cache_policy!r}")
    if experts == "resident" and (profile is not None or vram_budget is not None):
        raise NinferError("--experts resident keeps every expert in VRAM; drop --profile/--vram-budget, or use --experts auto")
    if miss_path != "pcie" and experts != "host" and vram_budget is None and profile is None:
        raise NinferError(f"--miss-path {miss_path} computes experts kept in host memory: add --experts host or a --vram-budget")
    budget = parse_size(vram_budget) if vram_budget is not None else None
    if budget is not None and budget <= 0:
        raise NinferError("--vram-budget must be more than 0")
    return {
        "experts": experts,
        "profile": profile,
        "vram_budget": budget,
        "cache_policy": cache_policy,
        "miss_path": None if miss_path == "pcie" else miss_path,
    }
