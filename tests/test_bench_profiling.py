"""The stream timeline the benchmarks report, read from a Chrome trace as the torch profiler writes it."""

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "bench"))

from profiling import timeline_from_trace  # noqa: E402


def test_streams_busy_time_merges_overlaps_and_counts_overlap_between_streams_and_idle_time():
    events = [
        {"cat": "kernel", "name": "a", "ts": 0.0, "dur": 10.0, "args": {"stream": 7}},
        {"cat": "kernel", "name": "b", "ts": 5.0, "dur": 10.0, "args": {"stream": 7}},  # overlaps a: 15 us busy
        {"cat": "gpu_memcpy", "name": "h2d", "ts": 10.0, "dur": 20.0, "args": {"stream": 20}},
        {"cat": "gpu_memset", "name": "z", "ts": 40.0, "dur": 2.0, "args": {"stream": 20}},
        {"cat": "cuda_runtime", "name": "cudaStreamSynchronize", "ts": 0.0, "dur": 3.0},
        {"cat": "cuda_runtime", "name": "cudaLaunchKernel", "ts": 0.0, "dur": 100.0},
        {"cat": "cpu_op", "name": "aten::add", "ts": 0.0, "dur": 50.0},
        {"ph": "M", "name": "process_name"},
    ]
    timeline = timeline_from_trace(events)
    assert timeline["device_busy_ms"] == pytest.approx(32e-3)  # [0, 30] and [40, 42]
    assert timeline["device_idle_ms"] == pytest.approx(10e-3)  # (30, 40): no stream busy
    assert timeline["streams_overlap_ms"] == pytest.approx(5e-3)  # stream 7's [10, 15] under the copy
    assert timeline["host_sync_ms"] == pytest.approx(3e-3)
    assert timeline["runtime_calls"] == {  # costliest first; CPU ops are not runtime calls
        "cudaLaunchKernel": {"calls": 1, "ms": pytest.approx(0.1)},
        "cudaStreamSynchronize": {"calls": 1, "ms": pytest.approx(3e-3)},
    }
    assert list(timeline["streams"]) == ["20", "7"]  # busiest first
    assert timeline["streams"]["7"] == {"busy_ms": pytest.approx(15e-3), "kernels": 2, "copies": 0, "copy_ms": 0.0}
    assert timeline["streams"]["20"] == {"busy_ms": pytest.approx(22e-3), "kernels": 1, "copies": 1, "copy_ms": pytest.approx(20e-3)}


def test_idle_device_time_is_attributed_to_what_the_host_was_doing():
    """Two gaps between kernels: the first spent in a torch op (its nested launch not counted apart) and in
    Python after it, the second in a synchronizing call."""
    events = [
        {"cat": "kernel", "name": "k1", "ts": 0.0, "dur": 10.0, "args": {"stream": 7}},
        {"cat": "kernel", "name": "k2", "ts": 30.0, "dur": 10.0, "args": {"stream": 7}},
        {"cat": "kernel", "name": "k3", "ts": 60.0, "dur": 5.0, "args": {"stream": 7}},
        {"cat": "cpu_op", "name": "aten::index_add_", "ts": 8.0, "dur": 14.0, "tid": 1},  # 12 us of the gap (10, 30)
        {"cat": "cuda_runtime", "name": "cudaLaunchKernel", "ts": 12.0, "dur": 5.0, "tid": 1},  # inside the op
        {"cat": "cuda_runtime", "name": "cudaStreamSynchronize", "ts": 41.0, "dur": 30.0, "tid": 1},  # 19 us of (40, 60)
    ]
    idle = timeline_from_trace(events)["idle_by_host_call_ms"]
    assert idle == {
        "cudaStreamSynchronize": pytest.approx(19e-3),
        "aten::index_add_": pytest.approx(12e-3),
        "(between calls: Python)": pytest.approx(9e-3),  # 8 of the first gap, 1 of the second
    }


def test_launch_leads_tell_a_host_bound_stream_from_a_device_bound_one():
    """Stream 7's kernels start 2 us after their launch calls return (the device waits for the host), stream 30's
    50 us after (the host is ahead); a kernel without a matching launch is not counted."""
    events = [
        {"cat": "cuda_runtime", "name": "cuLaunchKernelEx", "ts": 0.0, "dur": 8.0, "args": {"correlation": 1}},
        {"cat": "kernel", "name": "a", "ts": 10.0, "dur": 5.0, "args": {"stream": 7, "correlation": 1}},
        {"cat": "cuda_runtime", "name": "cuLaunchKernelEx", "ts": 20.0, "dur": 8.0, "args": {"correlation": 2}},
        {"cat": "kernel", "name": "b", "ts": 30.0, "dur": 5.0, "args": {"stream": 7, "correlation": 2}},
        {"cat": "cuda_runtime", "name": "cudaLaunchKernel", "ts": 0.0, "dur": 10.0, "args": {"correlation": 3}},
        {"cat": "kernel", "name": "c", "ts": 60.0, "dur": 5.0, "args": {"stream": 30, "correlation": 3}},
        {"cat": "kernel", "name": "d", "ts": 99.0, "dur": 1.0, "args": {"stream": 30, "correlation": 9}},
    ]
    assert timeline_from_trace(events)["launch_lead_ms"] == {"7": pytest.approx(2e-3), "30": pytest.approx(50e-3)}
