"""How a load decodes: the speculation a `LoadRequest` asks for (`spec`, `draft_tokens`, `proposal_head`:
`--spec`, `--draft-tokens`, `--proposal-head`) resolved against what the artifact carries and, for
`auto`, against what the planner's cost model projects for the card.

"auto" (the default of `ninfer generate` and `ninfer serve`) speculates with the MTP layer where the
artifact has MTP weights and the cost model projects at least `SPECULATION_MIN_SPEEDUP` over plain
decoding at the stated acceptance (`DEFAULT_MTP_ACCEPTANCE`) for the load's card, budget and sequences
(`planner.speculation.decide_speculation`, which `ninfer plan` decides by too):
the card is the request's profile, or on a GPU this machine's (`--profile auto`: stored by `ninfer
profile`, else measured). Without a card to project for (a CPU load without `--profile`) it decodes plainly.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ninfer_offload.artifact.inventory import Inventory
from ninfer_offload.errors import NinferError
from ninfer_offload.planner.memory import LoadOptions
from ninfer_offload.planner.options import has_mtp
from ninfer_offload.planner.request import DEFAULT_DRAFT_TOKENS, LoadRequest
from ninfer_offload.planner.speculation import decide_speculation
from ninfer_offload.profiles import DeviceProfile, load_profile


@dataclass(frozen=True)
class Speculation:
    """A resolved choice: `mode` none or mtp; `draft_tokens` the MTP drafts per round with mtp, else
    the most tokens a multi-token step may roll back (asked for with spec "none" only: "auto"
    deciding none keeps none); `proposal_head` drafts with the proposal head; `reason` why "auto"
    chose what it did ("" when the mode was asked for)."""

    mode: str
    draft_tokens: int
    proposal_head: bool
    reason: str = ""

    @property
    def spec_tokens(self) -> int:
        """Drafts per speculative round of `generate` (0: plain decoding)."""
        return self.draft_tokens if self.mode == "mtp" else 0

    def describe(self) -> str:
        """A few words for a log line."""
        if self.mode != "mtp":
            chosen = "no speculation"
        else:
            chosen = f"{self.draft_tokens} MTP drafts per step" + (" from the proposal head" if self.proposal_head else "")
        return f"{chosen} (--spec auto: {self.reason})" if self.reason else chosen


def resolve_speculation(
    request: LoadRequest, inventory: Inventory, name: str, device: torch.device, load: LoadOptions
) -> Speculation:
    """The speculation a load of the artifact `name` onto `device` gets, or a one-line NinferError naming the
    flag to change (the request's own values were checked when it was made). `load`: the load's footprint
    options as they would be with MTP speculation (what "auto" projects)."""
    spec, proposal_head = request.spec, request.proposal_head
    mtp = has_mtp(inventory)
    if spec == "mtp" and not mtp:
        raise NinferError(f"{name} has no MTP weights to draft with; use --spec none")
    if proposal_head and not mtp:
        raise NinferError(f"{name} has no MTP weights, which the proposal head drafts from; drop --proposal-head")
    if proposal_head and spec == "none":
        raise NinferError("the proposal head drafts for MTP speculation; drop --proposal-head or use --spec mtp")
    if proposal_head and not inventory.select("proposal"):
        raise NinferError(f"{name} has no proposal head (proposal/head, proposal/token_ids); drop --proposal-head")
    drafts = request.draft_tokens or DEFAULT_DRAFT_TOKENS
    if spec == "mtp":
        return Speculation("mtp", drafts, proposal_head)
    if spec == "none":
        return Speculation("none", request.draft_tokens or 0, False)
    if not mtp:
        return Speculation("none", 0, False, f"{name} has no MTP weights")
    speculates, reason = _projection(request, inventory, device, load)
    return Speculation("mtp", drafts, proposal_head, reason) if speculates else Speculation("none", 0, False, reason)


def _projection(request: LoadRequest, inventory: Inventory, device: torch.device, load: LoadOptions) -> tuple[bool, str]:
    """Whether the cost model projects speculation to pay on the load's card, and the reason in a few words."""
    if isinstance(request.profile, DeviceProfile):
        profile = request.profile
    elif request.profile is not None or device.type == "cuda":
        try:
            profile = load_profile(request.profile or "auto")
        except NinferError as err:
            return False, f"off, no profile of this card to project for ({err})"
    else:
        return False, "off, speculation is projected for a GPU (give --profile, or --spec mtp to force it)"
    decision = decide_speculation(inventory, profile, request.plan_options(load))
    return decision.speculates, decision.reason
