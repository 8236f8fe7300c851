"""The proposal head a conversion adds (`ninfer convert --proposal RANKING`, docs/format.md §9): the
output head's rows of the `rows` most frequent token ids of a ranking, every special token among them.

The ranking is a file of little-endian int64 token counts, one per token id from 0 (ids past its
end count 0). The ids are chosen from the tokenizer's domain (its ids, added tokens included):
the special tokens, then the others by descending count (ties: lower id first) up to `rows`; the
list is then stably sorted by descending count and stored as int32 (`proposal/token_ids`), the
head's rows in that order (`proposal/head`).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch
from tokenizers import Tokenizer

from ninfer_offload.convert.checkpoint import Checkpoint
from ninfer_offload.convert.layout import PROPOSAL_HEAD, PROPOSAL_IDS
from ninfer_offload.errors import NinferError


def read_ranking(path: Path) -> np.ndarray:
    """Token counts (int64) of a ranking file."""
    try:
        data = path.read_bytes()
    except OSError as err:
        raise NinferError(f"cannot read ranking {path}: {err.strerror or err}") from None
    if not data or len(data) % 8:
        raise NinferError(f"ranking {path} is not a non-empty file of int64 token counts ({len(data)} bytes)")
    return np.frombuffer(data, dtype="<i8").astype(np.int64)


def tokenizer_domain(tokenizer_json: bytes) -> tuple[int, list[int]]:
    """(number of token ids, special token ids) of a tokenizer.json."""
    tokenizer = Tokenizer.from_str(tokenizer_json.decode("utf-8"))
    specials = sorted(i for i, token in tokenizer.get_added_tokens_decoder().items() if token.special)
    return tokenizer.get_vocab_size(with_added_tokens=True), specials


def proposal_ids(counts: np.ndarray, domain: int, specials: list[int], rows: int) -> np.ndarray:
    """The `rows` token ids of the proposal head, most frequent first (see the module docstring)."""
    if len(counts) > domain:
        raise NinferError(f"the ranking counts {len(counts)} token ids, more than the tokenizer's {domain}")
    if not len(specials) <= rows <= domain:
        raise NinferError(f"--proposal-rows must be between the {len(specials)} special tokens and the tokenizer's {domain} ids, "
                          f"got {rows}")
    full = np.zeros(domain, dtype=np.int64)
    full[: len(counts)] = counts
    special = set(specials)
    others = [i for i in np.argsort(-full, kind="stable").tolist() if i not in special]
    chosen = np.array(specials + others[: rows - len(specials)], dtype=np.int64)
    return chosen[np.argsort(-full[chosen], kind="stable")].astype(np.int32)


class ProposalReader:
    """The converter's tensors (`convert.encode.Tensors`): the proposal's sources from `ids` and the
    output head tensor `head`, every other name from the checkpoint."""

    def __init__(self, checkpoint: Checkpoint, head: str, ids: np.ndarray):
        self.checkpoint, self.head, self.ids = checkpoint, head, ids

    def nvfp4(self, name: str):
        """The checkpoint's stored NVFP4 planes of `name` (never of the proposal's own sources)."""
        return None if name in (PROPOSAL_IDS, PROPOSAL_HEAD) else self.checkpoint.nvfp4(name)

    def read(self, name: str, start: int, stop: int) -> torch.Tensor:
        if name == PROPOSAL_IDS:
            return torch.from_numpy(self.ids[start:stop].copy())
        if name == PROPOSAL_HEAD:
            return self.checkpoint.read_rows(self.head, self.ids[start:stop].tolist())
        return self.checkpoint.read(name, start, stop)
