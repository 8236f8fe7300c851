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


def test_calibrated_on_one_card_the_model_predicts_the_other_within_15_percent_both_ways():
    """bench/crosscard.py on the committed H100 and H200 runs: every case within the 15 % target."""
    from calibrate_launches import read_results as read
    from crosscard import cases

    results = REPO / "bench/results"
    h100 = read([results / name for name in (
        "step_ab_h100_down_walk_profile_fd5a366.json", "resident_h100_1a12bdd.json", "resident_h100_32k_f10d72b.json",
        "step_ab_h100_15gib_shared_reads_42923b0.json",
    )])
    h200 = read([results / name for name in (
        "step_ab_h200_settings_a0d2a21.json", "resident_h200_a0d2a21.json", "spec_h200_proposal_a0d2a21.json",
        "step_ab_h200_15gib_tiles_a0d2a21.json",
    )])
    names = ["decode 1K", "decode 32K", "verify 3 drafts", "batch 8", "prefill 4096", "decode 15 GiB"]
    for source, target, profiles in ((h100, h200, ("h100", "h200")), (h200, h100, ("h200", "h100"))):
        rows = cases(source, load_profile(profiles[0]), target, load_profile(profiles[1]))
        assert [row["name"] for row in rows] == names
        assert all(abs(row["error"]) <= 0.15 for row in rows), rows


def test_a_user_profile_without_launch_constants_plans_with_the_nearest_measured_cards_and_says_so(tmp_path):
    card = tmp_path / "mine.toml"
    card.write_text('base = "rtx5060ti"\nname = "mine"\n[gpu]\nmemory_bandwidth_gbs = 3000.0\n')
    result = subprocess.run(
        [sys.executable, "-m", "ninfer_offload", "plan", "--profile", str(card), "--spec", "none"],
        capture_output=True, text=True, timeout=120,
    )
    assert result.returncode == 0, result.stderr
    assert "warning: mine has no complete [launches] table; its speed is predicted with the [launches] constants of h100" in (
        result.stderr.replace("\n", " ")
    )
