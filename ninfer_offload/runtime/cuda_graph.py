"""The resident decode step of one sequence, captured once as a CUDA graph and replayed per token.

Decode is launch-bound in Python (ARCHITECTURE.md decision 8): one token runs ~20 kernels per
layer. `DecodeGraph` records the whole step (embedding, 40 layers, head) once and replays it.
Everything that changes between tokens lives in device buffers the graph reads: the token id,
its position (rotary, KV row) and the number of valid KV rows (attention). The KV cache and the
GDN conv/recurrent states of the session are updated in place, so replay continues the same
sequence that eager `Session.step` would. The step is the model's own forward
(`TextModel.hidden` with the device-held position and KV row count, which its attention layers
read through `GatedAttention.decode`).

Needs the Triton backend (its attention decode accepts a device length), resident experts
(staging needs the routing on the host) and a CUDA device.
"""

from __future__ import annotations

import weakref

import torch

from ninfer_offload.errors import NinferError
from ninfer_offload.runtime.state import Segment


# One captured step per live session (dropped with the session).
_GRAPHS: "weakref.WeakKeyDictionary[object, DecodeGraph]" = weakref.WeakKeyDictionary()


def graphs_apply(engine) -> bool:
    """Whether `engine`'s decode steps run as CUDA graphs (CUDA device, triton backend, resident experts)."""
    return engine.device.type == "cuda" and getattr(engine.backend, "name", "") == "triton" and engine.store.mode == "resident"


def decode_step(session, token_id: int) -> torch.Tensor:
    """Append one token to `session`: logits [vocab], from the session's captured graph where graphs apply."""
    if not graphs_apply(session.engine):
        return session.prefill([token_id])
    graph = _GRAPHS.get(session)
    if graph is None or graph.state is not session._live_state():
        graph = _GRAPHS[session] = DecodeGraph(session.engine, session)
    return graph.step(token_id)


class DecodeGraph:
    """Captured single-token decode step bound to one session's state."""

    def __init__(self, engine, session):
        if not graphs_apply(engine):
            raise NinferError("CUDA-graph decode needs a CUDA device, the triton backend and resident experts")
        self.engine = engine
        self.session = session
        self.state = session._live_state()
        device = engine.device
        self.token = torch.zeros(1, dtype=torch.long, device=device)
        self.position = torch.zeros(1, dtype=torch.long, device=device)  # position of the new token
        self.rows = torch.ones(1, dtype=torch.int32, device=device)  # valid KV rows after its write
        self.segments = [Segment(self.state, 0, 0, 1)]
        self._set_inputs(0)
        self._warm_up()
        self.graph = torch.cuda.CUDAGraph()
        with torch.no_grad(), torch.cuda.graph(self.graph):
            self.logits = self._forward()

    def step(self, token_id: int) -> torch.Tensor:
        """Append `token_id` to the session; its logits [vocab] (float32, a fresh tensor)."""
        state = self.session._live_state()
        if state.length + 1 > state.capacity:
            raise NinferError(f"a sequence reached the context limit of {state.capacity} tokens; raise --max-context")
        if not 0 <= token_id < self.engine.config.vocab_size:
            raise NinferError(f"token id {token_id} is outside the vocabulary [0, {self.engine.config.vocab_size})")
        self._set_inputs(token_id)
        self.graph.replay()
        state.length += 1
        return self.logits[0].clone()

    # ------------------------------------------------------------------ internals
    def _set_inputs(self, token_id: int) -> None:
        self.token.fill_(token_id)
        self.position.fill_(self.state.length)
        self.rows.fill_(self.state.length + 1)

    def _warm_up(self) -> None:
        """Run the step once eagerly (compiles kernels, settles allocations) without changing the sequence."""
        saved = [t.clone() for t in (*self.state.conv.values(), *self.state.recurrent.values())]
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.no_grad(), torch.cuda.stream(stream):
            self._forward()
        torch.cuda.current_stream().wait_stream(stream)
        for live, copy in zip((*self.state.conv.values(), *self.state.recurrent.values()), saved):
            live.copy_(copy)  # the KV row it wrote is rewritten by the first real step

    def _forward(self) -> torch.Tensor:
        return captured_forward(self.engine, self.segments, self.token, self.position, self.rows)


def captured_forward(engine, segments: list[Segment], token: torch.Tensor, position: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
    """The ops a `DecodeGraph` records: logits [1, vocab] of `token` [1] at device `position` [1], `rows` [1] valid KV rows."""
    text, backend = engine.text, engine.backend
    return text.logits(backend, text.hidden(backend, token, segments, position, rows))
