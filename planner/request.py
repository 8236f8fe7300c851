"""What the user asks of a load: one `LoadRequest`, checked once, read by `Engine.load`, `ninfer
generate`, `ninfer serve` and `ninfer plan` alike.

    request = LoadRequest(experts="host", miss_path="cpu", spec="mtp", draft_tokens=2)
    engine = Engine.load("model.ninfer", request, device="cuda")

A bad value is a one-line `NinferError` naming the command-line flag that sets it. What depends on
the artifact (its maximum context, its MTP weights and proposal head) is checked by the load that
reads it (`capacity`, `runtime.spec_choice.resolve_speculation`). From a request and what the load
resolved come the planner's options (`plan_options`) and the footprint's (`load_options`).
"""

from __future__ import annotations

from dataclasses import dataclass

from ninfer_offload.errors import NinferError
from ninfer_offload.planner.cache_policy import POLICIES
from ninfer_offload.planner.memory import LoadOptions, prompt_cache_vram_bytes
from ninfer_offload.planner.options import (
    MAX_DRAFTS, MISS_PATHS, PREFILL_CHUNK, PROMPT_CACHE_EVERY, PROMPT_CACHE_HOST, SPECULATIVE_MODES, PlanOptions, parse_size,
)
from ninfer_offload.profiles import DeviceProfile

EXPERT_MODES = ("auto", "resident", "host")  # all in VRAM where they fit (else as planned), all in VRAM, all in host memory
SPEC_CHOICES = ("auto", *SPECULATIVE_MODES)  # auto: mtp where the artifact has MTP weights and the cost model projects it pays
DRAFT_MODELS = ("dflash", "dflash2")  # draft models some artifacts carry (components of these names), never run
DEFAULT_DRAFT_TOKENS = 3
DEFAULT_CACHE_POLICY = "decayed"
DEFAULT_MAX_CONTEXT = 32768  # tokens per sequence when none is asked for (at most the model's)
KV_DTYPES = (None, "fp8")  # None: the compute dtype
DTYPES = ("float32", "fp32", "bfloat16", "bf16")
BACKENDS = ("auto", "reference", "triton")


