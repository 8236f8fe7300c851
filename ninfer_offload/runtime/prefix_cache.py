"""The prompt cache: saved sequence states keyed by their token ids, so that a request re-reads only what is new.

30 of the model's 40 layers are Gated DeltaNet layers whose state is a fixed-size summary of every token before,
so a sequence can only be resumed where that state was saved. The cache is a radix tree of saved positions:
each node is one `model.state_snapshot.StatePiece` covering the tokens from its parent's position to its own
(those tokens' attention and MTP rows, the GDN state at its end). A request resumes at the deepest node whose
path its prompt starts with (leaving at least one prompt token to prefill, which gives the first token's
logits), restoring the chain of pieces into its slot; the decode loop saves at `every`-token boundaries, where
the prompt leaves the tree (`Match.branch`: a later prompt sharing that prefix resumes there), at the end of the
prompt and at the end of the sequence. A save inside a node's tokens splits it.

Two tiers with a bound each: pieces live in device memory up to `device_bytes`, the least recently used moving
to (pinned) host memory beyond it; host memory holds up to `host_bytes`, the least recently used dropped beyond
it with the nodes saved after them. A hit brings its host pieces back to the device first (queued copies, which
the prefill's launches follow without waiting). Using a node also uses its ancestors, and they count as used
after it, so the least recently used node is always a leaf of its tier's order.
"""

from __future__ import annotations

import itertools
import threading
from dataclasses import dataclass, field

import torch

from ninfer_offload.model.state_pool import StatePool
from ninfer_offload.model.state_snapshot import StatePiece, capture, restore

@dataclass(eq=False)
class _Node:
    """A saved position: the tokens from its parent's position (`tokens`) and their state (`piece`)."""

    parent: "_Node | None"
    tokens: tuple[int, ...]
    end: int
    piece: StatePiece | None  # None: the root (position 0)
    children: list["_Node"] = field(default_factory=list)
    used: int = 0
    on_host: bool = False

    @property
    def start(self) -> int:
        return self.end - len(self.tokens)

    def path(self) -> list["_Node"]:
        """The nodes from the root's first child down to this one."""
        nodes, node = [], self
        while node.parent is not None:
            nodes.append(node)
            node = node.parent
        return nodes[::-1]


@dataclass(frozen=True)
class Match:
    """Where a prompt meets the cache: `tokens` cached prompt tokens to resume (0: none), the pieces that restore them
    (held here, so they stay valid whatever the cache evicts meanwhile), the hidden state of the last resumed token
    (with MTP), and `branch`: a position past `tokens` worth saving at (None if none): where the prompt leaves a saved
    node's tokens, or the end of the node a match with MTP could not enter for want of its MTP rows."""

    tokens: int
    pieces: tuple[StatePiece, ...]
    hidden: torch.Tensor | None
    branch: int | None


@dataclass
class CacheCounters:
    lookups: int = 0
    hits: int = 0  # lookups that resumed some tokens
    prompt_tokens: int = 0  # of every lookup
    hit_tokens: int = 0  # resumed
    saves: int = 0
    demoted: int = 0  # pieces moved to host memory
    promoted: int = 0  # pieces brought back to the device
    evicted: int = 0  # nodes dropped

    def to_json(self) -> dict:
        rate = self.hit_tokens / self.prompt_tokens if self.prompt_tokens else 0.0
        return {**self.__dict__, "hit_rate": rate}


def _common_length(a: tuple[int, ...], b: tuple[int, ...]) -> int:
    """Length of the longest common prefix of `a` and `b` (slice comparisons, a binary search where they differ)."""
    n = min(len(a), len(b))
    if a[:n] == b[:n]:
        return n
    low, high = 0, n  # a[:low] == b[:low], a[:high] != b[:high]
    while high - low > 1:
        mid = (low + high) // 2
        if a[low:mid] == b[low:mid]:
            low = mid
        else:
            high = mid
    return low


