"""How a step's missing experts split between the PCIe link and the host (the CPU miss path).

The hand-off's `publish` gives the host an assignment of an expert outside VRAM when the expert is in
the host's share (`take`) and at most `host_max_uses` rows of the step use it. Over the link an expert
costs one read of its record whatever its uses (shared reads); on the host each of its rows is computed
from the record, so the host should take the experts few rows use and leave the link the others.
`host_max_uses` picks the limit for a step from the cost model's rates (`planner.cost`): the link's
zero-copy rate, the host's expert rate and the cost per layer handed to the host, with each expert's
uses in a step of `rows` rows drawn from the plan's expected picks per token (tokens route independently,
as the cost model assumes). One row uses each of its experts once, so a one-row step's split is the
share alone.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ninfer_offload.planner.cost import CPU_EXPERT_SHARE_OF_DRAM, engine_timings
from ninfer_offload.profiles import DeviceProfile, load_profile, stored_profile_path

DEFAULT_PROFILE = "rtx5090"  # the rates of a machine without a stored profile


@dataclass(frozen=True)
class MissRates:
    """The cost model's rates of the two miss paths."""

    link_bps: float  # host record bytes read per second over PCIe (zero-copy)
    cpu_bps: float  # host record bytes computed per second by the host, per row
    request_s: float  # seconds per layer handed to the host and answered

    @classmethod
    def of_profile(cls, profile: DeviceProfile) -> "MissRates":
        timings, _ = engine_timings(profile)
        return cls(
            profile.h2d_bandwidth_gbs * 1e9 * timings["zero_copy_efficiency"],
            profile.dram_bandwidth_gbs * 1e9 * CPU_EXPERT_SHARE_OF_DRAM,
            timings["cpu_request_s"],
        )

    @classmethod
    def of_machine(cls) -> "MissRates":
        """This machine's stored profile (`ninfer profile`), else DEFAULT_PROFILE's."""
        stored = stored_profile_path()
        return cls.of_profile(load_profile(str(stored) if stored.is_file() else DEFAULT_PROFILE))

    @property
    def host_share(self) -> float:
        """The share of one-row misses the host takes when both paths run at these rates."""
        return self.cpu_bps / (self.cpu_bps + self.link_bps)


def uses_pmf(expected: np.ndarray, rows: int) -> np.ndarray:
    """P(an expert is used by u rows of a step of `rows` rows), u = 0..rows: float [rows + 1, *expected.shape]
    (binomial, `expected` the picks per token, at most 1)."""
    q = np.clip(expected, 0.0, 1.0 - 1e-12)  # (odds stay finite)
    pmf = np.empty((rows + 1, *q.shape))
    pmf[0] = (1.0 - q) ** rows
    odds = q / (1.0 - q)
    for u in range(rows):
        pmf[u + 1] = pmf[u] * (rows - u) / (u + 1) * odds
    return pmf


def host_max_uses(rates: MissRates, rows: int, share: float, expected: np.ndarray, missing: np.ndarray, record_bytes: np.ndarray) -> int:
    """The limit m in 1..rows for a step of `rows` rows that minimizes the expected miss time, the sum over layers of
    max(host, link): host = its rows x record bytes / cpu rate + the hand-off's cost if it has any work; link = records
    read / link rate. `share`: the share of experts `take` gives the host; `expected` [layers, experts]: picks per
    token; `missing` [layers, experts]: not in VRAM; `record_bytes` [layers]. Whether the host takes any misses
    (m = 0) is the share's decision, not this one's."""
    if rows <= 1 or share <= 0:
        return 1
    pmf = uses_pmf(np.where(missing, expected, 0.0), rows)  # an expert in VRAM is never a miss
    used = 1.0 - pmf[0]
    u = np.arange(rows + 1).reshape(-1, *([1] * expected.ndim))
    taken = share * np.cumsum(pmf[1:], axis=0)  # [m - 1, layers, experts]: P(the host takes it) at limit m
    host_rows = share * np.cumsum(u[1:] * pmf[1:], axis=0)  # its expected rows on the host
    handed = 1.0 - np.prod(1.0 - taken, axis=2)  # P(the layer hands the host any work)
    host_s = host_rows.sum(axis=2) * record_bytes / rates.cpu_bps + handed * rates.request_s
    link_s = (used - taken).sum(axis=2) * record_bytes / rates.link_bps
    return 1 + int(np.argmin(np.maximum(host_s, link_s).sum(axis=1)))
