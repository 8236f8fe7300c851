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
The server batches step 2 over its sequences (`draft`, one `Engine.step`, `settle` per sequence),
each sequence keeping its own number of drafts.
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
    sampler: Sampler, logits: torch.Tensor, drafts: list[int], draft_probs: list[torch.Tensor | None], history: list[int], prompt: list[int]
) -> tuple[list[int], int]:
    """(accepted drafts, the token after them) by the speculative acceptance rule, from the target's
    logits [K + 1, vocab] at the anchor and each draft, the drafts and the distributions they were drawn from."""
    if sampler.params.is_greedy:
        return _accept_greedy(sampler, logits, drafts, history, prompt)
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


def _accept_greedy(
    sampler: Sampler, logits: torch.Tensor, drafts: list[int], history: list[int], prompt: list[int]
) -> tuple[list[int], int]:
    """Greedy acceptance: the longest prefix of drafts equal to the target's argmaxes, then its argmax
    (without penalties every position's argmax is read in one transfer)."""
    if not sampler.params.adjusts_logits:
        targets = logits.argmax(-1).tolist()
    else:
        targets = []
        for i in range(len(drafts) + 1):
            targets.append(sampler.sample(logits[i], history + drafts[:i], prompt))
            if i < len(drafts) and targets[i] != drafts[i]:
                break
    accepted = 0
    while accepted < len(drafts) and drafts[accepted] == targets[accepted]:
        accepted += 1
    return drafts[:accepted], targets[accepted]


def draft_together(
    speculators: list["MtpSpeculator"], k: int, histories: list[list[int]]
) -> list[tuple[list[int], list[torch.Tensor | None]]]:
    """`k` drafts for each speculator (its drafted tokens and their distributions: None when greedy,
    whose acceptance never reads them), the MTP steps of all of them batched into one forward per
    draft position."""
    for speculator in speculators:
        speculator._mtp_start = speculator.session.mtp_length
    if speculators and all(s.sampler.params.picks_argmax for s in speculators):
        return [(drafts, [None] * k) for drafts in _argmax_drafts(speculators, k)]
    drafts: list[list[int]] = [[] for _ in speculators]
    probs: list[list[torch.Tensor | None]] = [[] for _ in speculators]
    logits = [s._draft_logits for s in speculators]
    hidden = torch.cat([s._draft_hidden for s in speculators]) if speculators else None
    for i in range(k):
        for j, speculator in enumerate(speculators):
            sampler, seen = speculator.sampler, histories[j] + drafts[j]
            if sampler.params.is_greedy:  # greedy acceptance never reads q
                drafts[j].append(sampler.sample(logits[j], seen, speculator.prompt))
                probs[j].append(None)
                continue
            q = sampler.probabilities(logits[j], seen, speculator.prompt)
            drafts[j].append(sampler.draw(q))
            probs[j].append(q)
        if i + 1 < k:
            engine = speculators[0].engine
            step_logits, hidden = engine.mtp_step([s.session for s in speculators], hidden, [d[-1] for d in drafts])
            logits = list(step_logits)
    return list(zip(drafts, probs))


def _argmax_drafts(speculators: list["MtpSpeculator"], k: int) -> list[list[int]]:
    """`k` greedy drafts for each speculator, each the argmax of the draft logits before it, picked on the device
    and fed to the next MTP step there (`Engine.mtp_step_on_device`): the steps are queued one after another and
    the drafts read back once."""
    if k == 0:
        return [[] for _ in speculators]
    picked = torch.stack([s._draft_logits for s in speculators]).argmax(dim=-1)
    hidden = torch.cat([s._draft_hidden for s in speculators])
    chain = [picked]
    for _ in range(k - 1):
        logits, hidden = speculators[0].engine.mtp_step_on_device([s.session for s in speculators], hidden, picked)
        picked = logits.argmax(dim=-1)
        chain.append(picked)
    return torch.stack(chain, dim=1).tolist()