class PrefixCache:
    """Saved states of the sequences of `pool` (see the module docstring). `mtp_key`: the MTP layer's key in the pool
    (None: no MTP layer); `every`: tokens between the saved positions of a long prefill."""

    def __init__(
        self, pool: StatePool, device: torch.device, device_bytes: int, host_bytes: int, every: int, mtp_key: int | None = None,
    ):
        self.pool = pool
        self.device = device
        self.device_bytes = device_bytes
        self.host_bytes = host_bytes
        self.every = every
        self.mtp_key = mtp_key
        self.counters = CacheCounters()
        self._root = _Node(None, (), 0, None)
        self._clock = itertools.count(1)
        self._lock = threading.RLock()  # `stats` may be read from another thread (a server's health route)
        # CUDA: demotions copy on a stream of their own, beside the decode steps queued after a save
        self._copies = torch.cuda.Stream(device) if device.type == "cuda" else None

    # ------------------------------------------------------------------ lookups
    def match(self, prompt: list[int], with_mtp: bool = False) -> Match:
        """The longest saved prefix of `prompt` shorter than it (with `with_mtp` one whose MTP rows were saved too);
        the nodes on its path count as used."""
        with self._lock:
            return self._match(tuple(prompt), with_mtp)

    def _match(self, ids: tuple[int, ...], with_mtp: bool) -> Match:
        node, pos, branch = self._root, 0, None
        while True:
            best = None
            for child in node.children:
                common = _common_length(child.tokens, ids[pos:])
                if common == len(child.tokens):
                    best = child
                elif 0 < common and pos + common < len(ids):
                    branch = pos + common
            if best is not None and best.end < len(ids) and with_mtp and best.piece.mtp_kv is None:
                branch = best.end  # saved without MTP rows: saving there again adds them
                break
            if best is None or best.end >= len(ids):
                if best is not None:
                    branch = None  # the prompt ends inside or at the end of a node: the prompt's end is saved anyway
                break
            node, pos, branch = best, best.end, None
        self.counters.lookups += 1
        self.counters.prompt_tokens += len(ids)
        if node is self._root:
            return Match(0, (), None, branch)
        self._touch(node)
        path = node.path()
        for n in path:
            if n.on_host:
                if self._copies is not None:  # its demotion's copies first
                    torch.cuda.current_stream(self.device).wait_stream(self._copies)
                n.piece, n.on_host = n.piece.moved(self.device), False
                self.counters.promoted += 1
        pieces = tuple(n.piece for n in path)
        self._fit()
        self.counters.hits += 1
        self.counters.hit_tokens += pos
        return Match(pos, pieces, pieces[-1].hidden if with_mtp else None, branch)

    def restore(self, slot: int, match: Match) -> None:
        """Give `slot` (an empty sequence) the state of `match`'s resumed prefix."""
        with_mtp = match.hidden is not None
        restore(self.pool, slot, list(match.pieces), self.mtp_key if with_mtp else None)

    def save_points(self, prompt_length: int, match: Match, also: tuple[int, ...] = ()) -> list[int]:
        """The positions of a prompt of `prompt_length` tokens that resumed `match` worth saving at, ascending: each
        multiple of `every` after the resumed tokens, `match.branch` and the positions `also`, the prompt's end."""
        points = set(range((match.tokens // self.every + 1) * self.every, prompt_length, self.every))
        for point in (match.branch, *also):
            if point is not None and match.tokens < point < prompt_length:
                points.add(point)
        return sorted(points | {prompt_length})

    # ------------------------------------------------------------------ saves
    def save(self, slot: int, token_ids: list[int], hidden: torch.Tensor | None = None) -> None:
        """Save the state of the sequence in `slot`, which holds `token_ids`; `hidden` (the final-normed hidden state
        of its last token) where its MTP rows are kept too (a sequence drafting with MTP)."""
        with self._lock:
            self._save(slot, tuple(token_ids), hidden)

    def _save(self, slot: int, ids: tuple[int, ...], hidden: torch.Tensor | None) -> None:
        node, pos = self._root, 0
        while pos < len(ids):
            child = next((c for c in node.children if c.end <= len(ids) and ids[pos : c.end] == c.tokens), None)
            if child is None:
                break
            node, pos = child, child.end
        if pos == len(ids):  # saved already; with MTP rows now if it lacked them and its ancestors have them
            parent = node.parent
            if parent is not None and node.piece.mtp_kv is None and self._with_mtp(parent, hidden):
                node.piece = capture(self.pool, slot, node.start, node.end, self.mtp_key, hidden)
                node.on_host = False
                self.counters.saves += 1
            self._touch(node)
            self._fit()
            return
        with_mtp = self._with_mtp(node, hidden)
        piece = capture(self.pool, slot, pos, len(ids), self.mtp_key if with_mtp else None, hidden)
        added = _Node(node, ids[pos:], len(ids), piece)
        inside = next((c for c in node.children if c.tokens[: len(added.tokens)] == added.tokens), None)
        if inside is not None:  # the new position lies inside a child's tokens: it becomes that child's parent
            node.children.remove(inside)
            self._trim(inside, len(ids))
            inside.parent = added
            added.children.append(inside)
        node.children.append(added)
        self.counters.saves += 1
        self._touch(added)
        self._fit()

    def _with_mtp(self, parent: _Node, hidden: torch.Tensor | None) -> bool:
        """Whether a position saved after `parent` keeps the MTP layer's rows: the saver gives its hidden state, the
        engine has the layer, and every node up to `parent` kept them too."""
        return hidden is not None and self.mtp_key is not None and all(n.piece.mtp_kv is not None for n in parent.path())

    def _trim(self, node: _Node, start: int) -> None:
        """Drop the tokens before `start` from `node` (a new parent holds them)."""
        cut = start - node.start
        piece = node.piece
        mtp_cut = start - 1 - max(piece.start - 1, 0)
        node.piece = StatePiece(
            start, piece.end, {key: (k[cut:].clone(), v[cut:].clone()) for key, (k, v) in piece.kv.items()}, piece.conv,
            piece.recurrent, None if piece.mtp_kv is None else (piece.mtp_kv[0][mtp_cut:].clone(), piece.mtp_kv[1][mtp_cut:].clone()),
            piece.hidden,
        )
        node.tokens = node.tokens[cut:]

    # ------------------------------------------------------------------ tiers and bounds
    def _nodes(self) -> list[_Node]:
        nodes, stack = [], list(self._root.children)
        while stack:
            node = stack.pop()
            nodes.append(node)
            stack.extend(node.children)
        return nodes

    def memory(self) -> tuple[int, int]:
        """(device bytes, host bytes) of the saved pieces."""
        with self._lock:
            nodes = self._nodes()
        return sum(n.piece.nbytes for n in nodes if not n.on_host), sum(n.piece.nbytes for n in nodes if n.on_host)

    def resize(self, device_bytes: int, host_bytes: int) -> None:
        """New bounds for the two tiers, applied at once."""
        with self._lock:
            self.device_bytes, self.host_bytes = device_bytes, host_bytes
            self._fit()

    def _touch(self, node: _Node) -> None:
        """`node` and its ancestors are used now, the ancestors after it."""
        while node.parent is not None:
            node.used = next(self._clock)
            node = node.parent

    def _fit(self) -> None:
        """Move the least recently used device pieces to host memory while the device tier is over its bound, then drop
        the least recently used host pieces (with the nodes saved after them) while the host tier is over its."""
        nodes = self._nodes()
        on_device = sorted((n for n in nodes if not n.on_host), key=lambda n: n.used)
        device_bytes = sum(n.piece.nbytes for n in on_device)
        for node in on_device:
            if device_bytes <= self.device_bytes:
                break
            device_bytes -= node.piece.nbytes
            node.piece, node.on_host = node.piece.moved(torch.device("cpu"), self._copies), True
            self.counters.demoted += 1
        on_host = sorted((n for n in nodes if n.on_host), key=lambda n: n.used)
        host_bytes = sum(n.piece.nbytes for n in on_host)
        for node in on_host:
            if host_bytes <= self.host_bytes:
                break
            if node.parent is None:  # already dropped with an ancestor
                continue
            node.parent.children.remove(node)
            for dropped in [node, *self._descendants(node)]:
                if dropped.on_host:
                    host_bytes -= dropped.piece.nbytes
                dropped.parent = None
                self.counters.evicted += 1

    @staticmethod
    def _descendants(node: _Node) -> list[_Node]:
        found, stack = [], list(node.children)
        while stack:
            child = stack.pop()
            found.append(child)
            stack.extend(child.children)
        return found

    def stats(self) -> dict:
        """Counters, entries and the memory of each tier, for `/health` and the logs."""
        with self._lock:
            return self._stats()

    def _stats(self) -> dict:
        device, host = self.memory()
        return {
            **self.counters.to_json(), "entries": len(self._nodes()), "device_bytes": device, "host_bytes": host,
            "device_limit": self.device_bytes, "host_limit": self.host_bytes, "save_every": self.every,
        }
