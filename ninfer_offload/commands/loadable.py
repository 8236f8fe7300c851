"""Whether `ninfer generate` and `ninfer serve` could use an artifact, checked on no device (`ninfer inspect --verify`).

Nothing here lists what a load needs: the frontend parses the resources as a load does (tokenizer
with `tokenizers`, its config and the generation config as JSON, the chat template compiled by
jinja2) and the loader itself (`runtime.loader.load_model`) runs on the meta device, so it reads
every binding `Engine.load` reads (the MTP module's and the proposal head's too when the artifact
has them) and applies its own shape checks, while no weight is kept.
"""

from __future__ import annotations

import torch

from ninfer_offload.artifact.errors import ArtifactError
from ninfer_offload.errors import NinferError
from ninfer_offload.frontend import Frontend
from ninfer_offload.artifact.dims import ModelDims
from ninfer_offload.runtime.expert_store import ExpertPlacement
from ninfer_offload.runtime.loader import load_model
from ninfer_offload.runtime.sampling import sampling_from_config


def resource_problems(artifact) -> list[str]:
    """Why the text resources would be refused (empty when they parse)."""
    try:
        frontend = Frontend.from_artifact(artifact)
        sampling_from_config(frontend.generation_config)
    except (NinferError, UnicodeDecodeError) as err:
        return [f"resources: {err}"]
    return [] if frontend.template is not None else ["resources: no chat template (chat_template.jinja)"]


def load_problems(artifact, progress: bool = False) -> list[str]:
    """Why `Engine.load` would refuse the artifact: the first missing or misshapen binding, or a bad config."""
    try:
        if "text" not in artifact.components:
            raise ArtifactError(f"{artifact.path.name} has no text component")
        config = ModelDims.from_text_config(artifact.components["text"].config)
        mtp = "mtp" in artifact.components
        placement = ExpertPlacement.resident(config.num_layers + mtp, config.num_experts)
        proposal = mtp and artifact.components["text"].proposal is not None
        load_model(
            artifact, config, torch.device("meta"), torch.float32, placement, with_mtp=mtp, progress=progress, with_proposal=proposal
        )
    except (NinferError, ValueError) as err:
        return [f"load: {err}"]
    return []
