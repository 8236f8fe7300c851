"""Device profiles: what the planner knows about a GPU and its host, stored as TOML.

Shipped profiles live next to this file (`<name>.toml`, every number with its source). A user
profile is any TOML file with the same keys; it may start from a shipped one with
`base = "<name>"` and override only some keys. `auto` means the profile `ninfer profile` stored
for this machine, or, when there is none, one detected now.
"""

from __future__ import annotations

import functools
import os
from dataclasses import dataclass, fields
from importlib import resources
from pathlib import Path

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10
    import tomli as tomllib  # type: ignore[no-redef]

from ninfer_offload.errors import NinferError

GPU_KEYS = {
    "vram_bytes": int,
    "reserve_bytes": int,
    "memory_bandwidth_gbs": float,
    "h2d_bandwidth_gbs": float,
    "pcie_generation": int,
    "pcie_width": int,
    "sm_count": int,
    "compute_capability": str,
    "fp4": bool,
    "tensor_tflops": float,
}
HOST_KEYS = {"ram_bytes": int, "dram_bandwidth_gbs": float, "cores": int}
MAY_BE_ZERO = {"reserve_bytes", "prefill_transfer_overlap"}  # every other number must be positive
# How this engine's kernels perform on the card, measured by the benchmarks (optional: the planner
# falls back to the nearest measured card's values, see planner.cost). The decode forward itself is costed
# launch by launch from `[launches]` below.
ENGINE_KEYS = {
    "weight_bandwidth_efficiency": float,  # share of memory bandwidth the MTP draft step and prefill's weight reads reach
    "offload_step_s": float,  # per forward with offloaded experts: use counting and cache bookkeeping
    "zero_copy_efficiency": float,  # share of H2D bandwidth the MoE kernels reach reading host records
    "cpu_request_s": float,  # CPU miss path: what one layer's hand-off to the host adds, besides the bytes computed
    "prefill_efficiency": float,  # share of tensor throughput a prefill chunk reaches
    "prefill_chunk_floor_s": float,  # per prefill chunk: the least it takes (the host launching its kernels)
    "prefill_transfer_overlap": float,  # share of the shorter of prefill compute and expert transfers hidden
    "mtp_draft_step_s": float,  # one MTP draft step when latency-bound
    "spec_round_s": float,  # per speculative round: host work (drawing drafts, acceptance, resync) not hidden
}
# The per-launch cost model's constants (planner.launch_cost): `<family>_latency_s`, `<family>_bandwidth_share` and
# `<family>_sm_flops` per kernel family, `forward_gap_s` (may be negative: launches overlapping) and `prefill_tensor_share`; fitted by
# bench/calibrate_launches.py. A profile without them borrows the nearest measured card's (planner.cost).
LAUNCH_KEY_SUFFIXES = ("_latency_s", "_bandwidth_share", "_sm_flops")
LAUNCH_PER_FORWARD_KEYS = ("forward_gap_s", "prefill_tensor_share")


@dataclass(frozen=True)
class DeviceProfile:
    """One GPU plus its host. Bandwidths in GB/s (1e9 bytes/s), sizes in bytes."""

    name: str
    description: str
    vram_bytes: int
    reserve_bytes: int
    memory_bandwidth_gbs: float
    h2d_bandwidth_gbs: float
    pcie_generation: int
    pcie_width: int
    sm_count: int
    compute_capability: str
    fp4: bool
    tensor_tflops: float
    ram_bytes: int
    dram_bandwidth_gbs: float
    cores: int
    source: str = "shipped"
    engine: dict[str, float] | None = None  # ENGINE_KEYS measured on this card, when it was benchmarked
    launches: dict[str, float] | None = None  # the per-launch model's constants fitted on this card

    def to_toml(self, comments: dict[str, str] | None = None) -> str:
        """TOML text that `load_profile` reads back to an equal profile; `comments` per key."""
        comments = comments or {}
        lines = [f"name = {_toml_value(self.name)}", f"description = {_toml_value(self.description)}"]
        for section, keys in (("gpu", GPU_KEYS), ("host", HOST_KEYS)):
            lines += ["", f"[{section}]"]
            for key in keys:
                if key in comments:
                    lines.append(f"# {comments[key]}")
                lines.append(f"{key} = {_toml_value(getattr(self, key))}")
        if self.engine:
            lines += ["", "[engine]"] + [f"{key} = {_toml_value(value)}" for key, value in self.engine.items()]
        if self.launches:
            lines += ["", "[launches]"] + [f"{key} = {_toml_value(value)}" for key, value in self.launches.items()]
        return "\n".join(lines) + "\n"


def _toml_value(value) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, str):
        return '"' + value.replace("\\", "\\\\").replace('"', '\\"') + '"'
    return repr(value)


def shipped_names() -> list[str]:
    """Names of the profiles shipped with the package, sorted."""
    return sorted(p.name[:-5] for p in resources.files(__name__).iterdir() if p.name.endswith(".toml"))


def stored_profile_path() -> Path:
    """Where `ninfer profile` stores this machine's profile (`$NINFER_PROFILE` overrides)."""
    if os.environ.get("NINFER_PROFILE"):
        return Path(os.environ["NINFER_PROFILE"])
    config = Path(os.environ.get("XDG_CONFIG_HOME") or Path.home() / ".config")
    return config / "ninfer" / "profile.toml"