class MtpSpeculator:
    """Speculative decoding of one session with `draft_tokens` MTP drafts per round.

    The prompt goes through `feed_prompt` (in chunks if need be), then `start` with the first
    generated token; after that each `round` (or, batched with other sequences, `draft` + one
    shared verify step + `settle`) turns an anchor into the tokens that follow it.
    """

    def __init__(self, session, sampler: Sampler, prompt: Sequence[int], draft_tokens: int):
        self.session = session
        self.engine = session.engine
        self.sampler = sampler
        self.prompt = list(prompt)
        self.draft_tokens = draft_tokens
        self.stats = SpeculationStats(accepted_at=[0] * draft_tokens)
        self._carry: torch.Tensor | None = None  # target hidden state of the last prompt token fed, successor unknown yet
        self._draft_logits: torch.Tensor | None = None  # [vocab]: the MTP layer's prediction of the token after the anchor
        self._draft_hidden: torch.Tensor | None = None  # [1, H]: its hidden state, fed back for further drafts
        self.last_hidden: torch.Tensor | None = None  # [1, H]: target hidden state of the last token the session holds
        self._mtp_start = 0

    def prefill(self) -> int:
        """Run the whole prompt through the target and the MTP layer; the first generated token."""
        token = self.sampler.sample(self.feed_prompt(self.prompt), [], self.prompt)
        self.start(token)
        return token

    def feed_prompt(self, chunk: list[int]) -> torch.Tensor:
        """Append a prompt chunk to the target (and what can be to the MTP layer); logits [vocab] of its last token."""
        engine = self.session.engine
        hidden = engine.prefill(self.session, chunk)  # (the logits of its last token only: a chunk's would take GiBs)
        successors = chunk if self._carry is not None else chunk[1:]
        if self._carry is not None:
            hidden = torch.cat([self._carry, hidden])
        if successors:
            self.session.mtp(hidden[:-1], successors, all_logits=False)  # (its drafts come from the last position on)
        self._carry = self.last_hidden = hidden[-1:]
        return engine.logits_of(self._carry)[0]

    def resume(self, hidden: torch.Tensor) -> None:
        """The session resumed a cached prefix (its MTP entries but the last restored too) whose last token's target
        hidden state is `hidden` [1, H]: the rest of the prompt follows it."""
        self._carry = self.last_hidden = hidden

    def start(self, first_token: int) -> None:
        """The prompt is complete and `first_token` follows it."""
        self._follow(self._carry, [first_token])
        self._carry = None

    def round(self, anchor: int, history: list[int]) -> list[int]:
        """Feed `anchor` (the last token of `history`, the output so far) and as many accepted drafts
        as the target agrees with; returns the tokens that follow `anchor` (at least one)."""
        k = self.room()
        drafts, probs = self.draft(k, history)
        logits, hidden = self.engine.step([self.session], [[anchor] + drafts], with_hidden=True)
        return self.settle(logits[0], hidden, drafts, probs, history)

    def room(self) -> int:
        """Drafts the context still has room for this round."""
        return min(self.draft_tokens, self.engine.max_context - self.session.length - 1)

    def draft(self, k: int, history: list[int]) -> tuple[list[int], list[torch.Tensor]]:
        """`k` drafted tokens and the distributions they were drawn from."""
        return draft_together([self], k, [history])[0]

    def settle(
        self, logits: torch.Tensor, hidden: torch.Tensor, drafts: list[int], probs: list[torch.Tensor | None], history: list[int]
    ) -> list[int]:
        """After the verify step ([anchor] + drafts, logits [k + 1, vocab], hidden [k + 1, H]): accept,
        keep the accepted tokens, resync the MTP layer; returns the tokens that follow the anchor."""
        accepted, following = accept_drafts(self.sampler, logits, drafts, probs, history, self.prompt)
        if drafts:
            self.session.commit(len(accepted) + 1)
        self.session.forget_mtp(self.session.mtp_length - self._mtp_start)
        self._follow(hidden[: len(accepted) + 1], accepted + [following])
        self.stats.rounds += 1
        self.stats.drafted += len(drafts)
        self.stats.accepted += len(accepted)
        for i in range(len(accepted)):
            self.stats.accepted_at[i] += 1
        return accepted + [following]

    def _follow(self, hidden: torch.Tensor, next_ids: list[int]) -> None:
        """Append target hidden states and their successors (1..K + 1 of them) to the MTP layer's cache as
        one MTP decode step; keep its last prediction."""
        logits, mtp_hidden = self.engine.mtp_step([self.session], hidden, next_ids, len(next_ids))
        self._draft_logits, self._draft_hidden = logits[-1], mtp_hidden[-1:]
        self.last_hidden = hidden[-1:]
