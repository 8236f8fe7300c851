"""What a forward costs on a card, launch by launch: each launch of `launches.forward_launches` takes
max(its family's latency, its bytes at the family's share of the memory bandwidth, its flops at the card's
prefill share of the tensor throughput), the forward their sum plus a gap per forward (host and graph work
between launches, negative where programmatic dependent launch overlaps launches more than that).

The constants come from a profile's `[launches]` table (`<family>_latency_s`, `<family>_bandwidth_share`,
`forward_gap_s`, `prefill_tensor_share`), fitted by `bench/calibrate_launches.py` on a card's recorded runs.
"""

from __future__ import annotations

from dataclasses import dataclass

from ninfer_offload.errors import NinferError
from ninfer_offload.planner.launches import FAMILIES, Launch
from ninfer_offload.profiles import DeviceProfile

PER_FORWARD_KEYS = ("forward_gap_s", "prefill_tensor_share")


def launch_keys() -> tuple[str, ...]:
    """Every key a complete `[launches]` table holds."""
    return tuple(f"{f}_{k}" for f in FAMILIES for k in ("latency_s", "bandwidth_share")) + PER_FORWARD_KEYS


@dataclass(frozen=True)
class LaunchConstants:
    """One card's per-family launch latency (s) and achieved share of the memory bandwidth, its gap per forward
    and the share of tensor throughput prefill reaches."""

    latency_s: dict[str, float]
    bandwidth_share: dict[str, float]
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
            table["forward_gap_s"],
            table["prefill_tensor_share"],
        )

    def to_table(self) -> dict[str, float]:
        table: dict[str, float] = {}
        for f in FAMILIES:
            table[f"{f}_latency_s"] = self.latency_s[f]
            table[f"{f}_bandwidth_share"] = self.bandwidth_share[f]
        return {**table, "forward_gap_s": self.forward_gap_s, "prefill_tensor_share": self.prefill_tensor_share}


def launch_seconds(launch: Launch, constants: LaunchConstants, profile: DeviceProfile) -> float:
    """One launch of `launch` on the card."""
    bandwidth = profile.memory_bandwidth_gbs * 1e9 * constants.bandwidth_share[launch.family]
    tensor = profile.tensor_tflops * 1e12 * constants.prefill_tensor_share
    return constants.latency_s[launch.family] + max(launch.bytes / bandwidth, launch.flops / tensor)


def family_seconds(launches: list[Launch], constants: LaunchConstants, profile: DeviceProfile) -> dict[str, float]:
    """Seconds per family of a forward's launches."""
    result = dict.fromkeys(FAMILIES, 0.0)
    for launch in launches:
        result[launch.family] += launch.count * launch_seconds(launch, constants, profile)
    return result


def forward_seconds(launches: list[Launch], constants: LaunchConstants, profile: DeviceProfile) -> float:
    """A forward: its launches and the gap per forward."""
    return sum(family_seconds(launches, constants, profile).values()) + constants.forward_gap_s
