"""Routed experts on the host at run time: the worker-thread executor and the store's CPU miss path.

`CpuExpertExecutor` runs the numba kernels of `ninfer_offload.kernels.cpu.experts` in a worker
thread so CPU work overlaps the GPU; `MissSplitter` splits missing experts between CPU compute and
PCIe transfer by measured rates; `CpuMissPath` is the seam the expert store calls.
"""

from __future__ import annotations

import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field

import numba
import numpy as np
import torch

from ninfer_offload.artifact.records import ExpertRecordLayout
from ninfer_offload.errors import NinferError
from ninfer_offload.kernels.cpu.experts import EXACT_PARTS, SIXTEEN_BIT_PARTS, RecordKernelPlan, routed_experts_cpu, warm_up


@dataclass
class MissSplitter:
    """Splits a step's missing experts between CPU compute and PCIe transfer by measured rates.

    Rates are bytes of expert records per second. They start from the device profile (host: a
    fraction of its DRAM bandwidth; PCIe: its H2D bandwidth) and every measured call moves them
    by an exponential moving average. Counts and the last split are kept for stats.
    """

    cpu_rate: float
    pcie_rate: float
    smoothing: float = 0.25
    cpu_experts: int = 0
    pcie_experts: int = 0
    last_split: tuple[int, int] = (0, 0)
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    @classmethod
    def from_profile(cls, profile) -> "MissSplitter":
        """Starting rates from a DeviceProfile, as the planner's cost model assumes them."""
        from ninfer_offload.planner.cost import CPU_EXPERT_SHARE_OF_DRAM

        return cls(cpu_rate=CPU_EXPERT_SHARE_OF_DRAM * profile.dram_bandwidth_gbs * 1e9, pcie_rate=profile.h2d_bandwidth_gbs * 1e9)

    def cpu_share(self, missing: int) -> int:
        """How many of `missing` equally sized experts the CPU should compute (both sides finish together)."""
        if missing <= 0 or self.cpu_rate <= 0:
            return 0
        if self.pcie_rate <= 0:
            return missing
        return int(round(missing * self.cpu_rate / (self.cpu_rate + self.pcie_rate)))

    def split(self, missing: np.ndarray, tokens_per_expert: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(CPU experts, PCIe experts) of `missing`: the CPU takes its share, fewest tokens
        first: its cost grows with tokens, a transfer's does not.
        Recorded in the stats."""
        missing = np.asarray(missing, dtype=np.int64)
        order = np.lexsort((missing, np.asarray(tokens_per_expert)))
        share = self.cpu_share(missing.size)
        cpu, pcie = np.sort(missing[order[:share]]), np.sort(missing[order[share:]])
        with self._lock:
            self.cpu_experts += cpu.size
            self.pcie_experts += pcie.size
            self.last_split = (int(cpu.size), int(pcie.size))
        return cpu, pcie

    def observe(self, path: str, nbytes: int, seconds: float) -> None:
        """Fold one measured transfer or computation (path "cpu" or "pcie") into its rate."""
        if nbytes <= 0 or seconds <= 0:
            return
        rate = nbytes / seconds
        with self._lock:
            if path == "cpu":
                self.cpu_rate += self.smoothing * (rate - self.cpu_rate)
            else:
                self.pcie_rate += self.smoothing * (rate - self.pcie_rate)

    def stats(self) -> dict:
        return {
            "cpu_rate_gbs": float(f"{self.cpu_rate / 1e9:.4g}"),  # significant digits: tiny test records
            "pcie_rate_gbs": float(f"{self.pcie_rate / 1e9:.4g}"),  # can run at well under 1 MB/s
            "cpu_experts": self.cpu_experts,
            "pcie_experts": self.pcie_experts,
            "last_split": {"cpu": self.last_split[0], "pcie": self.last_split[1]},
        }


class CpuExpertExecutor:
    """Computes routed experts on the host from a layer's host records, in a worker thread.

    Records are a CPU uint8 tensor [E, stride] (row e = expert e's record, pinned or not).
    `submit` returns a Future of the [T, H] float32 CPU partial output, so the caller overlaps it
    with device work and adds it later (numba releases the GIL); `run` is the synchronous form.
    Quantized records run through the numba kernels; lossless bf16/fp32 records (a test recipe)
    through the torch reference op. One call at a time uses the thread pool (`threads` numba
    threads, default all); measured rates feed the optional `MissSplitter`. float32 activations
    are computed exactly, bf16/fp16 ones with the kernels' 16-bit activation split.
    """

    def __init__(self, threads: int | None = None, splitter: MissSplitter | None = None):
        warm_up()
        self.threads = threads
        self.splitter = splitter
        self._worker = ThreadPoolExecutor(max_workers=1, thread_name_prefix="cpu-experts")
        self._lock = threading.Lock()
        self._plans: dict[ExpertRecordLayout, RecordKernelPlan] = {}
        self.calls = 0
        self.seconds = 0.0
        self.bytes = 0

    def run(
        self, layout, records: torch.Tensor, x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor,
        selected: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """sum over the (selected) assignments of w * expert(x[token]) -> CPU float32 [T, H]."""
        return self._compute(layout, records, *_host_inputs(x, topk_ids, topk_weights, selected), _parts_for(x))

    def submit(
        self, layout, records: torch.Tensor, x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor,
        selected: torch.Tensor | None = None,
    ) -> Future:
        """`run` in the worker thread; inputs are brought to the host first, in the caller's stream order."""
        return self._worker.submit(self._compute, layout, records, *_host_inputs(x, topk_ids, topk_weights, selected), _parts_for(x))

    def _compute(
        self, layout, records: torch.Tensor, x: np.ndarray, ids: np.ndarray, weights: np.ndarray, selected: np.ndarray | None, parts: int
    ) -> torch.Tensor:
        if records.device.type != "cpu" or records.dtype != torch.uint8 or records.dim() != 2 or records.stride(1) != 1:
            raise NinferError("CPU expert compute needs host records as a CPU uint8 tensor [experts, bytes]")
        used = np.unique(ids if selected is None else ids[selected])
        with self._lock:
            if self.threads is not None:
                numba.set_num_threads(self.threads)
            start = time.perf_counter()
            if isinstance(layout, ExpertRecordLayout):
                flat = records.as_strided(((records.shape[0] - 1) * records.stride(0) + records.shape[1],), (1,)).numpy()
                offsets = np.arange(records.shape[0], dtype=np.int64) * records.stride(0)
                out = torch.from_numpy(routed_experts_cpu(self._plan(layout), flat, offsets, x, ids, weights, selected, parts))
            else:
                out = _reference_dense(layout, records, x, ids, weights, selected)
            elapsed = time.perf_counter() - start
        self.calls += 1
        self.seconds += elapsed
        self.bytes += used.size * layout.nbytes
        if self.splitter is not None and used.size:
            self.splitter.observe("cpu", used.size * layout.nbytes, elapsed)
        return out

    def _plan(self, layout: ExpertRecordLayout) -> RecordKernelPlan:
        if layout not in self._plans:
            self._plans[layout] = RecordKernelPlan.create(layout)
        return self._plans[layout]

    def stats(self) -> dict:
        return {
            "calls": self.calls,
            "seconds": round(self.seconds, 6),
            "gbs": round(self.bytes / self.seconds / 1e9, 3) if self.seconds else 0.0,
        }

    def close(self) -> None:
        self._worker.shutdown(wait=True)


def _host_inputs(x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor, selected: torch.Tensor | None):
    """float32/int64/bool numpy copies on the host of a call's inputs (copies, so the caller may
    reuse its tensors while the worker runs)."""
    return (
        x.detach().to("cpu", torch.float32, copy=True).contiguous().numpy(),
        topk_ids.detach().to("cpu", torch.int64, copy=True).numpy(),
        topk_weights.detach().to("cpu", torch.float32, copy=True).numpy(),
        None if selected is None else selected.detach().to("cpu", torch.bool, copy=True).numpy(),
    )


def _parts_for(x: torch.Tensor) -> int:
    """Activation parts of the integer path for activations of x's dtype."""
    return EXACT_PARTS if x.dtype == torch.float32 else SIXTEEN_BIT_PARTS


def _reference_dense(
    layout, records: torch.Tensor, x: np.ndarray, ids: np.ndarray, weights: np.ndarray, selected: np.ndarray | None
) -> torch.Tensor:
    """Lossless (bf16/fp32) records: the torch reference op on the host."""
    from ninfer_offload.model.backend import ReferenceBackend
    from ninfer_offload.model.experts import ExpertBank

    if selected is not None:
        weights = np.where(selected, weights, 0).astype(np.float32)
    bank = ExpertBank.of_records(layout, records)
    return ReferenceBackend().routed_experts(torch.from_numpy(x), torch.from_numpy(ids), torch.from_numpy(weights), bank)


class CpuMissPath:
    """The expert store's CPU miss path: which assignments the host computes, and computing them.

    "cpu": every assignment whose expert is not in VRAM runs on the host. "auto": the missing
    experts are split between host compute and the device's zero-copy reads (PCIe) by `MissSplitter`, seeded
    from this machine's stored profile (`ninfer profile`) or the default profile and refined by
    measuring both paths. Host work runs in the executor's worker thread while the device works.
    """

    DEFAULT_PROFILE = "rtx5090"

    def __init__(self, mode: str, device: torch.device):
        self.mode = mode
        self.splitter = _initial_splitter(self.DEFAULT_PROFILE) if mode == "auto" else None
        # With a GPU, leave one core to the thread that drives it.
        threads = max(1, numba.config.NUMBA_NUM_THREADS - 1) if device.type == "cuda" else None
        self.executor = CpuExpertExecutor(threads=threads, splitter=self.splitter)
        self._pending: list[tuple[int, object, object]] = []  # PCIe bytes read with their CUDA events

    def host_assignments(self, ids: torch.Tensor, in_vram: torch.Tensor) -> torch.Tensor:
        """bool [T, k]: the assignments the host computes, given which experts sit in VRAM
        (`in_vram` [num_experts]); "auto" leaves the device its measured share of the others."""
        missing = ~in_vram[ids]
        if self.splitter is None or not bool(missing.any()):
            return missing
        experts, counts = torch.unique(ids[missing], return_counts=True)
        cpu, _ = self.splitter.split(experts.numpy(), counts.numpy())
        return missing & torch.from_numpy(np.isin(ids.numpy(), cpu))

    def submit(
        self, layout, records: torch.Tensor, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor, selected: torch.Tensor
    ) -> Future:
        return self.executor.submit(layout, records, x, ids, weights, selected)

    def device_started(self, device: torch.device):
        """A mark taken before the device's share is launched (for `device_finished`)."""
        if self.splitter is None or device.type != "cuda":
            return time.perf_counter()
        begin = torch.cuda.Event(enable_timing=True)
        begin.record()
        return begin

    def device_finished(self, mark, nbytes: int) -> None:
        """Fold the device's share, which read `nbytes` of host records over PCIe since `mark`, into the
        PCIe rate. CUDA work is asynchronous: its end event is read on a later call, once complete, so
        no step waits for it."""
        if self.splitter is None:
            return
        if isinstance(mark, float):
            if nbytes > 0:
                self.splitter.observe("pcie", nbytes, time.perf_counter() - mark)
            return
        end = torch.cuda.Event(enable_timing=True)
        end.record()
        pending = self._pending + ([(nbytes, mark, end)] if nbytes > 0 else [])
        self._pending = []
        for n, begin, finish in pending:
            if finish.query():
                self.splitter.observe("pcie", n, begin.elapsed_time(finish) / 1e3)
            else:
                self._pending.append((n, begin, finish))

    def stats(self) -> dict:
        return {"mode": self.mode, "cpu": self.executor.stats(), **({"split": self.splitter.stats()} if self.splitter else {})}


def _initial_splitter(default_profile: str) -> MissSplitter:
    from ninfer_offload.profiles import load_profile, stored_profile_path

    stored = stored_profile_path()
    return MissSplitter.from_profile(load_profile(str(stored) if stored.is_file() else default_profile))
