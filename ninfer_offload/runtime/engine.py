"""The public engine: load an artifact, run prefill / decode / batched decode, generate.

    engine = Engine.load("model.ninfer", device="cpu")  # or Engine.load(path, LoadRequest(...), device="cuda")
    logits = engine.logits([1, 2, 3])                 # [T, vocab], fresh sequence
    s = engine.session(); s.prefill(ids); s.step(tok)  # incremental, state in one slot of the pool
    engine = Engine.load(path, prompt_cache=True)      # a prompt cache (`runtime.prefix_cache`):
    match = engine.prompt_cache.match(ids)             # the longest saved prefix of ids,
    s = engine.session(); s.resume(match)              # restored into a new session,
    s.prefill(ids[match.tokens:]); s.remember(ids)     # the rest prefilled, the state saved for the next one
    engine.step_batch([s1, s2], [t1, t2])              # one decode step over several sequences

The engine is the façade: it loads, hands out sessions (state slots), checks the tokens, sessions and
room it is given and keeps each session's length; the forwards themselves are its step runner's
(`runtime.step_runner.StepRunner`, `engine.runner`), whose parts (text model, expert store, state
pool, graphs...) it shows as its own attributes.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from collections.abc import Iterable

import torch

from ninfer_offload.artifact.reader import open_artifact
from ninfer_offload.errors import NinferError
from ninfer_offload.model.backend import ReferenceBackend
from ninfer_offload.artifact.errors import ArtifactError
from ninfer_offload.artifact.inventory import Inventory
from ninfer_offload.artifact.dims import FULL_ATTENTION, ModelDims
from ninfer_offload.model.state_pool import StatePool
from ninfer_offload.planner.memory import SCRATCH_KV_ROWS, load_footprint, workspace_bytes
from ninfer_offload.planner.request import DEFAULT_DRAFT_TOKENS, LoadRequest
from ninfer_offload.runtime.expert_plan import LoadPlan, expert_load_plan
from ninfer_offload.runtime.loader import load_model
from ninfer_offload.runtime.memory_check import available_host_bytes, check_fits, check_host_memory
from ninfer_offload.runtime.graphs import PREFILL_BUCKETS
from ninfer_offload.runtime.prefix_cache import Match, PrefixCache
from ninfer_offload.runtime.session import Session
from ninfer_offload.runtime.batched_prefill import BATCHED_PREFILL_MIN_SEQUENCES, BATCHED_PREFILL_TOKENS
from ninfer_offload.runtime.spec_choice import Speculation, resolve_speculation
from ninfer_offload.runtime.step_runner import StepRunner

# Prompt lengths reaching each kernel path and block size (the next power of two of the token count T up to 64:
# the matrix-vector kernels' token block up to 8, the tiled products' row block and the conv's token block above;
# prefill tiles past 64) with each of Triton's integer specializations of T and of the T * top-k (token, expert)
# pairs (1, a multiple of 16, neither): odd T, even T, T a multiple of 16. A length the warm-up missed compiles
# (or loads from Triton's disk cache) its kernels inside the first request that has it.
WARM_UP_PREFILLS = (1, 2, 3, 5, 12, 17, 24, 32, 33, 100)
_DTYPES = {"float32": torch.float32, "fp32": torch.float32, "bfloat16": torch.bfloat16, "bf16": torch.bfloat16}


def _resolve_device(device: str | torch.device) -> torch.device:
    try:
        resolved = torch.device(device)
    except (RuntimeError, TypeError):
        raise NinferError(f"unknown device {device!r}: use cpu or cuda") from None
    if resolved.type == "cuda" and not torch.cuda.is_available():
        raise NinferError("device cuda was requested but no CUDA GPU is available here; use --device cpu")
    if resolved.type == "cuda" and (resolved.index or 0) >= torch.cuda.device_count():
        raise NinferError(f"device {device} does not exist: this machine has {torch.cuda.device_count()} CUDA GPU(s)")
    if resolved.type not in ("cpu", "cuda"):
        raise NinferError(f"unsupported device {device!r}: use cpu or cuda")
    return resolved


def _resolve_dtype(dtype: str | None, device: torch.device) -> torch.dtype:
    """The compute dtype of a request's `dtype` (a name it checked) on `device`."""
    if dtype is None:
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    return _DTYPES[dtype]


