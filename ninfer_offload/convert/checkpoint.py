"""A Hugging Face checkpoint directory: config, safetensors tensors (read one at a time), resources."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open

from ninfer_offload.errors import NinferError

# Text resources (role -> file) every artifact carries (docs/format.md §8.3); the chat template may
# instead live inside tokenizer_config.json.
TEXT_RESOURCES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja", "generation_config.json")
VISION_RESOURCES = ("preprocessor_config.json", "video_preprocessor_config.json")
_DTYPES = {"BF16": torch.bfloat16, "F16": torch.float16, "F32": torch.float32}
INDEX, SINGLE_FILE = "model.safetensors.index.json", "model.safetensors"


def _read_json(path: Path) -> object:
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise NinferError(f"{path}: not found") from None
    except (UnicodeDecodeError, json.JSONDecodeError) as err:
        raise NinferError(f"{path}: not valid JSON ({err})") from None


def select_files(directory: Path) -> tuple[list[Path], list[Path]]:
    """(safetensors files of the checkpoint, other *.safetensors files in the directory), chosen as
    transformers does: the files `model.safetensors.index.json` lists if it exists, else `model.safetensors`."""
    if not directory.is_dir():
        raise NinferError(f"{directory}: not a directory")
    present = sorted(directory.glob("*.safetensors"))
    index = directory / INDEX
    if index.exists():
        root = _read_json(index)
        weight_map = root.get("weight_map") if isinstance(root, dict) else None
        if not isinstance(weight_map, dict) or not weight_map:
            raise NinferError(f"{index}: missing 'weight_map'")
        files = sorted({directory / f for f in weight_map.values()})
    elif (directory / SINGLE_FILE).is_file():
        files = [directory / SINGLE_FILE]
    else:
        found = f" (found {', '.join(p.name for p in present)}: name a single file {SINGLE_FILE})" if present else ""
        raise NinferError(f"{directory}: no {SINGLE_FILE} or {INDEX}{found}")
    return files, [p for p in present if p not in files]


class Checkpoint:
    """Tensor names, shapes and dtypes from the safetensors headers; tensors read on demand.

    Reads the files `select_files` chooses: the shards of `model.safetensors.index.json`, else
    `model.safetensors`; any other `*.safetensors` file is left alone.
    """

    def __init__(self, directory: str | Path):
        self.directory = Path(directory)
        files, _ = select_files(self.directory)
        self.config = _read_json(self.directory / "config.json")
        self._file: dict[str, Path] = {}
        self._shape: dict[str, tuple[int, ...]] = {}
        self._dtype: dict[str, str] = {}
        for path in files:
            self._scan(path)

    def _scan(self, path: Path) -> None:
        try:
            with safe_open(str(path), framework="pt") as f:
                for name in f.keys():
                    if name in self._file:
                        raise NinferError(f"tensor {name!r} appears in both {self._file[name].name} and {path.name}")
                    info = f.get_slice(name)
                    self._file[name] = path
                    self._shape[name] = tuple(info.get_shape())
                    self._dtype[name] = info.get_dtype()
        except FileNotFoundError:
            raise NinferError(f"{path}: not found (listed in the checkpoint index)") from None
        except SafetensorError as err:
            raise NinferError(f"{path}: not a valid safetensors file ({err})") from None

    def __contains__(self, name: str) -> bool:
        return name in self._file

    @property
    def names(self) -> set[str]:
        return set(self._file)

    def shape(self, name: str) -> tuple[int, ...]:
        return self._shape[name]

    def check(self, name: str, shape: tuple[int, ...]) -> None:
        """Fail with the tensor's name unless it exists with `shape` and a float dtype we read."""
        if name not in self._file:
            raise NinferError(f"checkpoint is missing tensor {name!r}")
        if self._shape[name] != tuple(shape):
            raise NinferError(f"tensor {name!r} has shape {list(self._shape[name])}, expected {list(shape)}")
        if self._dtype[name] not in _DTYPES:
            raise NinferError(f"tensor {name!r} has dtype {self._dtype[name]}; only BF16, F16 and F32 are converted")

    def read(self, name: str, start: int | None = None, stop: int | None = None) -> torch.Tensor:
        """The tensor (or its slice [start, stop) along the first axis) in its stored dtype.

        The file is mapped only for the duration of the call, so reading a large tensor in
        slices keeps the resident memory at one slice.
        """
        with safe_open(str(self._file[name]), framework="pt") as f:
            if start is None:
                return f.get_tensor(name)
            return f.get_slice(name)[start:stop]

    def read_rows(self, name: str, ids: list[int]) -> torch.Tensor:
        """Rows `ids` (any order) of a rank-2 tensor, in its stored dtype; one mapping of the file."""
        with safe_open(str(self._file[name]), framework="pt") as f:
            rows = f.get_slice(name)
            return torch.cat([rows[i : i + 1] for i in ids])

    def resource(self, filename: str) -> bytes | None:
        """Bytes of a resource file in the checkpoint directory, or None if absent."""
        path = self.directory / filename
        return path.read_bytes() if path.is_file() else None

    def chat_template(self) -> bytes | None:
        """`chat_template.jinja`, else the template stored inside tokenizer_config.json."""
        data = self.resource("chat_template.jinja")
        if data is not None:
            return data
        config_bytes = self.resource("tokenizer_config.json")
        if config_bytes is None:
            return None
        template = json.loads(config_bytes).get("chat_template")
        if isinstance(template, list):  # [{"name": ..., "template": ...}, ...]
            named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
            template = named.get("default")
        return template.encode("utf-8") if isinstance(template, str) and template else None
