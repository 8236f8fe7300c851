"""Speculative decoding with the model's MTP layer: draft K tokens, verify them in one target step.

One round, for a sequence whose next token (the anchor) is known but not yet fed:
1. draft: the MTP layer's last output (from the previous round) gives draft 1; each further draft
   feeds the drafted token and the MTP hidden state back (K - 1 more MTP steps);
2. verify: one target step over [anchor, draft 1..K] (T = K + 1, a CUDA graph per K);
3. accept drafts left to right with probability min(1, p/q) (p: the target's distribution, q: the
   draft's, both after the same penalties and filters); at the first rejection draw from the
   normalised residual max(0, p - q), or after K acceptances from the target's last distribution.
   Greedy is the one-hot case: the longest prefix matching the target's argmaxes, then its argmax.
   The output distribution is the target's;
4. keep the anchor and the accepted drafts (`Session.commit`: rejected positions leave no KV or
   GDN state behind), drop the MTP layer's draft entries and feed it the target's hidden states of
   the kept tokens with their successors, which also yields the next round's first draft.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from ninfer_offload.runtime.sampling import Sampler


@dataclass
class SpeculationStats:
    """Drafted and accepted tokens of a generation; `accepted_at[i]`: rounds that accepted draft i + 1."""

    rounds: int = 0
    drafted: int = 0
    accepted: int = 0
    accepted_at: list[int] = field(default_factory=list)

    def to_json(self) -> dict:
        return {
            "rounds": self.rounds,
            "drafted": self.drafted,
            "accepted": self.accepted,
            "acceptance_rate": self.accepted / self.drafted if self.drafted else 0.0,
            "acceptance_at": [n / self.rounds for n in self.accepted_at] if self.rounds else [],
            "tokens_per_round": (self.accepted + self.rounds) / self.rounds if self.rounds else 0.0,
        }


def accept_drafts(
    sampler: Sampler, logits: torch.Tensor, drafts: list[int], draft_probs: list[torch.Tensor], history: list[int], prompt: list[int]
) -> tuple[list[int], int]:
    """(accepted drafts, the token after them) by the speculative acceptance rule, from the target's
    logits [K + 1, vocab] at the anchor and each draft, the drafts and the distributions they were drawn from."""
    accepted: list[int] = []
    for i, (draft, q) in enumerate(zip(drafts, draft_probs)):
        p = sampler.probabilities(logits[i], history + accepted, prompt)
        if sampler.uniform(p.device) * float(q[draft]) < float(p[draft]):  # accept with probability min(1, p/q)
            accepted.append(draft)
            continue
        residual = torch.clamp(p - q, min=0.0)
        total = float(residual.sum())
        return accepted, sampler.draw(residual / total if total > 0 else p)
    p = sampler.probabilities(logits[len(accepted)], history + accepted, prompt)
    return accepted, sampler.draw(p)


class MtpSpeculator:
    """Speculative decoding of one session with `draft_tokens` MTP drafts per round."""

    def __init__(self, session, sampler: Sampler, prompt: Sequence[int], draft_tokens: int):
        self.session = session
        self.engine = session.engine
        self.sampler = sampler
        self.prompt = list(prompt)
        self.draft_tokens = draft_tokens
        self.stats = SpeculationStats(accepted_at=[0] * draft_tokens)
        self._draft_logits: torch.Tensor | None = None  # [vocab]: the MTP layer's prediction of the token after the anchor
        self._draft_hidden: torch.Tensor | None = None  # [1, H]: its hidden state, fed back for further drafts

    def prefill(self) -> int:
        """Run the prompt through the target and the MTP layer; the first generated token."""
        logits, hidden = self.session.forward(self.prompt)
        token = self.sampler.sample(logits[-1], [], self.prompt)
        self._follow(hidden, self.prompt[1:] + [token])
        return token

    def round(self, anchor: int, history: list[int]) -> list[int]:
        """Feed `anchor` (the last token of `history`, the output so far) and as many accepted drafts
        as the target agrees with; returns the tokens that follow `anchor` (at least one)."""
        session, engine = self.session, self.engine
        k = min(self.draft_tokens, engine.max_context - session.length - 1)
        mtp_start = session.mtp_length
        drafts, draft_probs = self._draft(k, history)
        logits, hidden = engine.step([session], [[anchor] + drafts], with_hidden=True)
        accepted, following = accept_drafts(self.sampler, logits[0], drafts, draft_probs, history, self.prompt)
        if k:
            session.commit(len(accepted) + 1)
        session.forget_mtp(session.mtp_length - mtp_start)
        self._follow(hidden[: len(accepted) + 1], accepted + [following])
        self.stats.rounds += 1
        self.stats.drafted += k
        self.stats.accepted += len(accepted)
        for i in range(len(accepted)):
            self.stats.accepted_at[i] += 1
        return accepted + [following]

    def _draft(self, k: int, history: list[int]) -> tuple[list[int], list[torch.Tensor]]:
        drafts, probs = [], []
        logits, hidden = self._draft_logits, self._draft_hidden
        for i in range(k):
            q = self.sampler.probabilities(logits, history + drafts, self.prompt)
            drafts.append(self.sampler.draw(q))
            probs.append(q)
            if i + 1 < k:
                step_logits, hidden = self.session.mtp(hidden, [drafts[-1]])
                logits = step_logits[0]
        return drafts, probs

    def _follow(self, hidden: torch.Tensor, next_ids: list[int]) -> None:
        """Append target hidden states and their successors to the MTP layer's cache; keep its last prediction."""
        logits, mtp_hidden = self.session.mtp(hidden, next_ids)
        self._draft_logits, self._draft_hidden = logits[-1], mtp_hidden[-1:]
