"""`ninfer profile [--out FILE] [--device N]`: detect and measure the local GPU and host, write a profile.

NVML gives the name, memory and PCIe link; torch gives SM count and capability and times pinned
host-to-device copies, device copies and a BF16 matrix multiply; psutil gives host RAM and cores.
The profile is written where `--profile auto` finds it (or to `--out`). Without a GPU: one line,
exit code 2.
"""

from __future__ import annotations

from pathlib import Path
from typing import Optional

import typer

from ninfer_offload.errors import NinferError
from ninfer_offload.profiles import stored_profile_path

COMMENTS = {
    "vram_bytes": "NVML total memory",
    "reserve_bytes": "driver/context/workspace allowance (default, not measured)",
    "memory_bandwidth_gbs": "measured device-to-device copy (read + write), GB/s",
    "h2d_bandwidth_gbs": "measured pinned host-to-device copy, GB/s",
    "pcie_generation": "NVML maximum PCIe link generation",
    "pcie_width": "NVML maximum PCIe link width",
    "sm_count": "torch device properties",
    "compute_capability": "torch device properties",
    "fp4": "FP4 tensor cores (compute capability >= 10.0)",
    "tensor_tflops": "measured BF16 matmul 8192^3, TFLOPS",
    "ram_bytes": "psutil total memory",
    "dram_bandwidth_gbs": "measured multi-threaded host memory read, GB/s",
    "cores": "psutil physical cores",
}


def profile(
    out: Optional[Path] = typer.Option(None, "--out", help="Where to write the profile (default: the file --profile auto reads)."),
    device: int = typer.Option(0, "--device", help="GPU index."),
) -> None:
    """Measure this machine's GPU and host and write a device profile (TOML)."""
    from ninfer_offload.profiles.detect import detect_profile

    measured = detect_profile(device)
    target = out or stored_profile_path()
    try:
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_text(f"# Written by `ninfer profile` for {measured.description}.\n" + measured.to_toml(COMMENTS))
    except OSError as err:
        raise NinferError(f"cannot write profile {target}: {err.strerror or err}") from None
    typer.echo(measured.to_toml(COMMENTS))
    typer.echo(f"profile written to {target}")