@dataclass(frozen=True)
class LoadRequest:
    """A load's options (defaults: `Engine.load`'s and `ninfer generate`'s).

    experts: auto, resident or host (`EXPERT_MODES`). profile / vram_budget: plan the load for a card (a
    profile name, TOML file, `DeviceProfile` or "auto" for this one) and at most `vram_budget` bytes of
    it (a size such as "12GiB" is read). num_slots: cache slots of an `experts="host"` load. cache_policy:
    decayed, batch, lru or static. miss_path: pcie, cpu or auto (None reads as pcie). max_context: tokens per
    sequence (None: min(the model's, DEFAULT_MAX_CONTEXT)). max_sequences: sequences open at once.
    kv_dtype: "fp8" or None (the compute dtype). spec: none, mtp or auto; draft_tokens: MTP drafts per
    step with speculation (None: DEFAULT_DRAFT_TOKENS), without it the most tokens a multi-token step may
    roll back (None: 0); proposal_head: draft with the proposal head; mtp: load the MTP module without
    speculating. prefill_chunk: most prompt tokens per forward. dtype: float32 or bfloat16 (None: bf16 on
    CUDA, fp32 on CPU; a torch dtype is kept by its name). backend: auto, reference or triton.
    cuda_graphs: replay decode steps as CUDA graphs where the backend and the expert store allow it.
    prompt_cache: keep the states of finished sequences and long prompts for later requests that start
    with the same tokens (`runtime.prefix_cache`), in at most `prompt_cache_vram` bytes of the device
    (None: `prompt_cache_device_bytes`'s default) and `prompt_cache_host` bytes of host memory (None:
    PROMPT_CACHE_HOST; a size such as "8GiB" is read); `prompt_cache_every`: tokens between the saved
    positions of a long prompt (None: PROMPT_CACHE_EVERY rounded up to whole prefill forwards).
    """

    experts: str = "auto"
    profile: str | DeviceProfile | None = None
    vram_budget: int | None = None
    num_slots: int | None = None
    cache_policy: str = DEFAULT_CACHE_POLICY
    miss_path: str = "pcie"
    max_context: int | None = None
    max_sequences: int = 1
    kv_dtype: str | None = None
    spec: str = "none"
    draft_tokens: int | None = None
    proposal_head: bool = False
    mtp: bool = False
    prefill_chunk: int = PREFILL_CHUNK
    dtype: str | None = None
    backend: str = "auto"
    cuda_graphs: bool = True
    prompt_cache: bool = False
    prompt_cache_vram: int | None = None
    prompt_cache_host: int | None = None
    prompt_cache_every: int | None = None

    def __post_init__(self) -> None:
        if self.miss_path is None:
            object.__setattr__(self, "miss_path", "pcie")
        for name in ("vram_budget", "prompt_cache_vram", "prompt_cache_host"):
            if isinstance(getattr(self, name), str):
                object.__setattr__(self, name, parse_size(getattr(self, name)))
        if self.dtype is not None and not isinstance(self.dtype, str):
            object.__setattr__(self, "dtype", str(self.dtype).removeprefix("torch."))
        self._check_placement()
        self._check_speculation()
        self._check_sizes()

    def _check_placement(self) -> None:
        if self.experts not in EXPERT_MODES:
            raise NinferError(f"--experts must be one of {', '.join(EXPERT_MODES)}, got {self.experts!r}")
        if self.miss_path not in MISS_PATHS:
            raise NinferError(f"--miss-path must be one of {', '.join(MISS_PATHS)}, got {self.miss_path!r}")
        if self.cache_policy not in POLICIES:
            raise NinferError(f"--cache-policy must be one of {', '.join(POLICIES)}, got {self.cache_policy!r}")
        if self.experts == "resident" and (self.profile is not None or self.vram_budget is not None):
            raise NinferError("--experts resident keeps every expert in VRAM; drop --profile/--vram-budget, or use --experts auto")
        if self.miss_path != "pcie" and self.experts != "host" and self.vram_budget is None and self.profile is None:
            raise NinferError(
                f"--miss-path {self.miss_path} computes experts kept in host memory: add --experts host or a --vram-budget "
                "(a miss path needs host-resident experts)"
            )
        if self.vram_budget is not None and self.vram_budget <= 0:
            raise NinferError("--vram-budget must be more than 0")
        if self.num_slots is not None and self.num_slots < 0:
            raise NinferError(f"num_slots must be >= 0, got {self.num_slots}")

    def _check_speculation(self) -> None:
        if self.spec in DRAFT_MODELS:
            raise NinferError(
                f"--spec {self.spec}: drafting with a DFlash model is not supported; an artifact's {self.spec} component is carried "
                "but never run: use --spec auto, mtp or none"
            )
        if self.spec not in SPEC_CHOICES:
            raise NinferError(f"--spec must be one of {', '.join(SPEC_CHOICES)}, got {self.spec!r}")
        if self.draft_tokens is not None:
            least = 0 if self.spec == "none" else 1
            if not least <= self.draft_tokens <= MAX_DRAFTS:
                without = " without speculation" if self.spec == "none" else ""
                raise NinferError(f"--draft-tokens must be {least}..{MAX_DRAFTS}{without}, got {self.draft_tokens}")

    def _check_sizes(self) -> None:
        if self.max_context is not None and self.max_context < 1:
            raise NinferError(f"--max-context must be at least 1, got {self.max_context}")
        if self.max_sequences < 1:
            raise NinferError(f"--max-concurrency must be >= 1, got {self.max_sequences}")
        if self.prefill_chunk < 1:
            raise NinferError(f"--prefill-chunk must be >= 1, got {self.prefill_chunk}")
        if self.kv_dtype not in KV_DTYPES:
            raise NinferError(f"unsupported KV dtype {self.kv_dtype!r}: use fp8, or leave it out for the compute dtype")
        if self.dtype is not None and self.dtype not in DTYPES:
            raise NinferError(f"unsupported dtype {self.dtype!r}: use float32 or bfloat16")
        if self.backend not in BACKENDS:
            raise NinferError(f"unknown backend {self.backend!r}: use auto, reference or triton")
        for name in ("prompt_cache_vram", "prompt_cache_host"):
            if getattr(self, name) is not None and getattr(self, name) < 0:
                raise NinferError(f"--{name.replace('_', '-')} must not be negative")
        if self.prompt_cache_every is not None and self.prompt_cache_every < 1:
            raise NinferError(f"prompt_cache_every must be >= 1, got {self.prompt_cache_every}")

    @property
    def planned(self) -> bool:
        """Whether the load is planned for a card whatever the free VRAM (a profile or a VRAM budget was given)."""
        return self.profile is not None or self.vram_budget is not None

    def prompt_cache_device_bytes(self, budget: int | None) -> int:
        """The prompt cache's device tier (`planner.memory.prompt_cache_vram_bytes` of `budget`, the VRAM the load may
        use, None where unknown); 0 without a prompt cache."""
        return prompt_cache_vram_bytes(self.prompt_cache_vram, budget) if self.prompt_cache else 0

    @property
    def prompt_cache_host_bytes(self) -> int:
        """The prompt cache's host tier (0 without a prompt cache)."""
        if not self.prompt_cache:
            return 0
        return PROMPT_CACHE_HOST if self.prompt_cache_host is None else self.prompt_cache_host

    def prompt_cache_interval(self, forward_tokens: int) -> int:
        """Tokens between the saved positions of a long prompt: `prompt_cache_every`, else PROMPT_CACHE_EVERY rounded
        up to whole prefill forwards of `forward_tokens` tokens (a save point ends a forward)."""
        if self.prompt_cache_every is not None:
            return self.prompt_cache_every
        return -(-PROMPT_CACHE_EVERY // forward_tokens) * forward_tokens

    def capacity(self, model_context: int) -> int:
        """Tokens per sequence for a model of `model_context` tokens at most."""
        capacity = min(model_context, DEFAULT_MAX_CONTEXT) if self.max_context is None else self.max_context
        if capacity > model_context:
            raise NinferError(
                f"max context {capacity} must be between 1 and the model's maximum context of {model_context} (--max-context)"
            )
        return capacity

    def load_options(
        self, capacity: int, draft_tokens: int, mtp: bool, element_bytes: int, kv_dtype: str, prompt_cache_bytes: int = 0
    ) -> LoadOptions:
        """The footprint's options of this request's state and weights (no expert arena), as the load resolved
        it: `capacity` tokens per sequence, `draft_tokens` (the speculation's), the MTP module loaded or not, the
        compute dtype's `element_bytes`, the KV cache's `kv_dtype` (a `KV_ELEMENT_BYTES` key) and the prompt
        cache's device tier."""
        return LoadOptions(
            pinned_experts=(), cache_slots=0, staging_slots=0, sequences=self.max_sequences, capacity=capacity,
            draft_tokens=draft_tokens, mtp=mtp, element_bytes=element_bytes, kv_dtype=kv_dtype, proposal_head=self.proposal_head,
            prompt_cache_bytes=prompt_cache_bytes,
        )

    def plan_options(self, load: LoadOptions) -> PlanOptions:
        """The planner's options for this request as the load resolved it (`load_options`)."""
        return PlanOptions(
            max_context=load.capacity, concurrency=load.sequences, kv_dtype="fp8" if load.kv_dtype == "fp8" else "bf16",
            speculative="mtp" if load.mtp else "none", drafts=max(1, load.draft_tokens), proposal_head=load.proposal_head,
            prefill_chunk=self.prefill_chunk, vram_budget=self.vram_budget, miss_path=self.miss_path,
            prompt_cache=self.prompt_cache, prompt_cache_vram=self.prompt_cache_vram, prompt_cache_host=self.prompt_cache_host,
        )
