"""Device profiles: shipped values with sources, user TOML files, `base`, errors, `auto`."""

from __future__ import annotations

from dataclasses import replace
from importlib import resources

import pytest

from ninfer_offload.errors import NinferError
from ninfer_offload.profiles import GPU_KEYS, HOST_KEYS, load_profile, shipped_names

GiB = 2**30


def test_shipped_profiles_match_the_issue():
    assert shipped_names() == ["h100", "h200", "rtx5060ti", "rtx5090", "rtxpro6000"]
    p = load_profile("rtx5090")
    assert (p.vram_bytes, p.memory_bandwidth_gbs, p.pcie_generation, p.pcie_width, p.sm_count, p.compute_capability, p.fp4) == (
        32 * GiB, 1792.0, 5, 16, 170, "12.0", True
    )
    p = load_profile("rtx5060ti")
    assert (p.vram_bytes, p.memory_bandwidth_gbs, p.pcie_width, p.sm_count) == (16 * GiB, 448.0, 8, 36)
    p = load_profile("rtxpro6000")
    assert (p.vram_bytes, p.memory_bandwidth_gbs, p.sm_count) == (96 * GiB, 1792.0, 188)
    p = load_profile("h200")
    assert (p.vram_bytes, p.memory_bandwidth_gbs, p.h2d_bandwidth_gbs, p.sm_count, p.compute_capability, p.fp4) == (
        141 * 10**9, 4800.0, 55.0, 132, "9.0", False
    )
    p = load_profile("h100")
    facts = (p.vram_bytes, p.memory_bandwidth_gbs, p.h2d_bandwidth_gbs, p.sm_count, p.tensor_tflops)
    assert facts == (80 * 10**9, 3350.0, 55.0, 132, 989.0)


@pytest.mark.parametrize("name", ["h100", "h200", "rtx5060ti", "rtx5090", "rtxpro6000"])
def test_every_shipped_number_has_a_source_comment(name):
    lines = resources.files("ninfer_offload.profiles").joinpath(f"{name}.toml").read_text().splitlines()
    commented = False
    for line in lines:
        stripped = line.strip()
        if stripped.startswith("#"):
            commented = True
        elif stripped.startswith("["):
            commented = False
        elif "=" in stripped and stripped.split("=")[0].strip() in {*GPU_KEYS, *HOST_KEYS}:
            assert commented, f"{name}: {stripped} has no source comment above it in its section"


@pytest.mark.parametrize("name", ["rtx5060ti", "h200"])
def test_round_trip_through_toml(tmp_path, name):
    original = load_profile(name)
    path = tmp_path / "mine.toml"
    path.write_text(original.to_toml({"vram_bytes": "a comment"}))
    loaded = load_profile(str(path))
    assert replace(loaded, source="x") == replace(original, source="x")


def test_user_file_with_base_overrides(tmp_path):
    path = tmp_path / "desk.toml"
    path.write_text('base = "rtx5090"\n[host]\nram_bytes = 34359738368\n[gpu]\nh2d_bandwidth_gbs = 26\n')
    p = load_profile(str(path))
    assert p.name == "desk" and p.ram_bytes == 32 * GiB and p.h2d_bandwidth_gbs == 26.0
    assert p.sm_count == 170 and p.source == str(path)


def test_engine_timings_merge_over_the_base(tmp_path):
    path = tmp_path / "tuned.toml"
    path.write_text('base = "h200"\n[engine]\noffload_step_s = 0.001\n')
    p, h200 = load_profile(str(path)), load_profile("h200")
    assert p.engine == {**h200.engine, "offload_step_s": 0.001}


@pytest.mark.parametrize(
    "text, message",
    [
        ("[gpu\n", "not valid TOML"),
        ('base = "rtx5090"\n[gpu]\nwarp_speed = 9\n', "unknown key gpu.warp_speed"),
        ('base = "rtx9090"\n', "unknown base"),
        ("[gpu]\nvram_bytes = 1\n", "missing key"),
        ('base = "rtx5090"\n[gpu]\nsm_count = "many"\n', "must be int"),
        ('base = "rtx5090"\n[gpu]\nvram_bytes = -5\n', "must be positive"),
        ('base = "rtx5090"\ncolour = 1\n', "unknown key 'colour'"),
        ('base = "rtx5090"\n[engine]\nwarp_factor = 0.5\n', "unknown key engine.warp_factor"),
        ('base = "rtx5090"\n[engine]\noffload_step_s = -0.001\n', "must be positive"),
        ('base = "rtx5090"\n[engine]\noffload_step_s = 0.0\n', "must be positive"),
    ],
)
def test_bad_profiles_give_one_line(tmp_path, text, message):
    path = tmp_path / "bad.toml"
    path.write_text(text)
    with pytest.raises(NinferError, match=message) as info:
        load_profile(str(path))
    assert "\n" not in str(info.value)


def test_an_overlap_share_may_be_zero(tmp_path):
    """A measured share of nothing hidden is a valid calibration (the other engine numbers must be positive)."""
    path = tmp_path / "no_overlap.toml"
    path.write_text('base = "rtx5090"\n[engine]\nprefill_transfer_overlap = 0.0\n')
    assert load_profile(str(path)).engine["prefill_transfer_overlap"] == 0.0


def test_unknown_name_and_missing_file(tmp_path):
    with pytest.raises(NinferError, match="unknown profile"):
        load_profile("rtx9090")
    with pytest.raises(NinferError, match="cannot read profile"):
        load_profile(str(tmp_path / "absent.toml"))


def test_auto_uses_the_stored_profile(tmp_path, monkeypatch):
    stored = tmp_path / "profile.toml"
    stored.write_text('base = "rtx5060ti"\nname = "this-box"\n')
    monkeypatch.setenv("NINFER_PROFILE", str(stored))
    assert load_profile("auto").name == "this-box"


def test_auto_without_stored_profile_or_gpu(tmp_path, monkeypatch):
    torch = pytest.importorskip("torch")
    if torch.cuda.is_available():
        pytest.skip("a GPU is present: auto would measure it")
    monkeypatch.setenv("NINFER_PROFILE", str(tmp_path / "none.toml"))
    with pytest.raises(NinferError, match="no GPU"):
        load_profile("auto")