def load_profile(spec: str) -> DeviceProfile:
    """A shipped profile by name, a TOML file by path, or `auto` (stored, else detected now)."""
    if spec == "auto":
        stored = stored_profile_path()
        if stored.is_file():
            return _from_file(stored)
        try:
            return _detected()
        except NinferError as err:
            raise NinferError(
                f"--profile auto has no profile stored at {stored} and cannot measure this machine ({err}); "
                f"name a card instead, e.g. --profile rtx5090 (shipped: {', '.join(shipped_names())}), or give a TOML file"
            ) from None
    if spec in shipped_names():
        text = resources.files(__name__).joinpath(f"{spec}.toml").read_text()
        return _from_mapping(_parse(text, spec), f"shipped:{spec}")
    path = Path(spec)
    if path.suffix == ".toml" or path.exists():
        return _from_file(path)
    raise NinferError(f"unknown profile {spec!r}; use one of {', '.join(shipped_names())}, a .toml file or auto")


@functools.cache
def _detected() -> DeviceProfile:
    """This machine's GPU measured once per process (a load deciding `--spec auto` and planning its experts both ask)."""
    from ninfer_offload.profiles.detect import detect_profile

    return detect_profile()


def _from_file(path: Path) -> DeviceProfile:
    try:
        text = path.read_text()
    except OSError as err:
        raise NinferError(f"cannot read profile {path}: {err.strerror or err}") from None
    return _from_mapping(_parse(text, str(path)), str(path))


def _parse(text: str, origin: str) -> dict:
    try:
        return tomllib.loads(text)
    except tomllib.TOMLDecodeError as err:
        raise NinferError(f"profile {origin} is not valid TOML: {err}") from None


def _from_mapping(data: dict, origin: str) -> DeviceProfile:
    base = data.get("base")
    values: dict = {}
    if base is not None:
        if base not in shipped_names():
            raise NinferError(f"profile {origin}: unknown base {base!r}; use one of {', '.join(shipped_names())}")
        parent = load_profile(base)
        values = {f.name: getattr(parent, f.name) for f in fields(DeviceProfile)}
    unknown = set(data) - {"name", "description", "base", "gpu", "host", "engine", "launches"}
    if unknown:
        raise NinferError(f"profile {origin}: unknown key {sorted(unknown)[0]!r}")
    values["name"] = data.get("name", Path(origin).stem)
    values["description"] = data.get("description", values.get("description", values["name"]))
    for section, keys in (("gpu", GPU_KEYS), ("host", HOST_KEYS)):
        table = data.get(section, {})
        if not isinstance(table, dict):
            raise NinferError(f"profile {origin}: [{section}] must be a table")
        for key, value in table.items():
            if key not in keys:
                raise NinferError(f"profile {origin}: unknown key {section}.{key}")
            values[key] = _checked(origin, section, key, value, keys[key])
    engine = data.get("engine")
    if engine is not None:
        if not isinstance(engine, dict):
            raise NinferError(f"profile {origin}: [engine] must be a table")
        for key, value in engine.items():
            if key not in ENGINE_KEYS:
                raise NinferError(f"profile {origin}: unknown key engine.{key}")
        checked = {key: _checked(origin, "engine", key, value, ENGINE_KEYS[key]) for key, value in engine.items()}
        values["engine"] = {**(values.get("engine") or {}), **checked}
    launches = data.get("launches")
    if launches is not None:
        values["launches"] = {**(values.get("launches") or {}), **_launch_table(origin, launches)}
    missing = [k for k in (*GPU_KEYS, *HOST_KEYS) if k not in values]
    if missing:
        raise NinferError(f"profile {origin}: missing key {missing[0]} (or start from a shipped one with base = \"rtx5090\")")
    values["source"] = origin
    return DeviceProfile(**values)


def _launch_table(origin: str, table) -> dict[str, float]:
    """A `[launches]` table's numbers, checked: known key shapes, floats, positive but the gap per forward."""
    if not isinstance(table, dict):
        raise NinferError(f"profile {origin}: [launches] must be a table")
    checked = {}
    for key, value in table.items():
        if key not in LAUNCH_PER_FORWARD_KEYS and not key.endswith(LAUNCH_KEY_SUFFIXES):
            raise NinferError(f"profile {origin}: unknown key launches.{key}")
        if key == "forward_gap_s":
            if isinstance(value, bool) or not isinstance(value, (int, float)):
                raise NinferError(f"profile {origin}: launches.{key} must be float, got {value!r}")
            checked[key] = float(value)
        else:
            checked[key] = _checked(origin, "launches", key, value, float)
    return checked


def _checked(origin: str, section: str, key: str, value, kind: type):
    if kind is float and isinstance(value, int) and not isinstance(value, bool):
        value = float(value)
    if not isinstance(value, kind) or (kind is int and isinstance(value, bool)):
        raise NinferError(f"profile {origin}: {section}.{key} must be {kind.__name__}, got {value!r}")
    if kind in (int, float) and value < 0 or (key not in MAY_BE_ZERO and kind in (int, float) and value == 0):
        raise NinferError(f"profile {origin}: {section}.{key} must be positive, got {value!r}")
    return value