_KV_NAMES = {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float8_e4m3fn: "fp8"}


def _element_bytes(dtype: torch.dtype) -> int:
    return torch.finfo(dtype).bits // 8


def _backend_for(device: torch.device, name: str):
    """The backend a request's `backend` (auto, reference or triton) names on `device`."""
    if name == "reference" or (name == "auto" and device.type != "cuda"):
        return ReferenceBackend()
    from ninfer_offload.kernels.backend import TritonBackend

    return TritonBackend()


def _prompt_cache_host_bytes(request: LoadRequest, expert_plan: LoadPlan) -> int:
    """The prompt cache's host tier: the size asked for; else a planned load's (its plan gives the default what the pinned
    expert pool leaves); else the default, at most half of the host memory available once the load is done."""
    if request.prompt_cache_host is not None:
        return request.prompt_cache_host
    if expert_plan.plan is not None:
        return expert_plan.plan.prompt_cache_host_bytes
    return min(request.prompt_cache_host_bytes, available_host_bytes() // 2)


def _prompt_cache_bytes(
    default: int, explicit: bool, expert_plan: LoadPlan, footprint: dict[str, int], free: int | None, config: ModelDims,
    request: LoadRequest, load,
) -> int:
    """The prompt cache's device tier: the size asked for; else a planned load's share of its plan (taken from its budget,
    `ninfer plan` states it); else, on CUDA, `default` (a share of the free VRAM) at most what the load leaves (its
    footprint, experts and prefill workspace), never the experts' room; else `default`."""
    if explicit:
        return default
    if expert_plan.plan is not None:
        return expert_plan.plan.runtime["prompt_cache"]
    if free is None:
        return default
    left = free - sum(footprint.values()) - expert_plan.arena_bytes - workspace_bytes(config, request.plan_options(load))
    return max(0, min(default, left))


@dataclass(frozen=True)
class WarmUpTimes:
    """Seconds `Engine.warm_up` spent prefilling (kernels compiled, short prompt chunks captured) and
    capturing the decode steps."""

    prefills: float
    captures: float

    @property
    def seconds(self) -> float:
        return self.prefills + self.captures


def _part(name: str) -> property:
    """An engine attribute that is its step runner's `name`."""
    return property(lambda self: getattr(self.runner, name), doc=f"The step runner's `{name}`.")


class Engine:
    """A loaded model on one device, ready to run up to `state.sequences` sequences at once."""

    config = _part("config")
    text = _part("text")
    mtp = _part("mtp")
    proposal = _part("proposal")  # the proposal head drafts when loaded, else the output head
    store = _part("store")
    backend = _part("backend")
    device = _part("device")
    dtype = _part("dtype")
    state = _part("state")
    graphs = _part("graphs")
    max_context = _part("max_context")
    prefill_chunk = _part("prefill_chunk")  # most tokens per prefill chunk
    prefill_span = _part("prefill_span")  # most prompt tokens per forward (chunks run layer by layer)

    def __init__(
        self, artifact, runner: StepRunner, expert_plan: LoadPlan | None = None,
        speculation: Speculation = Speculation("none", 0, False), load_seconds: dict | None = None,
        prompt_cache: PrefixCache | None = None,
    ):
        self.artifact = artifact
        self.runner = runner
        self.load_seconds = load_seconds or {}  # wall seconds of the load's phases (`LoadedModel.load_seconds`)
        self.expert_plan = expert_plan  # where the routed experts went, and the plan behind it
        self.speculation = speculation  # what the load resolved `spec`/`draft_tokens`/`proposal_head` to
        self.spec_tokens = speculation.spec_tokens  # MTP drafts per speculative step of `generate` (0: plain decode)
        self.prompt_cache = prompt_cache  # saved states of earlier sequences (None: no prompt cache)
        self._free_slots = list(range(runner.state.sequences - 1, -1, -1))

    @classmethod
    def load(
        cls, path, request: LoadRequest | None = None, *, device: str | torch.device = "cpu", progress: bool = False, **options
    ) -> "Engine":
        """Open `path` and load it onto `device` as `request` asks (`planner.request.LoadRequest`: experts in
        VRAM or host memory, the plan's profile and VRAM budget, the cache policy and miss path, context,
        sequences, speculation, prefill chunk, dtype, backend, CUDA graphs). Without a request the keyword
        `options` make one: `Engine.load(path, device="cuda", experts="host", spec="mtp")`. `progress`
        shows the load's progress on stderr: a bar on a terminal, and a line before the CPU expert kernels compile."""
        if request is None:
            request = LoadRequest(**options)
        elif options:
            raise TypeError(f"Engine.load takes a LoadRequest or keyword options, not both (got {', '.join(options)})")
        resolved = _resolve_device(device)
        dtype = _resolve_dtype(request.dtype, resolved)
        cache_dtype = torch.float8_e4m3fn if request.kv_dtype == "fp8" else dtype
        ops = _backend_for(resolved, request.backend)
        artifact = open_artifact(path)
        try:
            if "text" not in artifact.components:
                raise ArtifactError(f"{artifact.path.name} has no text component")
            config = ModelDims.from_text_config(artifact.components["text"].config)
            inventory = Inventory.from_artifact(artifact)
            capacity = request.capacity(config.max_position_embeddings)
            element_bytes, kv_name = _element_bytes(dtype), _KV_NAMES[cache_dtype]
            speculating = request.load_options(capacity, request.draft_tokens or DEFAULT_DRAFT_TOKENS, True, element_bytes, kv_name)
            speculation = resolve_speculation(request, inventory, artifact.path.name, resolved, speculating)
            mtp = request.mtp or speculation.mode == "mtp"
            free = torch.cuda.mem_get_info(resolved)[0] if resolved.type == "cuda" else None
            cache_bytes = request.prompt_cache_device_bytes(free)
            explicit = request.prompt_cache_vram is not None
            resolved_load = request.load_options(
                capacity, speculation.draft_tokens, mtp, element_bytes, kv_name, cache_bytes if explicit else 0
            )
            state_and_weights = load_footprint(inventory, resolved_load)
            expert_plan = expert_load_plan(
                inventory, resolved, request, resolved_load, None if free is None else free - sum(state_and_weights.values())
            )
            if request.prompt_cache:
                cache_bytes = _prompt_cache_bytes(
                    cache_bytes, explicit, expert_plan, state_and_weights, free, config, request, resolved_load
                )
                state_and_weights["prompt_cache"] = cache_bytes
            if resolved.type == "cuda":
                check_fits(state_and_weights | {"experts": expert_plan.arena_bytes}, free, resolved)
            check_host_memory(expert_plan.host_ram_bytes(pinned=resolved.type == "cuda"))
            miss_path = None if request.miss_path == "pcie" else request.miss_path
            loaded = load_model(
                artifact, config, resolved, dtype, expert_plan.placement, miss_path, request.cache_policy, with_mtp=mtp,
                progress=progress, with_proposal=request.proposal_head,
            )
            kinds = dict(enumerate(config.layer_types)) | ({config.num_layers: FULL_ATTENTION} if mtp else {})
            state = StatePool(
                config, kinds, request.max_sequences, capacity, speculation.draft_tokens, resolved, dtype, cache_dtype,
                SCRATCH_KV_ROWS, PREFILL_BUCKETS[-1],
            )
        except BaseException:
            artifact.close()
            raise
        runner = StepRunner(loaded, ops, resolved, dtype, state, request.prefill_chunk, request.cuda_graphs)
        cache = None
        if request.prompt_cache:
            cache = PrefixCache(
                state, resolved, cache_bytes, _prompt_cache_host_bytes(request, expert_plan),
                request.prompt_cache_interval(runner.prefill_span), config.num_layers if mtp else None,
            )
        return cls(artifact, runner, expert_plan, speculation, loaded.load_seconds, cache)

    def placement_report(self) -> str:
        """One line: where the routed experts went (and the plan behind it), and the VRAM in use against the plan."""
        line = self.expert_plan.summary(self.device)
        if self.store.offloaded:
            line += f"; misses {self.store.miss_path or 'pcie'}, cache policy {self.store.cache.policy.name}"
        if self.device.type == "cuda":
            line += f"; VRAM in use {torch.cuda.memory_allocated(self.device) / 2**30:.2f} GiB"
        return line

    # ------------------------------------------------------------------ sequences
    def session(self) -> Session:
        """A new empty sequence in a free state slot."""
        if not self._free_slots:
            raise NinferError(
                f"all {self.state.sequences} sequence slots are in use: close a session or load with a larger "
                "max_sequences (--max-concurrency)"
            )
        slot = self._free_slots.pop()
        self.state.reset(slot)
        return Session(self, slot)

    def resume(self, session: Session, match: Match) -> None:
        """Give the empty `session` the state of a prompt cache match (`PrefixCache.match`): it then holds the
        match's tokens, and with the match's hidden state (a match made `with_mtp`) their MTP entries but the last."""
        slot = session.live_slot()
        if session.length or session.mtp_length:
            raise NinferError("a session resumes a cached prefix before anything else is appended to it")
        if match.tokens:
            self._need_prompt_cache().restore(slot, match)
            session.length = match.tokens
            session.mtp_length = match.tokens - 1 if match.hidden is not None else 0

    def remember(self, session: Session, token_ids: Iterable[int], hidden: torch.Tensor | None = None) -> None:
        """Save `session`'s state in the prompt cache under `token_ids`, the tokens it holds; with `hidden`, the final-
        normed hidden state of its last token, also its MTP entries (it holds one fewer than tokens, or as many)."""
        ids = self._token_list(token_ids)
        slot = session.live_slot()
        if len(ids) != session.length:
            raise NinferError(f"the session holds {session.length} tokens, not the {len(ids)} given")
        if hidden is not None and session.mtp_length < session.length - 1:
            raise NinferError("the session's MTP cache does not cover its tokens: save it without a hidden state")
        self._need_prompt_cache().save(slot, ids, hidden)

    def _need_prompt_cache(self) -> PrefixCache:
        if self.prompt_cache is None:
            raise NinferError("the engine was loaded without a prompt cache (Engine.load(..., prompt_cache=True))")
        return self.prompt_cache

    def release_slot(self, slot: int) -> None:
        """Give a closed session's slot back."""
        self._free_slots.append(slot)

    # ------------------------------------------------------------------ prompts
    def logits(self, token_ids: Iterable[int]) -> torch.Tensor:
        """Logits [T, vocab] (float32) of a fresh sequence `token_ids` (one full prefill)."""
        session = self.session()
        try:
            return session.append(token_ids)[0]
        finally:
            session.close()

    def prefill(self, session: Session, token_ids: Iterable[int]) -> torch.Tensor:
        """Append `token_ids` to `session` in forwards of at most `prefill_span` tokens, each over chunks of at most
        `prefill_chunk`; hidden states [T, H]. A chunk of a few tokens on a resident load replays a captured prefill
        (`StepGraphs.prefill`), and so does a short prompt, in pieces of the largest captured chunk
        (`step_runner.GRAPHED_PROMPT_MAX`)."""
        ids = self._token_list(token_ids)
        slot = session.live_slot()
        self._check_room(session.length, len(ids))
        hidden = []
        piece = self.runner.prefill_piece(len(ids))
        for c0 in range(0, len(ids), piece):
            part = ids[c0 : c0 + piece]
            hidden.append(self.runner.prefill(part, slot, session.length))
            session.pending = len(part)
            session.commit(len(part))
        return hidden[0] if len(hidden) == 1 else torch.cat(hidden)

    def prefill_batch(self, sessions: list[Session], token_ids: list[list[int]], tokens_per_sequence: int | None = None) -> torch.Tensor:
        """Append token_ids[i] to sessions[i] in one forward over all of them, each sequence's rows attending to its
        own cache (the decode step's kernels): logits [B, vocab] of each one's last token. Each row is padded to
        `tokens_per_sequence` tokens (default: the longest row's), padding computed but not kept, so prompts of
        several lengths share one forward (each sequence needs room for the padded row). Several prompts cost one
        forward instead of one prefill each (a server admitting several requests at once); on a resident load with
        graphs, pieces of BATCHED_PREFILL_TOKENS replay a captured forward of the batch's bucket (the batch padded
        with scratch entries), which spares the host the forward's ~1,000 launches."""
        if len(sessions) != len(token_ids) or not sessions:
            raise NinferError("a batched prefill needs one token list per session and at least one session")
        t = tokens_per_sequence or max(len(row) for row in token_ids)
        if any(not 1 <= len(row) <= t for row in token_ids):
            raise NinferError(f"a batched prefill adds 1 to {t} tokens to each sequence")
        valid = [len(row) for row in token_ids]
        flat = self._token_list([token for row in token_ids for token in row + [0] * (t - len(row))])
        slots, starts = self._live_slots(sessions, t), [s.length for s in sessions]
        hidden = self.runner.prefill_batch(flat, slots, starts, t, valid)
        for session, n in zip(sessions, valid):
            session.pending = n
            session.commit(n)
        last = torch.tensor([b * t + n - 1 for b, n in enumerate(valid)], device=hidden.device)
        return self.logits_of(hidden[last])

    def batched_prefill_piece(self, unprefilled: int) -> int:
        """Tokens per sequence of a batched prefill whose longest prompt has `unprefilled` tokens left: the smallest
        of BATCHED_PREFILL_TOKENS (what `warm_up` compiled) that holds them, else the largest; 0 if none fits the
        context or the experts are offloaded."""
        return self.runner.batched_prefill_piece(unprefilled)

    # ------------------------------------------------------------------ decode steps
    def step(
        self, sessions: list[Session], tokens: list[list[int]], with_hidden: bool = False
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """One decode step adding tokens[i] (T tokens, the same T for every session) to sessions[i]:
        logits [B, T, vocab] (and with `with_hidden` the final-normed hidden states [B * T, H]). A
        one-token step is committed at once; a step of T > 1 tokens stays pending until each
        session's `commit`/`rollback` (it may keep 1..T of its tokens)."""
        if len(sessions) != len(tokens) or not sessions:
            raise NinferError("a step needs one token list per session and at least one session")
        t = len(tokens[0])
        if any(len(row) != t for row in tokens) or not 1 <= t <= self.state.step_tokens:
            raise NinferError(
                f"a step adds the same number of tokens to every sequence, 1..{self.state.step_tokens} "
                f"(load with draft_tokens >= T - 1 for multi-token steps)"
            )
        flat = self._token_list([token for row in tokens for token in row])
        logits, hidden = self._step(sessions, flat, None, t)
        return (logits, hidden.clone()) if with_hidden else logits

    def step_on_device(self, sessions: list[Session], tokens: torch.Tensor) -> torch.Tensor:
        """One one-token decode step adding tokens[i] to sessions[i], where `tokens` [B] (int64, on the
        engine's device) are ids this engine picked (the argmax of a step's logits): the host never
        reads them, so the step is queued behind the one that picks them without waiting for it.
        Logits [B, vocab]."""
        if tokens.shape != (len(sessions),) or tokens.dtype != torch.int64 or tokens.device.type != self.device.type or not sessions:
            raise NinferError(f"a device step takes one int64 token per session on {self.device}, got {tuple(tokens.shape)}")
        return self._step(sessions, [0] * len(sessions), tokens, 1)[0][:, 0]

    def step_batch(self, sessions: list[Session], token_ids: list[int]) -> torch.Tensor:
        """One decode step appending token_ids[i] to sessions[i] (sequences of any lengths): logits [B, vocab]."""
        if len(sessions) != len(token_ids):
            raise NinferError("step_batch needs one token per session")
        return self.step(sessions, [[token] for token in token_ids])[:, 0]

    def _step(
        self, sessions: list[Session], flat: list[int], device_tokens: torch.Tensor | None, t: int
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(logits [B, T, vocab], hidden [B * T, H]) of one decode step of `flat` tokens (the ids of
        `device_tokens` where given), the sessions' lengths kept: a one-token step committed, a longer one pending."""
        slots = self._live_slots(sessions, t)
        logits, hidden = self.runner.step(flat, slots, [s.length for s in sessions], t, device_tokens)
        for session in sessions:
            session.pending = t
            if t == 1:
                session.commit(1)
        return logits.view(len(sessions), t, -1), hidden

    # ------------------------------------------------------------------ heads
    def logits_of(self, hidden: torch.Tensor) -> torch.Tensor:
        """Output-head logits [T, vocab] (float32) of final-normed hidden states."""
        return self.runner.logits_of(hidden)

    def draft_logits(self, mtp_hidden: torch.Tensor) -> torch.Tensor:
        """Draft logits [T, vocab] (float32) of MTP hidden states: the proposal head's when the engine
        drafts with it (-inf outside its token ids), else the output head's."""
        return self.runner.draft_logits(mtp_hidden)

    # ------------------------------------------------------------------ MTP
    def mtp_prefill(
        self, session: Session, hidden: torch.Tensor, next_ids: Iterable[int], all_logits: bool = True
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The MTP module over `hidden` [T, H] and the tokens after them, continuing `session`'s MTP cache
        (see `Session.mtp`): (draft logits [T, vocab], or [1, vocab] of the last position without `all_logits`,
        MTP hidden [T, H])."""
        self._need_mtp()
        ids = self._token_list(next_ids)
        slot = session.live_slot()
        if len(ids) != hidden.shape[0] or session.mtp_length + len(ids) > self.max_context:
            raise NinferError(f"MTP needs one next token per hidden state within the context limit {self.max_context}")
        logits, out = self.runner.mtp_prefill(hidden, ids, slot, session.mtp_length, all_logits)
        session.mtp_length += len(ids)
        return logits, out

    def mtp_step(
        self, sessions: list[Session], hidden: torch.Tensor, next_ids: list[int], tokens_per_sequence: int = 1
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """T MTP positions for each of `sessions` at once (drafting, and following a verified round):
        hidden [B * T, H] and the T tokens after them each -> (draft logits [B * T, vocab], MTP hidden
        [B * T, H]); the decode kernels (a captured graph where the engine replays them), no host sync."""
        return self._mtp_step(sessions, hidden, self._token_list(next_ids), None, tokens_per_sequence)

    def mtp_step_on_device(self, sessions: list[Session], hidden: torch.Tensor, tokens: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """One MTP position for each of `sessions` (`mtp_step` with T = 1) whose next tokens are `tokens` [B]
        (int64, on the engine's device: ids this engine picked, such as the argmax of the draft logits before):
        the host never reads them, so greedy drafts are queued one after another without waiting for the device."""
        if tokens.shape != (len(sessions),) or tokens.dtype != torch.int64 or tokens.device.type != self.device.type or not sessions:
            raise NinferError(f"a device MTP step takes one int64 token per session on {self.device}, got {tuple(tokens.shape)}")
        return self._mtp_step(sessions, hidden, [0] * len(sessions), tokens, 1)

    def _mtp_step(
        self, sessions: list[Session], hidden: torch.Tensor, ids: list[int], device_tokens: torch.Tensor | None, t: int
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """`mtp_step` of the ids `ids` (those of `device_tokens` where given)."""
        self._need_mtp()
        slots = [s.live_slot() for s in sessions]
        if (
            len(ids) != len(sessions) * t or hidden.shape[0] != len(ids) or not 1 <= t <= self.state.step_tokens
            or any(s.mtp_length + t > self.max_context for s in sessions)
        ):
            raise NinferError(
                f"an MTP step needs 1..{self.state.step_tokens} hidden states and next tokens per session within the "
                f"context limit {self.max_context}"
            )
        logits, out = self.runner.mtp_step(hidden, ids, slots, [s.mtp_length for s in sessions], t, device_tokens)
        for session in sessions:
            session.mtp_length += t
        return logits, out

    def _need_mtp(self) -> None:
        if self.mtp is None:
            raise NinferError("the engine was loaded without the MTP module (Engine.load(..., mtp=True))")

    # ------------------------------------------------------------------ whole requests
    def generate(self, prompt_ids: Iterable[int], max_tokens: int = 256, sampling=None, stop_ids=None):
        """Generate after `prompt_ids` (see `ninfer_offload.runtime.generate.generate`)."""
        from ninfer_offload.runtime.generate import generate

        return generate(self, prompt_ids, max_tokens=max_tokens, sampling=sampling, stop_ids=stop_ids)

    @property
    def needs_warm_up(self) -> bool:
        """Whether `warm_up` has work to do: kernels to compile and steps to capture are a CUDA load's (a CPU load
        runs torch's eager ops, its warm-up is empty)."""
        return self.device.type == "cuda"

    def warm_up(self, longest_prefill: int | None = None) -> WarmUpTimes:
        """Compile the kernels and capture the decode steps requests will use, before the first request:
        prefills of each length in WARM_UP_PREFILLS and of `longest_prefill` tokens (default: a whole
        chunk) on a scratch sequence (and, where the context allows, a second chunk after a full one:
        attention over cached rows; the short ones capture the padded prefills of every bucket on a
        resident load), batched prefills of each BATCHED_PREFILL_TOKENS on BATCHED_PREFILL_MIN_SEQUENCES and one more
        sequences (resident loads of that many sequences, where they are not captured), then the step graph
        of every batch bucket (with speculation also the verify steps and the MTP steps) and, on a resident load, the
        batched prefills of each bucket a batch of BATCHED_PREFILL_MIN_SEQUENCES or more pads to
        (`StepRunner.capture_steps`). Returns the seconds of the two phases."""
        began = time.perf_counter()
        if self.device.type == "cuda":
            longest_prefill = self.prefill_chunk if longest_prefill is None else longest_prefill
            lengths = {*WARM_UP_PREFILLS, longest_prefill}
            if longest_prefill >= self.prefill_chunk and longest_prefill + WARM_UP_PREFILLS[-1] < self.max_context:
                lengths.add(longest_prefill + WARM_UP_PREFILLS[-1])
            for length in sorted(lengths):
                session = self.session()
                try:
                    session.prefill([i % self.config.vocab_size for i in range(min(length, self.max_context - 1))])
                finally:
                    session.close()
            if not self.store.offloaded:
                for sequences in range(BATCHED_PREFILL_MIN_SEQUENCES, min(self.state.sequences, BATCHED_PREFILL_MIN_SEQUENCES + 1) + 1):
                    for tokens in BATCHED_PREFILL_TOKENS:
                        if not self.runner.captured_batched_prefill(tokens):
                            self._scratch_batched_prefill(sequences, tokens)
        prefilled = time.perf_counter()
        self.runner.capture_steps(self.spec_tokens)
        return WarmUpTimes(prefilled - began, time.perf_counter() - prefilled)

    def _scratch_batched_prefill(self, sequences: int, tokens: int) -> None:
        """`prefill_batch` of `tokens` tokens on `sequences` scratch sequences (warm-up), where the context has room."""
        if tokens >= self.max_context:
            return
        scratch = [self.session() for _ in range(sequences)]
        try:
            self.prefill_batch(scratch, [[(i + s) % self.config.vocab_size for i in range(tokens)] for s in range(sequences)])
        finally:
            for session in scratch:
                session.close()

    def close(self) -> None:
        self.store.close()
        self.artifact.close()

    # ------------------------------------------------------------------ checks
    def _token_list(self, token_ids: Iterable[int]) -> list[int]:
        ids = [int(t) for t in token_ids]
        if not ids:
            raise NinferError("no tokens given")
        bad = [t for t in ids if not 0 <= t < self.config.vocab_size]
        if bad:
            raise NinferError(f"token id {bad[0]} is outside the vocabulary [0, {self.config.vocab_size})")
        return ids

    def _live_slots(self, sessions: list[Session], new: int) -> list[int]:
        """The sessions' slots: each live and distinct, each sequence with room for `new` more tokens."""
        slots = [s.live_slot() for s in sessions]
        if len(set(slots)) != len(slots):
            raise NinferError("a step got the same session twice")
        for session in sessions:
            self._check_room(session.length, new)
        return slots

    def _check_room(self, length: int, new: int) -> None:
        if length + new > self.max_context:
            limit = self.config.max_position_embeddings
            remedy = "that is the model's maximum context" if self.max_context >= limit else "raise --max-context"
            raise NinferError(
                f"{length + new} tokens exceed the context limit of {self.max_context} "
                f"(sequence holds {length}, {new} new); {remedy} (the model allows up to {limit})"
            )
