"""The public engine: load an artifact, run prefill / decode / batched decode, generate.

    engine = Engine.load("model.ninfer", device="cpu")
    logits = engine.logits([1, 2, 3])                 # [T, vocab], fresh sequence
    s = engine.session(); s.prefill(ids); s.step(tok)  # incremental, per-sequence state
    engine.step_batch([s1, s2], [t1, t2])              # one decode forward over several sequences
"""

from __future__ import annotations

from collections.abc import Iterable

import torch

from ninfer_offload.artifact.reader import open_artifact
from ninfer_offload.errors import NinferError
from ninfer_offload.model.backend import ReferenceBackend
from ninfer_offload.artifact.errors import ArtifactError
from ninfer_offload.artifact.inventory import Inventory
from ninfer_offload.model.config import FULL_ATTENTION, ModelConfig
from ninfer_offload.runtime.expert_store import MODES
from ninfer_offload.runtime.loader import load_model
from ninfer_offload.runtime.memory_check import check_fits, load_footprint
from ninfer_offload.runtime.state import Segment, SequenceState

DEFAULT_MAX_CONTEXT = 32768
PREFILL_CHUNK = 1024  # tokens per forward of a long prefill (bounds attention scores and expert temporaries)
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


def _resolve_dtype(dtype: str | torch.dtype | None, device: torch.device) -> torch.dtype:
    if dtype is None:
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    if isinstance(dtype, str):
        if dtype not in _DTYPES:
            raise NinferError(f"unsupported dtype {dtype!r}: use float32 or bfloat16")
        return _DTYPES[dtype]
    if dtype not in (torch.float32, torch.bfloat16):
        raise NinferError(f"unsupported dtype {dtype}: use float32 or bfloat16")
    return dtype


def _backend_for(device: torch.device, name: str):
    if name == "reference" or (name == "auto" and device.type != "cuda"):
        return ReferenceBackend()
    if name in ("auto", "triton"):
        from ninfer_offload.kernels.backend import TritonBackend

        return TritonBackend()
    raise NinferError(f"unknown backend {name!r}: use auto, reference or triton")


class Session:
    """One sequence: its KV/GDN state and length. Use `prefill` then `step`; `close` frees the state."""

    def __init__(self, engine: "Engine"):
        self.engine = engine
        config = engine.config
        self.state: SequenceState | None = SequenceState(
            config, dict(enumerate(config.layer_types)), engine.max_context, engine.device, engine.dtype
        )
        self.mtp_state: SequenceState | None = None

    @property
    def length(self) -> int:
        """Tokens in the sequence."""
        return self._live_state().length

    def _live_state(self) -> SequenceState:
        if self.state is None:
            raise NinferError("this session is closed")
        return self.state

    def forward(self, token_ids: Iterable[int]) -> tuple[torch.Tensor, torch.Tensor]:
        """Append `token_ids`: (logits [T, vocab] float32, final-normed hidden states [T, H])."""
        hidden = self._advance(token_ids)
        with torch.no_grad():
            return self.engine.text.logits(self.engine.backend, hidden), hidden

    def prefill(self, token_ids: Iterable[int]) -> torch.Tensor:
        """Append `token_ids` (may be called repeatedly: chunked prefill); logits [vocab] of the last one."""
        hidden = self._advance(token_ids)
        with torch.no_grad():
            return self.engine.text.logits(self.engine.backend, hidden[-1:])[0]

    def step(self, token_id: int) -> torch.Tensor:
        """Append one token; its logits [vocab]. On CUDA with the triton backend and resident experts the
        step is this session's captured CUDA graph (`runtime.cuda_graph`), else a one-token prefill."""
        from ninfer_offload.runtime.cuda_graph import decode_step

        return decode_step(self, token_id)

    def _advance(self, token_ids: Iterable[int]) -> torch.Tensor:
        """Run `token_ids` through the layers in chunks of at most PREFILL_CHUNK; hidden states [T, H]."""
        ids = self.engine._token_tensor(token_ids)
        state = self._live_state()
        if state.length + len(ids) > state.capacity:
            raise NinferError(
                f"{state.length + len(ids)} tokens exceed the context limit of {state.capacity} "
                f"(sequence holds {state.length}, {len(ids)} new); raise --max-context "
                f"(the model allows up to {self.engine.config.max_position_embeddings})"
            )
        hidden = []
        for chunk in ids.split(PREFILL_CHUNK):
            hidden.append(self.engine._hidden(chunk, [Segment(state, state.length, 0, len(chunk))]))
            state.length += len(chunk)
        return torch.cat(hidden)

    def mtp(self, hidden: torch.Tensor, next_ids: Iterable[int]) -> tuple[torch.Tensor, torch.Tensor]:
        """Run the MTP module on target hidden states `hidden` [T, H] (positions continuing this
        session's MTP state) and the tokens that follow them: (draft logits [T, vocab], MTP hidden [T, H])."""
        engine = self.engine
        if engine.mtp is None:
            raise NinferError("the engine was loaded without the MTP module (Engine.load(..., mtp=True))")
        if self.mtp_state is None:
            self.mtp_state = SequenceState(
                engine.config, {engine.config.num_layers: FULL_ATTENTION}, engine.max_context, engine.device, engine.dtype
            )
        ids = engine._token_tensor(next_ids)
        state = self.mtp_state
        if len(ids) != hidden.shape[0] or state.length + len(ids) > state.capacity:
            raise NinferError(f"MTP needs one next token per hidden state within the context limit {state.capacity}")
        with torch.no_grad():
            segments = [Segment(state, state.length, 0, len(ids))]
            out = engine.mtp(engine.backend, engine.text, hidden.to(engine.dtype), ids, segments)
            logits = engine.text.logits(engine.backend, out)
        state.length += len(ids)
        return logits, out

    def close(self) -> None:
        """Free the state (the session cannot be used afterwards)."""
        self.state = None
        self.mtp_state = None


