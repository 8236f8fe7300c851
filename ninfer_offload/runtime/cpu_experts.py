"""Routed experts on the host at run time: the CPU miss path.

The device hands a layer's missing experts to the host through the mailbox of
`runtime.miss_handoff` (no host sync: an offloaded step with a CPU miss path is still one CUDA
graph); `CpuMissPath` answers in a worker thread with the numba kernels of
`ninfer_offload.kernels.cpu.experts` (`HostExperts`) while the device computes the experts in VRAM
(on a CPU-only engine the calling thread answers in place).
Which misses the host takes: an expert outside VRAM that the device mask `take` [layer, expert] gives the
host and that at most `host_max_uses` (a device scalar) rows of the step use. "cpu" takes every miss; "auto"
takes a share of each layer's experts that `SplitTuner` picks per step size by measured step time among no
share, all, and the share the host's and the PCIe link's rates would give, so it is never slower than the
better pure path by more than the trials' noise, and sets `host_max_uses` per step from the cost model's
rates (`runtime.batch_split`): in a batch the host takes the experts few rows use, the link the others.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field

import numba
import numpy as np
import torch

from ninfer_offload.artifact.records import ExpertRecordLayout
from ninfer_offload.errors import NinferError
from ninfer_offload.kernels.cpu.experts import EXACT_PARTS, SIXTEEN_BIT_PARTS, RecordKernelPlan, routed_experts_cpu, warm_up
from ninfer_offload.kernels.cpu.handoff import answer_request, next_request
from ninfer_offload.runtime import miss_handoff
from ninfer_offload.runtime.batch_split import MissRates, host_max_uses
from ninfer_offload.runtime.miss_handoff import DONE, HEADER_WORDS, READY, Mailbox

# Mailbox polls per `next_request` call (~5 ms for 41 layers; 2,000 took 0.2 ms): the worker spins without the
# GIL that long, then sleeps until a step wakes it. Taking the GIL back after every short poll stalled the thread
# that drives the device.
SWEEPS = 50_000
SHARE_SEED = 0  # which experts a share takes: a fixed random order per layer
LIMIT_REFRESH_STEPS = 256  # "auto" recomputes a step size's `host_max_uses` this often (the cache moves experts)


class HostExperts:
    """Computes routed experts from a layer's host records [E, stride] (uint8) with the numba
    kernels; lossless bf16/fp32 records (a test recipe) through the torch reference op. Counts
    calls, seconds and record bytes read."""

    def __init__(self, parts: int):
        warm_up()
        self.parts = parts
        self._plans: dict[ExpertRecordLayout, RecordKernelPlan] = {}
        self._flat: dict[int, tuple[np.ndarray, np.ndarray]] = {}
        self.calls = 0
        self.seconds = 0.0
        self.bytes = 0

    def compute(
        self, layout, records: torch.Tensor, x: np.ndarray, ids: np.ndarray, weights: np.ndarray, selected: np.ndarray, out: np.ndarray
    ) -> None:
        """out [T, H] (float32, zeroed here) = sum over the selected (t, j) of weights * expert_{ids}(x[t])."""
        start = time.perf_counter()
        out[:] = 0
        if isinstance(layout, ExpertRecordLayout):
            flat, offsets = self._records(records)
            routed_experts_cpu(self._plan(layout), flat, offsets, x, ids, weights, selected, self.parts, out=out)
        else:
            out[:] = _reference_dense(layout, records, x, ids, weights, selected).numpy()
        self.calls += 1
        self.seconds += time.perf_counter() - start
        self.bytes += np.unique(ids[selected]).size * layout.nbytes

    def _records(self, records: torch.Tensor) -> tuple[np.ndarray, np.ndarray]:
        key = records.data_ptr()
        if key not in self._flat:
            if records.device.type != "cpu" or records.dtype != torch.uint8 or records.dim() != 2 or records.stride(1) != 1:
                raise NinferError("CPU expert compute needs host records as a CPU uint8 tensor [experts, bytes]")
            flat = records.as_strided(((records.shape[0] - 1) * records.stride(0) + records.shape[1],), (1,)).numpy()
            self._flat[key] = flat, np.arange(records.shape[0], dtype=np.int64) * records.stride(0)
        return self._flat[key]

    def _plan(self, layout: ExpertRecordLayout) -> RecordKernelPlan:
        if layout not in self._plans:
            self._plans[layout] = RecordKernelPlan.create(layout)
        return self._plans[layout]

    @property
    def rate(self) -> float:
        """Record bytes per second computed so far (0 before the first call)."""
        return self.bytes / self.seconds if self.seconds else 0.0

    def stats(self) -> dict:
        return {"calls": self.calls, "seconds": round(self.seconds, 6), "gbs": round(self.rate / 1e9, 3)}


def _reference_dense(
    layout, records: torch.Tensor, x: np.ndarray, ids: np.ndarray, weights: np.ndarray, selected: np.ndarray
) -> torch.Tensor:
    """Lossless (bf16/fp32) records: the torch reference op on the host."""
    from ninfer_offload.model.backend import ReferenceBackend
    from ninfer_offload.model.experts import ExpertBank

    bank = ExpertBank.of_records(layout, records)
    w = np.where(selected, weights, 0).astype(np.float32)
    return ReferenceBackend().routed_experts(torch.from_numpy(x), torch.from_numpy(ids), torch.from_numpy(w), bank)


@dataclass
class SplitTuner:
    """"auto": the share of each layer's experts the host takes when they miss. Trials run each
    candidate share for `window` decode steps (the first of each not counted), `rounds` times in turn,
    after `warmup` steps, timing each step per token under its size (rows: a batch's best share need not be
    one row's); each size that ran every candidate keeps the one with the lowest mean seconds per token for
    `hold` steps (a size not measured takes the nearest measured size's), then trials run again."""

    candidates: tuple[float, ...]
    window: int = 8
    rounds: int = 3
    warmup: int = 4
    hold: int = 4096
    _step: int = 0
    _times: dict[int, list[list[float]]] = field(default_factory=dict)  # per step size, per candidate
    chosen: dict[int, float] = field(default_factory=dict)  # per step size
    means: dict[int, list[float]] = field(default_factory=dict)  # seconds per token of each candidate in the last trials

    @property
    def trial_steps(self) -> int:
        return self.warmup + self.window * len(self.candidates) * self.rounds

    def share(self, rows: int = 1) -> float:
        """The share for the next step, of `rows` rows."""
        step = self._step % (self.trial_steps + self.hold)
        if step >= self.trial_steps or step < self.warmup:
            if not self.chosen:
                return self.candidates[-1]
            return self.chosen[min(self.chosen, key=lambda size: (abs(size - rows), size))]
        return self.candidates[(step - self.warmup) // self.window % len(self.candidates)]

    def timed(self) -> bool:
        """Whether the next step's time counts (a trial step, not the first of its window, which may capture
        the step's graph for its share): the others are only counted, so held steps pay for no timing."""
        step = self._step % (self.trial_steps + self.hold)
        return self.warmup <= step < self.trial_steps and (step - self.warmup) % self.window != 0

    def observe(self, share: float, rows: int, seconds_per_token: float | None) -> None:
        """One finished step of `rows` rows run with `share` (None: not timed); after the last trial step, choose."""
        if seconds_per_token is not None and self.timed() and share in self.candidates:
            self._times.setdefault(rows, [[] for _ in self.candidates])[self.candidates.index(share)].append(seconds_per_token)
        self._step += 1
        if self._step % (self.trial_steps + self.hold) == self.trial_steps:
            measured = {rows: times for rows, times in self._times.items() if all(times)}
            if measured:
                self.means = {rows: [float(np.mean(t)) for t in times] for rows, times in measured.items()}
                self.chosen = {rows: self.candidates[int(np.argmin(means))] for rows, means in self.means.items()}
            self._times = {}

    def stats(self) -> dict:
        return {
            "candidates": list(self.candidates),
            "ms_per_token": {str(rows): [round(m * 1e3, 4) for m in means] for rows, means in sorted(self.means.items())},
            "share": {str(rows): share for rows, share in sorted(self.chosen.items())},
            "steps": self._step,
        }


class CpuMissPath:
    """The expert store's CPU miss path: the mailbox, the host worker that answers it, and which
    misses the host takes (`take`, int8 [layers, experts] on the device)."""

    def __init__(
        self, mode: str, layouts: list, num_experts: int, top_k: int, hidden: int, device: torch.device, host: list[torch.Tensor],
        expected: np.ndarray,
    ):
        self.mode = mode
        self.layouts = layouts
        self.host = host  # the store's per-layer host records (filled while loading)
        self.device = device
        self.mailbox = Mailbox(len(layouts), top_k, hidden, device)
        self.take = torch.ones(len(layouts), num_experts, dtype=torch.int8, device=device)
        # the most rows of a step that use one expert: every miss when set to the most rows of a hand-off
        self.host_max_uses = torch.full((1,), self.mailbox.tokens, dtype=torch.int32, device=device)
        self._max_uses = self.mailbox.tokens
        self._order = np.argsort(np.random.default_rng(SHARE_SEED).random((len(layouts), num_experts)), axis=1).argsort(axis=1)
        self.rates = MissRates.of_machine() if mode == "auto" else None
        self.tuner = SplitTuner(_candidates(self.rates.host_share)) if mode == "auto" else None
        self._expected = expected  # [layers, experts]: the plan's picks per token
        self._record_bytes = np.array([layout.nbytes for layout in layouts], dtype=np.float64)
        self._limits: dict[tuple[int, float], int] = {}  # "auto": host_max_uses per (rows, share), refreshed as the cache moves
        self._limit_calls = 0
        self._share = 1.0
        self.experts = HostExperts(EXACT_PARTS)
        # With a GPU, leave one core to the thread that drives it.
        self.threads = max(1, numba.config.NUMBA_NUM_THREADS - 1) if device.type == "cuda" else None
        self.requests = 0
        self._error: BaseException | None = None
        self._stop = False
        self._wake = threading.Event()
        self._steps: list[tuple[float, object, object, int]] = []  # (share, start, end, tokens) of steps not yet read (untimed: None)
        self._worker: threading.Thread | None = None

    @property
    def tokens(self) -> int:
        """Most tokens of a forward that hands misses to the host."""
        return self.mailbox.tokens

    @property
    def active(self) -> bool:
        """Whether the host takes any misses now (with share zero the steps skip the hand-off)."""
        return self._share > 0

    # ------------------------------------------------------------------ device side
    def routed(
        self, backend, bank, layer: int, x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor, anchor: torch.Tensor,
        cpu_uses: torch.Tensor,
    ) -> torch.Tensor:
        """The routed experts of one layer: the host's share of the misses through the mailbox, the rest
        on the device (VRAM, or host records over PCIe), the host's rows added. On CUDA the worker thread
        answers while the device computes; on the CPU, with nothing to overlap, the calling thread does."""
        on_cuda = self.device.type == "cuda"
        if on_cuda:
            self.start_worker()
        self.experts.parts = EXACT_PARTS if x.dtype == torch.float32 else SIXTEEN_BIT_PARTS
        ids, weights = miss_handoff.publish(
            self.mailbox, layer, x, topk_ids, topk_weights, bank.offsets, self.take[layer], self.host_max_uses, anchor, cpu_uses,
            bank.arena,
        )
        if self._worker is None and not on_cuda and int(self.mailbox.state[layer, 1]):
            self._answer(layer)  # (with a worker running, it answers: one answer per request)
        out = backend.routed_experts(x, ids, weights, bank)
        return miss_handoff.collect(self.mailbox, layer, out, bank.arena)

    # ------------------------------------------------------------------ step boundary
    def step_started(self, tokens: int | None, in_vram: np.ndarray) -> object:
        """Before a forward of `tokens` rows is launched (None: a prompt chunk, not timed): raise a
        failure of the previous ones, apply the tuner's share for the step's size and the limit on uses the rates
        give it (`in_vram` [layers, experts]: where the experts are now), wake the worker if the host takes a share;
        a mark for `step_finished` (the tuner times decode steps per token)."""
        self.check()
        mark = None
        if self.tuner is not None and tokens is not None:
            self._read_timings()
            share = self.tuner.share(tokens)
            if share != self._share:
                self.set_share(share)
            self.set_host_max_uses(self._limit(tokens, share, in_vram))
            mark = share, self._mark() if self.tuner.timed() else None, tokens
        if self.active:
            self._wake.set()
        return mark

    def step_finished(self, mark) -> None:
        if mark is not None:
            share, start, tokens = mark
            self._steps.append((share, start, None if start is None else self._mark(), tokens))

    def _limit(self, rows: int, share: float, in_vram: np.ndarray) -> int:
        """`batch_split.host_max_uses` for a step of `rows` rows at `share`, computed once per LIMIT_REFRESH_STEPS steps."""
        self._limit_calls += 1
        if self._limit_calls % LIMIT_REFRESH_STEPS == 0:
            self._limits.clear()
        key = rows, share
        if key not in self._limits:
            self._limits[key] = host_max_uses(self.rates, rows, share, self._expected, ~in_vram, self._record_bytes)
        return self._limits[key]

    def _mark(self):
        if self.device.type != "cuda":
            return time.perf_counter()
        event = torch.cuda.Event(enable_timing=True)
        event.record()
        return event

    def _read_timings(self) -> None:
        """Fold the finished timed steps into the tuner (events that are not done yet wait)."""
        while self._steps:
            share, start, end, tokens = self._steps[0]
            if end is None:
                per_token = None
            elif isinstance(end, float):
                per_token = (end - start) / tokens
            elif end.query():
                per_token = start.elapsed_time(end) / 1e3 / tokens
            else:
                return
            self._steps.pop(0)
            self.tuner.observe(share, tokens, per_token)

    def set_share(self, share: float) -> None:
        """The host takes the first `share` of each layer's experts in a fixed random order (in stream order)."""
        mask = (self._order < round(share * self._order.shape[1])).astype(np.int8)
        self.take.copy_(torch.from_numpy(mask))
        self._share = share

    def set_host_max_uses(self, limit: int) -> None:
        """The host takes only experts used by at most `limit` rows of a step (0: none; in stream order)."""
        if limit != self._max_uses:
            self.host_max_uses.fill_(limit)
            self._max_uses = limit

    def check(self) -> None:
        if self._error is not None:
            raise NinferError(f"the CPU miss path failed: {self._error}") from self._error
        if self.mailbox.failed():
            raise NinferError("the CPU miss path did not answer the device in time (its worker thread is stalled)")

    # ------------------------------------------------------------------ host worker
    def start_worker(self) -> None:
        """Start the thread that answers the mailbox's requests (once; `close` stops it)."""
        if self._worker is None:
            self._worker = threading.Thread(target=self._run, name="cpu-miss-path", daemon=True)
            self._worker.start()

    def _run(self) -> None:
        if self.threads is not None:
            numba.set_num_threads(self.threads)
        flags, layers = self.mailbox.flags, len(self.layouts)
        while not self._stop:
            self._wake.clear()  # before polling: a step that starts meanwhile makes the wait below return at once
            layer = next_request(flags, layers, HEADER_WORDS, READY, DONE, SWEEPS)
            if layer >= 0:
                self._answer(layer)
            else:
                self._wake.wait(0.1)

    def _answer(self, layer: int) -> None:
        """Compute layer `layer`'s open request into its answer rows, then release the answer."""
        flags = self.mailbox.flags
        ticket = int(flags[layer * HEADER_WORDS + READY])
        t, ids, weights, x = self.mailbox.request(layer)
        out = self.mailbox.answer(layer, t)
        try:
            selected = ids >= 0
            ids = np.where(selected, ids, 0).astype(np.int64)
            self.experts.compute(self.layouts[layer], self.host[layer], x, ids, weights, selected, out)
        except BaseException as err:  # the device waits for an answer: give it NaN, report at the next step
            self._error = err
            out[:] = np.nan
        self.requests += 1
        answer_request(flags, layer * HEADER_WORDS + DONE, ticket)

    def stats(self) -> dict:
        return {
            "mode": self.mode,
            "requests": self.requests,
            "host_max_uses": self._max_uses,
            "cpu": self.experts.stats(),
            **({"auto": self.tuner.stats()} if self.tuner else {}),
        }

    def close(self) -> None:
        self._stop = True
        self._wake.set()
        if self._worker is not None:
            self._worker.join(timeout=5)


def _candidates(rate_share: float) -> tuple[float, ...]:
    """No share, the rates' share, all (the rates' share rounded to a sixteenth)."""
    return tuple(sorted({0.0, round(rate_share * 16) / 16, 1.0}))
