"""A Hugging Face checkpoint directory: config, safetensors tensors (read one at a time), resources."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import torch
from safetensors import SafetensorError, safe_open

from ninfer_offload.convert import compressed as compressed_nvfp4
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
    `model.safetensors`; any other `*.safetensors` file is left alone. In a compressed-tensors NVFP4
    checkpoint each quantized Linear `X` appears as the one tensor `X.weight` (`convert.compressed`):
    `nvfp4()` gives its stored planes, `read()` its decoded values.
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
        compressed = isinstance(self.config, dict) and compressed_nvfp4.is_compressed_nvfp4(self.config)
        self._linears = compressed_nvfp4.linear_prefixes(set(self._file)) if compressed else set()
        planes = {f"{prefix}{plane}" for prefix in self._linears for plane in compressed_nvfp4.PLANES}
        self._names = frozenset((set(self._file) - planes) | {f"{prefix}weight" for prefix in self._linears})

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
        return name in self._names

    @property
    def names(self) -> set[str]:
        """Tensor names; a quantized Linear's planes count as its one `X.weight`."""
        return set(self._names)

    def _linear(self, name: str) -> str | None:
        """`X.` when `name` is the `X.weight` of a quantized Linear, else None."""
        prefix = name.removesuffix("weight")
        return prefix if name.endswith(".weight") and prefix in self._linears else None

    def stored_name(self, name: str) -> str:
        """The name of the stored tensor behind `name` (the packed codes of a quantized Linear)."""
        prefix = self._linear(name)
        return name if prefix is None else f"{prefix}{compressed_nvfp4.PACKED}"

    def check(self, name: str, shape: tuple[int, ...]) -> None:
        """Fail with the tensor's name unless it exists with `shape` and a dtype we read."""
        prefix = self._linear(name)
        if prefix is not None:
            self._check_linear(prefix, tuple(shape))
            return
        if name not in self._file:
            raise NinferError(f"checkpoint is missing tensor {name!r}")
        if self._shape[name] != tuple(shape):
            raise NinferError(f"tensor {name!r} has shape {list(self._shape[name])}, expected {list(shape)}")
        if self._dtype[name] not in _DTYPES:
            raise NinferError(f"tensor {name!r} has dtype {self._dtype[name]}; only BF16, F16 and F32 are converted")

    def _check_linear(self, prefix: str, shape: tuple[int, ...]) -> None:
        """The planes of a quantized Linear exist with the dtypes and shapes of a [N, K] NVFP4 matrix."""
        n, k = shape
        expected = {
            compressed_nvfp4.PACKED: [(n, k // 2)],
            compressed_nvfp4.SCALE: [(n, k // 16)],
            compressed_nvfp4.GLOBAL_SCALE: [(1,), ()],
        }
        for plane, shapes in expected.items():
            name = f"{prefix}{plane}"
            if name not in self._file:
                raise NinferError(f"checkpoint is missing tensor {name!r}")
            if self._dtype[name] != compressed_nvfp4.PLANE_DTYPES[plane]:
                raise NinferError(f"tensor {name!r} has dtype {self._dtype[name]}, expected {compressed_nvfp4.PLANE_DTYPES[plane]}")
            if k % 16 or self._shape[name] not in shapes:
                want = f"{list(shapes[0])} for an NVFP4 matrix {list(shape)}"
                raise NinferError(f"tensor {name!r} has shape {list(self._shape[name])}, expected {want}")

    def _get(self, name: str, start: int | None, stop: int | None) -> torch.Tensor:
        with safe_open(str(self._file[name]), framework="pt") as f:
            if start is None:
                return f.get_tensor(name)
            return f.get_slice(name)[start:stop]

    def read(self, name: str, start: int | None = None, stop: int | None = None) -> torch.Tensor:
        """The tensor (or its slice [start, stop) along the first axis) in its stored dtype; the
        float32 decoded values for a quantized Linear.

        The file is mapped only for the duration of the call, so reading a large tensor in
        slices keeps the resident memory at one slice.
        """
        if self._linear(name) is None:
            return self._get(name, start, stop)
        return torch.from_numpy(compressed_nvfp4.dequantize(self.nvfp4(name, start, stop)))

    def nvfp4(self, name: str, start: int | None = None, stop: int | None = None) -> compressed_nvfp4.Nvfp4Matrix | None:
        """The stored NVFP4 planes of a quantized Linear's rows [start, stop) (all rows by default), checked
        (`compressed.check_matrix`); None for a tensor stored unquantized."""
        prefix = self._linear(name)
        if prefix is None:
            return None
        codes = self._get(f"{prefix}{compressed_nvfp4.PACKED}", start, stop)
        scales = self._get(f"{prefix}{compressed_nvfp4.SCALE}", start, stop)
        divisor = self._get(f"{prefix}{compressed_nvfp4.GLOBAL_SCALE}", None, None)
        matrix = compressed_nvfp4.Nvfp4Matrix(
            codes.numpy(), scales.view(torch.uint8).numpy(), np.float32(divisor.reshape(-1)[0].item())
        )
        return compressed_nvfp4.check_matrix(prefix, matrix)

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
