"""What a forward costs on a card, launch by launch: each launch of `launches.forward_launches` takes its
family's latency plus the longest of its bytes at the family's share of the memory bandwidth, its CUDA-core flops
at the family's rate per SM times the card's SMs and its tensor-core flops at prefill's share of the tensor
throughput; the forward their sum plus a gap per forward (host and graph work between launches, negative where
programmatic dependent launch overlaps launches more than that). The recorded launches fit latency plus bytes
better than the larger of the two: on the H100 an 8.9 MB product takes 6.6 us, a 27 MB one 14.3 us, the 397 MB
output head 165 us.

The constants come from a profile's `[launches]` table (`<family>_latency_s`, `<family>_bandwidth_share`,
`<family>_sm_flops`, `forward_gap_s`, `prefill_tensor_share`), fitted by `bench/calibrate_launches.py` on a
card's recorded runs.
"""

from __future__ import annotations

from dataclasses import dataclass

from ninfer_offload.errors import NinferError
from ninfer_offload.planner.launches import FAMILIES, Launch
from ninfer_offload.profiles import DeviceProfile

PER_FORWARD_KEYS = ("forward_gap_s", "prefill_tensor_share")


FAMILY_KEYS = ("latency_s", "bandwidth_share", "sm_flops")


def launch_keys() -> tuple[str, ...]:
    """Every key a complete `[launches]` table holds."""
    return tuple(f"{f}_{k}" for f in FAMILIES for k in FAMILY_KEYS) + PER_FORWARD_KEYS


@dataclass(frozen=True)
class LaunchConstants:
    """One card's per-family launch latency (s), achieved share of the memory bandwidth and CUDA-core flops per
    second per SM, its gap per forward and the share of tensor throughput prefill reaches."""

    latency_s: dict[str, float]
    bandwidth_share: dict[str, float]
    sm_flops: dict[str, float]
    forward_gap_s: float
    prefill_tensor_share: float

    @classmethod
    def from_table(cls, table: dict[str, float], origin: str) -> "LaunchConstants":
        missing = [key for key in launch_keys() if key not in table]
        if missing:
            raise NinferError(f"{origin}: [launches] has no {missing[0]} (run bench/calibrate_launches.py)")
        return cls(
            {f: table[f"{f}_latency_s"] for f in FAMILIES},
            {f: table[f"{f}_bandwidth_share"] for f in FAMILIES},
            {f: table[f"{f}_sm_flops"] for f in FAMILIES},
            table["forward_gap_s"],
            table["prefill_tensor_share"],
        )

    def to_table(self) -> dict[str, float]:
        table: dict[str, float] = {}
        for f in FAMILIES:
            table[f"{f}_latency_s"] = self.latency_s[f]
            table[f"{f}_bandwidth_share"] = self.bandwidth_share[f]
            table[f"{f}_sm_flops"] = self.sm_flops[f]
        return {**table, "forward_gap_s": self.forward_gap_s, "prefill_tensor_share": self.prefill_tensor_share}


def launch_seconds(launch: Launch, constants: LaunchConstants, profile: DeviceProfile) -> float:
    """One launch of `launch` on the card: its latency plus the slowest of its bytes, tensor-core and CUDA-core work."""
    bandwidth = profile.memory_bandwidth_gbs * 1e9 * constants.bandwidth_share[launch.family]
    tensor = profile.tensor_tflops * 1e12 * constants.prefill_tensor_share
    cores = profile.sm_count * constants.sm_flops[launch.family]
    return constants.latency_s[launch.family] + max(launch.bytes / bandwidth, launch.flops / tensor, launch.core_flops / cores)


def family_seconds(launches: list[Launch], constants: LaunchConstants, profile: DeviceProfile) -> dict[str, float]:
    """Seconds per family of a forward's launches."""
    result = dict.fromkeys(FAMILIES, 0.0)
    for launch in launches:
        result[launch.family] += launch.count * launch_seconds(launch, constants, profile)
    return result


def forward_seconds(launches: list[Launch], constants: LaunchConstants, profile: DeviceProfile) -> float:
    """A forward: its launches and the gap per forward."""
    return sum(family_seconds(launches, constants, profile).values()) + constants.forward_gap_s
