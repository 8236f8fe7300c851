"""Device profiles: what the planner knows about a GPU and its host, stored as TOML.

Shipped profiles live next to this file (`<name>.toml`, every number with its source). A user
profile is any TOML file with the same keys; it may start from a shipped one with
`base = "<name>"` and override only some keys. `auto` means the profile `ninfer profile` stored
for this machine, or, when there is none, one detected now.
"""

from __future__ import annotations

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
        from ninfer_offload.profiles.detect import detect_profile

        try:
            return detect_profile()
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
    unknown = set(data) - {"name", "description", "base", "gpu", "host"}
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
    missing = [k for k in (*GPU_KEYS, *HOST_KEYS) if k not in values]
    if missing:
        raise NinferError(f"profile {origin}: missing key {missing[0]} (or start from a shipped one with base = \"rtx5090\")")
    values["source"] = origin
    return DeviceProfile(**values)


def _checked(origin: str, section: str, key: str, value, kind: type):
    if kind is float and isinstance(value, int) and not isinstance(value, bool):
        value = float(value)
    if not isinstance(value, kind) or (kind is int and isinstance(value, bool)):
        raise NinferError(f"profile {origin}: {section}.{key} must be {kind.__name__}, got {value!r}")
    if kind in (int, float) and value < 0 or (key != "reserve_bytes" and kind in (int, float) and value == 0):
        raise NinferError(f"profile {origin}: {section}.{key} must be positive, got {value!r}")
    return value
