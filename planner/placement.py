"""The planner's answer: what lives where, how much memory it takes, and how fast it should run.

`Placement.to_json()` emits the `ninfer plan --json` document; `PLAN_SCHEMA` is its JSON Schema.
The runtime loader consumes the same object: `resident_experts` (per text layer, hottest first),
`staging_slots`, `kv_capacity_tokens` and the component placements.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from ninfer_offload.planner.options import SPECULATION_MIN_SPEEDUP, PlanOptions

SCHEMA_ID = "ninfer-plan/1"
PLACEMENTS = ("vram", "host", "split", "unused")


@dataclass(frozen=True)
class ComponentPlacement:
    """Stored bytes of a weight component and where they go (VRAM/host bytes as loaded)."""

    bytes: int
    placement: str
    vram_bytes: int
    host_bytes: int


@dataclass(frozen=True)
class Prediction:
    decode_tok_s: float
    decode_tok_s_mtp: float | None
    prefill_tok_s: float
    vram_bytes_per_token: int
    pcie_bytes_per_token: float
    assumptions: tuple[str, ...]
    cache_hit_rate: float | None = None  # expert requests of a decode token served from VRAM, simulated; None: all resident
    decode_tok_s_batch: float | None = None  # all sequences' tokens/s decoding --concurrency sequences together (None: one)

    @property
    def speculation_speedup(self) -> float | None:
        """Decode with MTP over decode without it (None when the plan does not speculate)."""
        return None if self.decode_tok_s_mtp is None else self.decode_tok_s_mtp / self.decode_tok_s

    @property
    def speculates(self) -> bool:
        """Whether speculation pays on this plan: a projected speed-up of at least SPECULATION_MIN_SPEEDUP."""
        speedup = self.speculation_speedup
        return speedup is not None and speedup >= SPECULATION_MIN_SPEEDUP


@dataclass
class Placement:
    profile: str
    options: PlanOptions
    feasible: bool
    reason: str | None
    vram_total_bytes: int
    vram_budget_bytes: int
    vram_used_bytes: int
    host_pinned_bytes: int  # the expert pool of an offloaded load (every record, as locked) and a host-resident embedding
    host_budget_bytes: int
    host_process_bytes: int  # the process's host memory: the pinned bytes and the runtime's own (`planner.RUNTIME_HOST_BYTES`)
    prompt_cache_host_bytes: int  # the prompt cache's host tier (counted in the pinned bytes; 0 without a prompt cache)
    components: dict[str, ComponentPlacement]
    runtime: dict[str, int]  # VRAM not holding weights: reserve, kv_cache, gdn_state, workspace, staging, prefill_staging
    resident_experts: list[list[int]]  # per text layer, expert ids hottest first
    experts_per_layer: int
    expert_bytes: list[int]  # per text layer, bytes of one expert record
    routing_mass_resident: float
    routing_stats: str
    staging_slots: int
    kv_capacity_tokens: int
    predicted: Prediction | None = None
    notes: list[str] = field(default_factory=list)

    @property
    def experts_total(self) -> int:
        return self.experts_per_layer * len(self.resident_experts)

    @property
    def experts_resident(self) -> int:
        return sum(len(ids) for ids in self.resident_experts)

    @property
    def vram_free_bytes(self) -> int:
        return self.vram_budget_bytes - self.vram_used_bytes

    def to_json(self) -> dict:
        predicted = None
        if self.predicted is not None:
            p = self.predicted
            predicted = {
                "decode_tok_s": p.decode_tok_s,
                "decode_tok_s_mtp": p.decode_tok_s_mtp,
                "prefill_tok_s": p.prefill_tok_s,
                "vram_bytes_per_token": p.vram_bytes_per_token,
                "pcie_bytes_per_token": p.pcie_bytes_per_token,
                "speculation_speedup": p.speculation_speedup,
                "speculates": p.speculates,
                "cache_hit_rate": p.cache_hit_rate,
                "decode_tok_s_batch": p.decode_tok_s_batch,
                "assumptions": list(p.assumptions),
            }
        return {
            "schema": SCHEMA_ID,
            "profile": self.profile,
            "feasible": self.feasible,
            "reason": self.reason,
            "options": self.options.to_json(),
            "vram_total_bytes": self.vram_total_bytes,
            "vram_budget_bytes": self.vram_budget_bytes,
            "vram_used_bytes": self.vram_used_bytes,
            "vram_free_bytes": self.vram_free_bytes,
            "host_pinned_bytes": self.host_pinned_bytes,
            "host_budget_bytes": self.host_budget_bytes,
            "host_process_bytes": self.host_process_bytes,
            "prompt_cache_host_bytes": self.prompt_cache_host_bytes,
            "components": {
                name: {"bytes": c.bytes, "placement": c.placement, "vram_bytes": c.vram_bytes, "host_bytes": c.host_bytes}
                for name, c in self.components.items()
            },
            "runtime": dict(self.runtime),
            "experts_total": self.experts_total,
            "experts_resident": self.experts_resident,
            "experts_resident_per_layer": [len(ids) for ids in self.resident_experts],
            "resident_expert_ids": [list(ids) for ids in self.resident_experts],
            "expert_bytes_per_layer": list(self.expert_bytes),
            "routing_mass_resident": self.routing_mass_resident,
            "routing_stats": self.routing_stats,
            "staging_slots": self.staging_slots,
            "kv_capacity_tokens": self.kv_capacity_tokens,
            "predicted": predicted,
        }


_INT = {"type": "integer", "minimum": 0}
_NUMBER = {"type": "number", "minimum": 0}
_INT_LIST = {"type": "array", "items": _INT}

PLAN_SCHEMA: dict = {
    "type": "object",
    "additionalProperties": False,
    "required": [
        "schema", "profile", "feasible", "reason", "options", "vram_total_bytes", "vram_budget_bytes",
        "vram_used_bytes", "vram_free_bytes", "host_pinned_bytes", "host_budget_bytes", "host_process_bytes",
        "prompt_cache_host_bytes", "components", "runtime",
        "experts_total", "experts_resident", "experts_resident_per_layer", "resident_expert_ids",
        "expert_bytes_per_layer", "routing_mass_resident", "routing_stats", "staging_slots", "kv_capacity_tokens",
        "predicted",
    ],
    "properties": {
        "schema": {"type": "string", "enum": [SCHEMA_ID]},
        "profile": {"type": "string"},
        "feasible": {"type": "boolean"},
        "reason": {"type": ["string", "null"]},
        "options": {
            "type": "object",
            "additionalProperties": False,
            "required": [
                "max_context", "concurrency", "kv_dtype", "speculative", "drafts", "proposal_head", "vision",
                "prefill_chunk", "vram_reserve", "vram_budget", "host_budget", "mtp_acceptance", "at_context", "miss_path",
                "prompt_cache", "prompt_cache_vram", "prompt_cache_host",
            ],
            "properties": {
                "max_context": _INT, "concurrency": _INT, "kv_dtype": {"type": "string", "enum": ["bf16", "fp8", "int8"]},
                "speculative": {"type": "string", "enum": ["none", "mtp"]}, "drafts": _INT,
                "proposal_head": {"type": "boolean"}, "vision": {"type": "boolean"}, "prefill_chunk": _INT,
                "vram_reserve": {"type": ["integer", "null"], "minimum": 0},
                "vram_budget": {"type": ["integer", "null"], "minimum": 0},
                "host_budget": {"type": ["integer", "null"], "minimum": 0},
                "mtp_acceptance": _NUMBER, "at_context": _INT,
                "miss_path": {"type": "string", "enum": ["pcie", "cpu", "auto"]},
                "prompt_cache": {"type": "boolean"},
                "prompt_cache_vram": {"type": ["integer", "null"], "minimum": 0},
                "prompt_cache_host": {"type": ["integer", "null"], "minimum": 0},
            },
        },
        "vram_total_bytes": _INT,
        "vram_budget_bytes": _INT,
        "vram_used_bytes": _INT,
        "vram_free_bytes": {"type": "integer"},
        "host_pinned_bytes": _INT,
        "host_budget_bytes": _INT,
        "host_process_bytes": _INT,
        "prompt_cache_host_bytes": _INT,
        "components": {
            "type": "object",
            "additionalProperties": {
                "type": "object",
                "additionalProperties": False,
                "required": ["bytes", "placement", "vram_bytes", "host_bytes"],
                "properties": {
                    "bytes": _INT, "placement": {"type": "string", "enum": list(PLACEMENTS)},
                    "vram_bytes": _INT, "host_bytes": _INT,
                },
            },
        },
        "runtime": {"type": "object", "additionalProperties": _INT},
        "experts_total": _INT,
        "experts_resident": _INT,
        "experts_resident_per_layer": _INT_LIST,
        "resident_expert_ids": {"type": "array", "items": _INT_LIST},
        "expert_bytes_per_layer": _INT_LIST,
        "routing_mass_resident": {"type": "number", "minimum": 0, "maximum": 1},
        "routing_stats": {"type": "string"},
        "staging_slots": _INT,
        "kv_capacity_tokens": _INT,
        "predicted": {
            "type": ["object", "null"],
            "additionalProperties": False,
            "required": [
                "decode_tok_s", "decode_tok_s_mtp", "prefill_tok_s", "vram_bytes_per_token", "pcie_bytes_per_token",
                "speculation_speedup", "speculates", "cache_hit_rate", "decode_tok_s_batch", "assumptions",
            ],
            "properties": {
                "decode_tok_s": _NUMBER, "decode_tok_s_mtp": {"type": ["number", "null"], "minimum": 0},
                "prefill_tok_s": _NUMBER, "vram_bytes_per_token": _INT, "pcie_bytes_per_token": _NUMBER,
                "speculation_speedup": {"type": ["number", "null"], "minimum": 0}, "speculates": {"type": "boolean"},
                "cache_hit_rate": {"type": ["number", "null"], "minimum": 0, "maximum": 1},
                "decode_tok_s_batch": {"type": ["number", "null"], "minimum": 0},
                "assumptions": {"type": "array", "items": {"type": "string"}},
            },
        },
    },
}
