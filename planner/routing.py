"""Routing statistics: how often each routed expert of each text layer is picked.

Per layer the planner needs `hits[e]`, the expected number of times expert `e` is among a token's
top-k (so `sum(hits) == top_k`). The model's shipped counts
(`planner/data/qwen3_6_35b_a3b_routing_counts.txt`: one line per text layer, one pick count per
routed expert) are used for Qwen3.6-35B-A3B only; other models get uniform routing
unless `--routing-stats FILE` is given. The shipped counts come from ~2.5k tokens of six prompts,
so hit rates computed from them are in-sample and optimistic.
"""

from __future__ import annotations

from dataclasses import dataclass
from importlib import resources
from pathlib import Path

from ninfer_offload.errors import NinferError

SHIPPED_FILE = "qwen3_6_35b_a3b_routing_counts.txt"
# The model the shipped counts belong to, by the text config values that identify it.
SHIPPED_MODEL = {"num_hidden_layers": 40, "num_experts": 256, "num_experts_per_tok": 8, "hidden_size": 2048, "vocab_size": 248320}


@dataclass(frozen=True)
class RoutingStats:
    """Per-layer expected hits per token, one list of `num_experts` floats per text layer."""

    hits: tuple[tuple[float, ...], ...]
    source: str

    @classmethod
    def from_counts(cls, counts: list[list[int]], top_k: int, source: str) -> "RoutingStats":
        hits = []
        for layer, row in enumerate(counts):
            total = sum(row)
            if total <= 0:
                raise NinferError(f"routing stats {source}: layer {layer} has no counts")
            hits.append(tuple(top_k * c / total for c in row))
        return cls(tuple(hits), source)

    @classmethod
    def uniform(cls, layers: int, experts: int, top_k: int) -> "RoutingStats":
        return cls(tuple(tuple(top_k / experts for _ in range(experts)) for _ in range(layers)), "uniform")

    def check(self, layers: int, experts: int) -> None:
        """NinferError unless these stats have `layers` lines of `experts` values."""
        if len(self.hits) != layers or any(len(row) != experts for row in self.hits):
            shape = f"{len(self.hits)} x {len(self.hits[0]) if self.hits else 0}"
            raise NinferError(f"routing stats {self.source} are {shape}, the model has {layers} layers x {experts} experts")


def parse_counts(text: str, source: str) -> list[list[int]]:
    """Counts from text: one line per layer, whitespace-separated non-negative integers."""
    counts = []
    for number, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        try:
            row = [int(v) for v in line.split()]
        except ValueError:
            raise NinferError(f"routing stats {source}: line {number} holds a value that is not an integer") from None
        if any(v < 0 for v in row):
            raise NinferError(f"routing stats {source}: line {number} holds a negative count")
        counts.append(row)
    if not counts:
        raise NinferError(f"routing stats {source} are empty")
    return counts


def load_routing_stats(path: str | Path, top_k: int) -> RoutingStats:
    try:
        text = Path(path).read_text()
    except OSError as err:
        raise NinferError(f"cannot read routing stats {path}: {err.strerror or err}") from None
    return RoutingStats.from_counts(parse_counts(text, str(path)), top_k, str(path))


def shipped_routing_stats() -> RoutingStats:
    text = resources.files("ninfer_offload.planner").joinpath("data", SHIPPED_FILE).read_text()
    return RoutingStats.from_counts(parse_counts(text, SHIPPED_FILE), SHIPPED_MODEL["num_experts_per_tok"], f"shipped:{SHIPPED_FILE}")


def default_routing_stats(text_config: dict, layers: int, experts: int) -> RoutingStats:
    """The shipped counts when the text config is Qwen3.6-35B-A3B's, else uniform routing."""
    if all(text_config.get(k) == v for k, v in SHIPPED_MODEL.items()):
        return shipped_routing_stats()
    return RoutingStats.uniform(layers, experts, int(text_config.get("num_experts_per_tok", 1)))
