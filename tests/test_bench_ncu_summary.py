"""bench/ncu_summary.py: the summary of Nsight Compute's printed sections (an excerpt of an H100 probe run's output)."""

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "bench"))

from ncu_summary import summarize  # noqa: E402

EXCERPT = """\
==PROF== Profiling "_gate_up_swiglu_gemv_kernel" - 0: 0%....50%....100% - 20 passes
==PROF== Profiling "_down_split_gemv_kernel" - 1: 0%....50%....100% - 20 passes
probed moe1
  _gate_up_swiglu_gemv_kernel (8, 32, 1)x(256, 1, 1), Context 1, Stream 7, Device 0, CC 9.0
    Section: GPU Speed Of Light Throughput
    DRAM Throughput                   %        26.64
    Duration                         us        10.05
    L1/TEX Cache Throughput           %        15.44
    Section: Launch Statistics
    Registers Per Thread             register/thread             115
    Dynamic Shared Memory Per Block      Kbyte/block            2.05
    Waves Per SM                                                0.97
    Section: Occupancy
    Achieved Occupancy                        %        22.42
  _down_split_gemv_kernel (128, 8, 1)x(64, 1, 1), Context 1, Stream 7, Device 0, CC 9.0
    Section: GPU Speed Of Light Throughput
    DRAM Throughput                   %        16.25
    Duration                         us        10.21
    L1/TEX Cache Throughput           %        28.48
    Section: Launch Statistics
    Registers Per Thread             register/thread             121
    Dynamic Shared Memory Per Block       byte/block             128
    Waves Per SM                                                0.97
    Section: Occupancy
    Achieved Occupancy                        %        20.53
"""


def test_each_profiled_launch_is_a_row_with_its_metrics_in_common_units():
    cases, rows = summarize(EXCERPT)
    assert cases == ["moe1"]
    assert [(row["kernel"], row["grid"], row["block"]) for row in rows] == [
        ("_gate_up_swiglu_gemv_kernel", "8, 32, 1", "256, 1, 1"),
        ("_down_split_gemv_kernel", "128, 8, 1", "64, 1, 1"),
    ]
    first, second = rows
    assert first["duration_us"] == pytest.approx(10.05) and second["dram_percent"] == pytest.approx(16.25)
    assert first["registers"] == 115 and first["waves"] == pytest.approx(0.97)
    assert first["dynamic_shared_kb"] == pytest.approx(2.05)  # printed in Kbyte/block
    assert second["dynamic_shared_kb"] == pytest.approx(0.128)  # printed in byte/block
    assert second["issue_busy_percent"] is None  # a metric the excerpt leaves out