class Engine:
    """A loaded model on one device, ready to run sequences."""

    def __init__(self, artifact, loaded, backend, device: torch.device, dtype: torch.dtype, max_context: int):
        self.artifact = artifact
        self.config = loaded.config
        self.text = loaded.text
        self.mtp = loaded.mtp
        self.store = loaded.store
        self.backend = backend
        self.device = device
        self.dtype = dtype
        self.max_context = max_context

    @classmethod
    def load(
        cls,
        path,
        device: str | torch.device = "cpu",
        dtype: str | torch.dtype | None = None,
        experts: str = "resident",
        max_context: int | None = None,
        *,
        num_slots: int | None = None,
        miss_path: str | None = None,
        mtp: bool = False,
        backend: str = "auto",
        progress: bool = False,
    ) -> "Engine":
        """Open `path` and load it onto `device` (bf16 on CUDA, fp32 on CPU unless `dtype` says).

        experts: "resident" (all routed experts on the device) or "host" (host memory, staged
        through `num_slots` device slots; `miss_path="cpu"` computes misses on the host instead,
        `miss_path="auto"` splits them between host compute and staging by measured rates).
        max_context: per-sequence capacity (default min(model maximum, 32768)). mtp: also load the
        MTP draft module. backend: "auto" (Triton on CUDA, reference on CPU), "reference", "triton".
        """
        resolved = _resolve_device(device)
        resolved_dtype = _resolve_dtype(dtype, resolved)
        if experts not in MODES:
            raise NinferError(f"experts must be one of {', '.join(MODES)}, got {experts!r}")
        ops = _backend_for(resolved, backend)
        artifact = open_artifact(path)
        try:
            if "text" not in artifact.components:
                raise ArtifactError(f"{artifact.path.name} has no text component")
            config = ModelConfig.from_component(artifact.components["text"].config)
            limit = config.max_position_embeddings
            capacity = min(limit, DEFAULT_MAX_CONTEXT) if max_context is None else int(max_context)
            if not 0 < capacity <= limit:
                raise NinferError(f"max context {capacity} must be between 1 and the model's {limit} positions")
            if resolved.type == "cuda":
                footprint = load_footprint(
                    Inventory.from_artifact(artifact), config, experts, capacity, resolved_dtype, mtp, num_slots
                )
                check_fits(footprint, torch.cuda.mem_get_info(resolved)[0], resolved)
            loaded = load_model(
                artifact, config, resolved, resolved_dtype, ops, experts, num_slots, miss_path, with_mtp=mtp, progress=progress
            )
        except BaseException:
            artifact.close()
            raise
        return cls(artifact, loaded, ops, resolved, resolved_dtype, capacity)

    # ------------------------------------------------------------------ running
    def session(self) -> Session:
        return Session(self)

    def logits(self, token_ids: Iterable[int]) -> torch.Tensor:
        """Logits [T, vocab] (float32) of a fresh sequence `token_ids` (one full prefill)."""
        session = self.session()
        try:
            return session.forward(token_ids)[0]
        finally:
            session.close()

    def step_batch(self, sessions: list[Session], token_ids: list[int]) -> torch.Tensor:
        """One decode forward appending token_ids[i] to sessions[i] (sequences of any lengths): logits [B, vocab]."""
        if len(sessions) != len(token_ids) or not sessions:
            raise NinferError("step_batch needs one token per session and at least one session")
        states = [s._live_state() for s in sessions]
        if len({id(s) for s in states}) != len(states):
            raise NinferError("step_batch got the same session twice")
        for state in states:
            if state.length + 1 > state.capacity:
                raise NinferError(f"a sequence reached the context limit of {state.capacity} tokens; raise --max-context")
        ids = self._token_tensor(token_ids)
        hidden = self._hidden(ids, [Segment(state, state.length, i, 1) for i, state in enumerate(states)])
        for state in states:
            state.length += 1
        with torch.no_grad():
            return self.text.logits(self.backend, hidden)

    def generate(self, prompt_ids: Iterable[int], max_tokens: int = 256, sampling=None, stop_ids=None):
        """Generate after `prompt_ids` (see `ninfer_offload.runtime.generate.generate`)."""
        from ninfer_offload.runtime.generate import generate

        return generate(self, prompt_ids, max_tokens=max_tokens, sampling=sampling, stop_ids=stop_ids)

    def close(self) -> None:
        self.artifact.close()

    # ------------------------------------------------------------------ internals
    def _token_tensor(self, token_ids: Iterable[int]) -> torch.Tensor:
        ids = [int(t) for t in token_ids]
        if not ids:
            raise NinferError("no tokens given")
        bad = [t for t in ids if not 0 <= t < self.config.vocab_size]
        if bad:
            raise NinferError(f"token id {bad[0]} is outside the vocabulary [0, {self.config.vocab_size})")
        return torch.tensor(ids, dtype=torch.long).to(self.device, non_blocking=True)

    def _hidden(self, ids: torch.Tensor, segments: list[Segment]) -> torch.Tensor:
        with torch.no_grad():
            return self.text.hidden(self.backend, ids, segments)
