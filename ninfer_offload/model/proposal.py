"""The proposal head: a small output head over a subset of the vocabulary that drafts from the MTP
layer's hidden state instead of the full output head (docs/format.md, proposal component)."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from ninfer_offload.artifact.errors import ArtifactError
from ninfer_offload.model.backend import Backend
from ninfer_offload.model.weights import Weight, WeightReader


@dataclass
class ProposalHead:
    """`head` [R, H] gives logits over the R token ids `token_ids` (unique, in [0, vocab))."""

    head: Weight
    token_ids: torch.Tensor  # [R] int64
    vocab_size: int

    @classmethod
    def load(cls, reader: WeightReader, record: dict | None, hidden_size: int, vocab_size: int) -> "ProposalHead":
        """The head the text component's proposal `record` describes: "indexed" (`rows` rows and
        their token ids) or "full" (every id of the vocabulary, in order)."""
        name = reader.artifact.path.name
        if record is None:
            raise ArtifactError(f"{name} has no proposal head (its text component carries no proposal record)")
        if record["domain"] == "full":
            ids = torch.arange(vocab_size, device=reader.device)
        else:
            ids = reader.dense("proposal/token_ids", (record["rows"],), dtype=torch.int64)
            host = reader.artifact.tensor("proposal/token_ids")  # checked here, whatever the device (meta included)
            if int(host.min()) < 0 or int(host.max()) >= vocab_size or host.unique().numel() != host.numel():
                raise ArtifactError(f"proposal/token_ids of {name} are not unique ids in [0, {vocab_size})")
        return cls(reader.matrix("proposal/head", (ids.numel(), hidden_size)), ids, vocab_size)

    def logits(self, backend: Backend, hidden: torch.Tensor) -> torch.Tensor:
        """Logits [T, vocab] (float32) of hidden states [T, H]: the head's at its token ids, -inf
        elsewhere, so that any distribution derived from them is zero outside the subset."""
        subset = backend.linear(hidden, self.head).float()
        full = torch.full((hidden.shape[0], self.vocab_size), -math.inf, device=subset.device)
        return full.index_copy_(1, self.token_ids, subset)
