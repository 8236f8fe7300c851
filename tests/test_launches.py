"""The per-launch cost model: the launch table mirrors the engine's recorded launches, the calibration reads
recorded runs and refuses incomplete ones, profiles carry the fitted constants."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "bench"))

from calibrate_launches import Model, read_results  # noqa: E402

from ninfer_offload.errors import NinferError  # noqa: E402
from ninfer_offload.kernels import quant_linear  # noqa: E402
from ninfer_offload.planner import launches  # noqa: E402
from ninfer_offload.planner.launch_cost import LaunchConstants, forward_seconds  # noqa: E402
from ninfer_offload.profiles import load_profile  # noqa: E402

PROFILED = REPO / "bench/results/step_ab_h100_down_walk_profile_fd5a366.json"


@pytest.fixture(scope="module")
def model():
    return Model.official()


def test_launch_counts_per_family_equal_the_recorded_profile_of_one_token_verification_and_batch_steps(model):
    tables = read_results([PROFILED]).tables  # the nopdl variant: one kernel table per step kind
    assert [(t.shape.tokens, t.shape.sequences) for t in tables] == [(1, 1), (4, 1), (1, 8)]
    for table in tables:
        assert launches.counts(model.launches(table.shape)) == table.launches, table.name
    one_token = launches.counts(model.launches(tables[0].shape))
    assert one_token["routed_gate_up"] == 40 and one_token["gdn_recurrence"] == 30 and sum(one_token.values()) == 313


def test_the_regime_thresholds_are_the_kernels():
    assert launches.GEMV_MAX_TOKENS == quant_linear.GEMV_MAX_TOKENS
    assert launches.SMALL_GEMV_MAX_TOKENS == quant_linear.SMALL_GEMV_MAX_TOKENS
    assert launches.MMA_MIN_ROWS == quant_linear.MMA_MIN_ROWS


def test_a_multi_token_step_reads_more_experts_and_keeps_a_state_per_position(model):
    from calibrate_launches import Shape

    def bytes_of(shape, family):
        return sum(x.count * x.bytes for x in model.launches(shape) if x.family == family)

    one, four = Shape(1, 1, 1024), Shape(4, 1, 1024)
    assert bytes_of(four, "routed_gate_up") > 2.5 * bytes_of(one, "routed_gate_up")
    assert bytes_of(four, "gdn_recurrence") == pytest.approx(2.5 * bytes_of(one, "gdn_recurrence"))


@pytest.mark.parametrize("card", ["h100", "h200"])
def test_shipped_profiles_carry_complete_launch_constants_that_predict_their_own_decode_within_15_percent(card, model):
    from calibrate_launches import Shape

    profile = load_profile(card)
    constants = LaunchConstants.from_table(profile.launches, card)
    measured = {"h100": 2.171e-3, "h200": 1.993e-3}[card]  # step_ab one-token steps (fd5a366, a0d2a21)
    assert forward_seconds(model.launches(Shape(1, 1, 1024)), constants, profile) == pytest.approx(measured, rel=0.15)


def test_an_incomplete_launch_table_names_the_missing_key():
    with pytest.raises(NinferError, match="no dense_product_latency_s"):
        LaunchConstants.from_table({}, "profile x")


def test_calibration_of_incomplete_or_unknown_inputs_exits_2_and_says_why(tmp_path):
    calibrate = [sys.executable, str(REPO / "bench/calibrate_launches.py"), "--profile", "h100"]
    no_prefill = REPO / "bench/results/resident_h100_32k_f10d72b.json"
    result = subprocess.run([*calibrate, str(no_prefill)], capture_output=True, text=True, timeout=120)
    assert result.returncode == 2 and "4096-token prefill" in result.stderr and "left as it is" in result.stderr
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({"gpu": "x"}))
    result = subprocess.run([*calibrate, str(bad)], capture_output=True, text=True, timeout=120)
    assert result.returncode == 2 and "neither a step_ab" in result.stderr
