"""What the user asks of a plan: context, concurrency, KV dtype, speculation, budgets."""

from __future__ import annotations

import re
from dataclasses import asdict, dataclass

from ninfer_offload.artifact.inventory import Inventory
from ninfer_offload.errors import NinferError

# Default prompt tokens per prefill forward. 4096 against 2048, measured at ec7539d (H200, 4K prefill): 29.7K
# tok/s against 24.7K all resident; at 15 GiB with experts offloaded 20.4K against 11.8K (each host expert a
# chunk needs crosses PCIe once per chunk: half the bytes).
PREFILL_CHUNK = 4096
# Prefill chunks per forward of a load with host experts (`runtime.step_runner.StepRunner.prefill_span`): every layer
# runs over the span's chunks in turn, so each host expert a layer needs crosses PCIe once per span rather than once
# per chunk; the span's residual rows stay alive between layers (`memory.prefill_span_bytes`).
PREFILL_SPAN_CHUNKS = 4

# The prompt cache (`runtime.prefix_cache`): a long prefill saves its state about every PROMPT_CACHE_EVERY tokens
# (rounded up to whole prefill forwards: chunks, or spans with host experts); its device tier defaults to
# PROMPT_CACHE_VRAM_SHARE of the VRAM the plan may use, at most PROMPT_CACHE_VRAM, its host tier to PROMPT_CACHE_HOST.
PROMPT_CACHE_EVERY = 2048
PROMPT_CACHE_VRAM_SHARE = 0.1
PROMPT_CACHE_VRAM = 4 << 30
PROMPT_CACHE_HOST = 16 << 30

KV_DTYPES = ("bf16", "fp8", "int8")
SPECULATIVE_MODES = ("none", "mtp")
MISS_PATHS = ("pcie", "cpu", "auto")  # host-resident experts: read by the GPU over PCIe, computed on the host, or both
MAX_DRAFTS = 5
# Speculation pays where the cost model projects at least this speed-up over one token per step (`Prediction.speculates`),
# at a per-draft acceptance of DEFAULT_MTP_ACCEPTANCE unless one is given.
SPECULATION_MIN_SPEEDUP = 1.15
DEFAULT_MTP_ACCEPTANCE = 0.72
AT_CONTEXT = 4096  # default sequence length of the speed prediction (at most the context)

_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([kmgt]i?b?|b)?\s*$", re.IGNORECASE)
_UNITS = {"": 1, "b": 1, "k": 10**3, "m": 10**6, "g": 10**9, "t": 10**12, "ki": 2**10, "mi": 2**20, "gi": 2**30, "ti": 2**40}


def parse_size(text: str) -> int:
    """Bytes of a size such as `2GiB`, `24GB`, `512MiB`, `1.5G` or `4096B` (GB/G decimal, GiB binary).

    A number without a unit is refused (except 0): `12` is far more likely to mean 12 GiB than 12 bytes.
    """
    match = _SIZE.match(str(text))
    if not match:
        raise NinferError(f"cannot read size {text!r}; write e.g. 12GiB, 24GB or 512MiB")
    if match[2] is None and float(match[1]) != 0:
        raise NinferError(f"size {text.strip()!r} has no unit; write e.g. {match[1]}GiB (binary) or {match[1]}GB (decimal)")
    unit = (match[2] or "").lower().rstrip("b")
    return int(float(match[1]) * _UNITS[unit])


def has_mtp(inventory: Inventory) -> bool:
    """Whether the artifact carries the MTP layer that speculation drafts with."""
    return bool(inventory.select("mtp"))


@dataclass(frozen=True)
class PlanOptions:
    """Plan options. Defaults: MTP with 3 drafts and the proposal head, 262,144-token context, fp8 KV, one
    sequence, vision off (`ninfer plan` starts from a load's instead, `commands.plan`)."""

    max_context: int = 262144
    concurrency: int = 1
    kv_dtype: str = "fp8"
    speculative: str = "mtp"
    drafts: int = 3
    proposal_head: bool = True
    vision: bool = False
    prefill_chunk: int = PREFILL_CHUNK
    vram_reserve: int | None = None  # bytes; None = the profile's reserve
    vram_budget: int | None = None  # bytes of the card the plan may use; None = all of it
    host_budget: int | None = None  # bytes of pinned host memory; None = a share of host RAM
    mtp_acceptance: float = DEFAULT_MTP_ACCEPTANCE  # per-draft acceptance probability (assumption)
    at_context: int | None = None  # sequence length at which decode speed is predicted; None = min(AT_CONTEXT, max_context)
    miss_path: str = "pcie"  # how decode serves host-resident experts (MISS_PATHS)
    prompt_cache: bool = False  # count a prompt cache: its device tier out of the budget, its host tier as pinned memory
    prompt_cache_vram: int | None = None  # bytes; None = PROMPT_CACHE_VRAM_SHARE of the budget, at most PROMPT_CACHE_VRAM
    prompt_cache_host: int | None = None  # bytes; None = PROMPT_CACHE_HOST

    def __post_init__(self) -> None:
        if self.at_context is None:
            object.__setattr__(self, "at_context", min(AT_CONTEXT, self.max_context))
        positive = {
            "max_context": self.max_context,
            "concurrency": self.concurrency,
            "prefill_chunk": self.prefill_chunk,
            "at_context": self.at_context,
        }
        for name, value in positive.items():
            if value < 1:
                raise NinferError(f"--{name.replace('_', '-')} must be at least 1, got {value}")
        if self.at_context > self.max_context:
            raise NinferError(f"--at-context {self.at_context} is beyond the context of {self.max_context} tokens; give at most that")
        if self.kv_dtype not in KV_DTYPES:
            raise NinferError(f"--kv-dtype must be one of {', '.join(KV_DTYPES)}, got {self.kv_dtype!r}")
        if self.speculative not in SPECULATIVE_MODES:
            raise NinferError(f"--spec must be one of {', '.join(SPECULATIVE_MODES)}, got {self.speculative!r}")
        if self.speculative == "mtp" and not 1 <= self.drafts <= MAX_DRAFTS:
            raise NinferError(f"--drafts must be 1..{MAX_DRAFTS} with --spec mtp, got {self.drafts}")
        if self.miss_path not in MISS_PATHS:
            raise NinferError(f"--miss-path must be one of {', '.join(MISS_PATHS)}, got {self.miss_path!r}")
        if not 0.0 <= self.mtp_acceptance < 1.0:
            raise NinferError(f"--mtp-acceptance must be in [0, 1), got {self.mtp_acceptance}")
        for name in ("vram_reserve", "vram_budget", "host_budget", "prompt_cache_vram", "prompt_cache_host"):
            value = getattr(self, name)
            if value is not None and value < 0:
                raise NinferError(f"--{name.replace('_', '-')} must not be negative")

    @property
    def speculating(self) -> bool:
        return self.speculative == "mtp"

    @property
    def draft_count(self) -> int:
        """Drafted tokens per step (0 without speculation)."""
        return self.drafts if self.speculating else 0

    def to_json(self) -> dict:
        return asdict(self)
