"""How a load decodes: the speculation a `LoadRequest` asks for (`spec`, `draft_tokens`, `proposal_head`:
`--spec`, `--draft-tokens`, `--proposal-head`) resolved against what the artifact carries.

"auto" is speculation with the MTP layer when the artifact has MTP weights, plain decoding
otherwise: the planner's own model default (`planner.options.model_defaults`). The default is
"none" while a verify step costs more than the accepted drafts save (`bench/results/spec_h200.json`).
"""

from __future__ import annotations

from dataclasses import dataclass

from ninfer_offload.artifact.inventory import Inventory
from ninfer_offload.errors import NinferError
from ninfer_offload.planner.options import model_defaults
from ninfer_offload.planner.request import DEFAULT_DRAFT_TOKENS, LoadRequest


@dataclass(frozen=True)
class Speculation:
    """A resolved choice: `mode` none or mtp; `draft_tokens` the MTP drafts per round with mtp, else
    the most tokens a multi-token step may roll back (asked for with spec "none" only: "auto"
    without MTP weights keeps none); `proposal_head` drafts with the proposal head."""

    mode: str
    draft_tokens: int
    proposal_head: bool

    @property
    def spec_tokens(self) -> int:
        """Drafts per speculative round of `generate` (0: plain decoding)."""
        return self.draft_tokens if self.mode == "mtp" else 0

    def describe(self) -> str:
        """A few words for a log line."""
        if self.mode != "mtp":
            return "no speculation"
        return f"{self.draft_tokens} MTP drafts per step" + (" from the proposal head" if self.proposal_head else "")


def resolve_speculation(request: LoadRequest, inventory: Inventory, name: str) -> Speculation:
    """The speculation a load of the artifact `name` gets, or a one-line NinferError naming the flag to change
    (the request's own values were checked when it was made)."""
    spec, proposal_head = request.spec, request.proposal_head
    available = model_defaults(inventory)["speculative"]
    has_mtp = available == "mtp"
    mode = available if spec == "auto" else spec
    if mode == "mtp" and not has_mtp:
        raise NinferError(f"{name} has no MTP weights to draft with; use --spec none")
    if proposal_head and not has_mtp:
        raise NinferError(f"{name} has no MTP weights, which the proposal head drafts from; drop --proposal-head")
    if proposal_head and mode != "mtp":
        raise NinferError("the proposal head drafts for MTP speculation; drop --proposal-head or use --spec mtp")
    if proposal_head and not inventory.select("proposal"):
        raise NinferError(f"{name} has no proposal head (proposal/head, proposal/token_ids); drop --proposal-head")
    if mode == "mtp":
        return Speculation(mode, request.draft_tokens or DEFAULT_DRAFT_TOKENS, proposal_head)
    return Speculation(mode, (request.draft_tokens or 0) if spec == "none" else 0, False)
