"""Detect and measure the local GPU and host: NVML for identity and memory, torch for SMs and
capability, timed copies for bandwidths, psutil for host RAM."""

from __future__ import annotations

import os
import time

from ninfer_offload.errors import NinferError
from ninfer_offload.profiles import DeviceProfile

RESERVE_BYTES = 1 << 30  # driver/context/workspace allowance, as in the shipped profiles
FP4_MIN_CAPABILITY = (10, 0)  # Blackwell tensor cores (sm_100, sm_120) have FP4


def _nvml_facts(index: int) -> dict:
    try:
        import pynvml
    except ImportError:
        raise NinferError("no GPU: nvidia-ml-py is not installed") from None
    try:
        pynvml.nvmlInit()
    except pynvml.NVMLError as err:
        raise NinferError(f"no GPU: NVML is not available ({err})") from None
    try:
        if pynvml.nvmlDeviceGetCount() <= index:
            raise NinferError(f"no GPU with index {index} (NVML sees {pynvml.nvmlDeviceGetCount()})")
        handle = pynvml.nvmlDeviceGetHandleByIndex(index)
        name = pynvml.nvmlDeviceGetName(handle)
        memory = pynvml.nvmlDeviceGetMemoryInfo(handle)
        return {
            "name": name.decode() if isinstance(name, bytes) else name,
            "vram_bytes": int(memory.total),
            "used_bytes": int(memory.used),
            "pcie_generation": int(pynvml.nvmlDeviceGetMaxPcieLinkGeneration(handle)),
            "pcie_width": int(pynvml.nvmlDeviceGetMaxPcieLinkWidth(handle)),
        }
    finally:
        pynvml.nvmlShutdown()


def _best_seconds(run, repeats: int) -> float:
    """Fastest of `repeats` timed calls of `run` (returns after the work has finished)."""
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        run()
        best = min(best, time.perf_counter() - start)
    return best


def measure_bandwidths(index: int = 0, nbytes: int = 1 << 30, repeats: int = 5) -> dict[str, float]:
    """Pinned host-to-device, device-to-device and host-memory read bandwidths in GB/s, each the
    best of `repeats` copies of `nbytes` (large enough that caches and launch latency do not count)."""
    import torch

    device = torch.device("cuda", index)
    host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    host.fill_(1)
    dev_a = torch.empty(nbytes, dtype=torch.uint8, device=device)
    dev_b = torch.empty_like(dev_a)

    def h2d():
        dev_a.copy_(host, non_blocking=True)
        torch.cuda.synchronize(device)

    def d2d():
        dev_b.copy_(dev_a)
        torch.cuda.synchronize(device)

    h2d(), d2d()  # warm up
    words = host.view(torch.int64)
    torch.set_num_threads(os.cpu_count() or 1)
    host_read = _best_seconds(lambda: words.sum(), repeats)
    return {
        "h2d_bandwidth_gbs": nbytes / _best_seconds(h2d, repeats) / 1e9,
        # A device copy reads and writes every byte: count both, like a memory-bandwidth figure.
        "device_copy_gbs": 2 * nbytes / _best_seconds(d2d, repeats) / 1e9,
        "dram_bandwidth_gbs": nbytes / host_read / 1e9,
    }


def detect_profile(index: int = 0) -> DeviceProfile:
    """Profile of GPU `index` of this machine, measured now; NinferError without a GPU."""
    facts = _nvml_facts(index)
    import psutil
    import torch

    if not torch.cuda.is_available():
        raise NinferError("no GPU: NVML sees one but torch has no CUDA; install a CUDA build of torch")
    props = torch.cuda.get_device_properties(index)
    measured = measure_bandwidths(index)
    slug = "".join(c for c in facts["name"].lower().replace("nvidia", "") if c.isalnum())
    return DeviceProfile(
        name=slug or f"gpu{index}",
        description=f"{facts['name']} (measured by ninfer profile)",
        # NVML's total counts memory CUDA cannot hand out (H100 80GB: 79.6 against 79.2 GiB): the smaller one
        vram_bytes=min(facts["vram_bytes"], int(props.total_memory)),
        reserve_bytes=RESERVE_BYTES,
        # The measured device copy (read + write) stands in for the datasheet bandwidth.
        memory_bandwidth_gbs=round(measured["device_copy_gbs"], 1),
        h2d_bandwidth_gbs=round(measured["h2d_bandwidth_gbs"], 1),
        pcie_generation=facts["pcie_generation"],
        pcie_width=facts["pcie_width"],
        sm_count=int(props.multi_processor_count),
        compute_capability=f"{props.major}.{props.minor}",
        fp4=(props.major, props.minor) >= FP4_MIN_CAPABILITY,
        tensor_tflops=_tensor_tflops(index),
        ram_bytes=int(psutil.virtual_memory().total),
        dram_bandwidth_gbs=round(measured["dram_bandwidth_gbs"], 1),
        cores=int(psutil.cpu_count(logical=False) or os.cpu_count() or 1),
        source="measured",
    )


def _tensor_tflops(index: int, size: int = 8192, repeats: int = 5) -> float:
    """Measured BF16 matrix-multiply throughput (FP32 accumulation) in TFLOPS."""
    import torch

    device = torch.device("cuda", index)
    a = torch.randn(size, size, device=device, dtype=torch.bfloat16)
    b = torch.randn(size, size, device=device, dtype=torch.bfloat16)

    def run():
        torch.matmul(a, b)
        torch.cuda.synchronize(device)

    run()
    return round(2 * size**3 / _best_seconds(run, repeats) / 1e12, 1)
