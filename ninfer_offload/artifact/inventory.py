"""What an artifact holds, by component, role, layer and format: the planner's and `inspect`'s view.

Roles come from the binding names (docs/format.md §8.4), never from object IDs, so the official
directory, directories written by our converter and v1 files (through the reader's synthesised
bindings) classify alike. Every tensor object is counted exactly once: an object's component,
role and layer are those of the first binding that references it with a known role (a v1 parent
is also bound under its own name, which classifies as `other`).
"""

from __future__ import annotations

import re
from collections import defaultdict
from dataclasses import dataclass
from typing import Any, Iterable

from ninfer_offload.artifact.errors import ArtifactError
from ninfer_offload.artifact.formats import BLOCK_SCALE, CONTIGUOUS, GROUPED_FORMATS, NVFP4, NVFP4_TILE_ROWS, ROW_SPLIT, align_up
from ninfer_offload.artifact.records import DenseRecordLayout, ExpertRecordLayout

COMPONENTS = ("text", "mtp", "proposal", "vision", "dflash", "dflash2")
# Components this engine runs; the others are accounted for and left unused.
EXECUTED = ("text", "mtp")
UNBOUND = "unbound"

_LAYER = re.compile(r"^(?P<component>[a-z0-9_]+)/layers/(?P<layer>\d+)/(?P<rest>.+)$")
_EXPERT = re.compile(r"^moe/experts/(?P<expert>\d+)/(?P<part>gate|up|down)$")


@dataclass(frozen=True)
class TensorInfo:
    """One tensor object as the planner sees it."""

    id: str
    component: str
    role: str
    layer: int | None
    format: str
    layout: str
    shape: tuple[int, ...]
    bytes: int


@dataclass(frozen=True)
class ExpertBankInfo:
    """The routed experts of one layer: their parent objects and the size of one expert record."""

    component: str
    layer: int
    num_experts: int
    object_ids: tuple[str, ...]
    bank_bytes: int  # bytes of the parent objects, as stored
    expert_bytes: int  # bytes of one expert once repacked into a record (the unit that moves)


@dataclass(frozen=True)
class ResourceInfo:
    id: str
    bytes: int


def classify(name: str) -> tuple[str, str, int | None]:
    """(component, role, layer) of a logical parameter name such as `text/layers/3/attention/key`."""
    component = name.split("/", 1)[0]
    match = _LAYER.match(name)
    layer = int(match["layer"]) if match else None
    rest = match["rest"] if match else name.split("/", 1)[-1]
    leaf = rest.rsplit("/", 1)[-1]
    expert = _EXPERT.match(rest)
    if expert:
        role = "routed_down" if expert["part"] == "down" else "routed_gate_up"
    elif name == "text/token_embedding":
        role = "token_embedding"
    elif name == "text/output_head":
        role = "output_head"
    elif name == "proposal/head":
        role = "proposal_head"
    elif name == "proposal/token_ids":
        role = "proposal_token_ids"
    elif "norm" in leaf:
        role = "norm"
    elif rest.startswith("moe/shared/"):
        role = "shared_expert"
    elif rest in ("moe/router", "moe/shared_score"):
        role = "router"
    elif rest.startswith("attention/"):
        role = "attention"
    elif rest.startswith("gdn/"):
        role = "gdn"
    elif rest.startswith(("mlp/", "merger/")):
        role = "mlp"
    elif name in ("mtp/input_projection", "dflash/feature_projection"):
        role = "input_projection"
    elif component == "vision" and "embedding" in rest:
        role = "vision_embedding"
    else:
        role = "other"
    return component, role, layer


def _binding_objects(binding: Any) -> list[str]:
    """Object IDs a binding references, from a JSON dict or a reader `Binding`."""
    if isinstance(binding, dict):
        if "object" in binding:
            return [binding["object"]]
        return [part["object"] for part in binding["parts"]]
    return [part.object for part in binding.parts]


class Inventory:
    """Tensors, resources and routed-expert banks of one artifact directory."""

    def __init__(self, tensors: list[TensorInfo], resources: list[ResourceInfo], banks: list[ExpertBankInfo], configs: dict[str, dict]):
        self.tensors = tensors
        self.resources = resources
        self.banks = banks
        self.configs = configs
        self._by_id = {t.id: t for t in tensors}

    @classmethod
    def from_directory(cls, root: dict) -> "Inventory":
        """Build from a v3 JSON root (e.g. `official_directory()` or `Artifact.directory`)."""
        try:
            objects = [
                (o["id"], o["kind"], tuple(o.get("shape", ())), o.get("format", ""), o.get("layout", ""), o["bytes"])
                for o in root["objects"]
            ]
            configs = {name: dict(c.get("config", {})) for name, c in root["components"].items()}
            return cls._build(objects, root.get("bindings", {}), configs)
        except (KeyError, TypeError) as err:
            raise ArtifactError(f"directory is missing member {err}") from None

    @classmethod
    def from_artifact(cls, artifact: Any) -> "Inventory":
        """Build from an open `Artifact` (reads only its directory; v1 through synthesised bindings)."""
        objects = [(o.id, o.kind, tuple(o.shape or ()), o.format or "", o.layout or "", o.bytes) for o in artifact.objects]
        configs = {name: dict(c.config or {}) for name, c in artifact.components.items()}
        return cls._build(objects, artifact.bindings, configs)

    @classmethod
    def _build(cls, objects: list[tuple], bindings: dict[str, Any], configs: dict[str, dict]) -> "Inventory":
        label: dict[str, tuple[str, str, int | None]] = {}
        experts: dict[tuple[str, int], dict[str, Any]] = defaultdict(lambda: {"ids": [], "experts": set(), "names": {}})
        for name, binding in bindings.items():
            component, role, layer = classify(name)
            ids = _binding_objects(binding)
            for oid in ids:
                if oid not in label or (label[oid][1] == "other" and role != "other"):
                    label[oid] = (component, role, layer)
            if role in ("routed_gate_up", "routed_down") and layer is not None:
                bank = experts[(component, layer)]
                bank["experts"].add(int(name.split("/moe/experts/")[1].split("/")[0]))
                bank["names"].setdefault(name.rsplit("/", 1)[1], ids[0])
                bank["ids"] += [i for i in ids if i not in bank["ids"]]
        tensors, resources = [], []
        for oid, kind, shape, fmt, layout, nbytes in objects:
            if kind == "resource":
                resources.append(ResourceInfo(oid, nbytes))
                continue
            component, role, layer = label.get(oid, (UNBOUND, "other", None))
            tensors.append(TensorInfo(oid, component, role, layer, fmt, layout, shape, nbytes))
        by_id = {t.id: t for t in tensors}
        banks = [cls._bank(component, layer, data, by_id) for (component, layer), data in sorted(experts.items())]
        return cls(tensors, resources, banks, configs)

    @staticmethod
    def _bank(component: str, layer: int, data: dict[str, Any], by_id: dict[str, TensorInfo]) -> ExpertBankInfo:
        try:
            parents = [by_id[i] for i in data["ids"]]
        except KeyError as err:
            raise ArtifactError(f"binding of layer {layer} experts references unknown object {err}") from None
        count = len(data["experts"])
        bank_bytes = sum(p.bytes for p in parents)
        gate_up, down = by_id.get(data["names"].get("gate", "")), by_id.get(data["names"].get("down", ""))
        expert_bytes = align_up(-(-bank_bytes // count), 256)
        if gate_up and down and _record_ready(gate_up, down, count):
            expert_bytes = ExpertRecordLayout.create(gate_up.format, down.format, gate_up.shape[1], down.shape[1]).nbytes
        elif gate_up and down and _dense_record_ready(gate_up, down):
            expert_bytes = DenseRecordLayout(gate_up.format, gate_up.shape[1], down.shape[1]).nbytes
        return ExpertBankInfo(component, layer, count, tuple(data["ids"]), bank_bytes, expert_bytes)

    # -- queries -------------------------------------------------------------------------------
    def tensor(self, object_id: str) -> TensorInfo:
        return self._by_id[object_id]

    @property
    def total_bytes(self) -> int:
        """Sum of tensor object bytes."""
        return sum(t.bytes for t in self.tensors)

    @property
    def aligned_bytes(self) -> int:
        """Sum of tensor object bytes, each rounded up to the 256-byte tensor alignment."""
        return sum(align_up(t.bytes, 256) for t in self.tensors)

    @property
    def resource_bytes(self) -> int:
        return sum(r.bytes for r in self.resources)

    def bytes_by_format(self) -> dict[str, int]:
        return _sum_by(self.tensors, lambda t: t.format)

    def bytes_by_component(self) -> dict[str, int]:
        return _sum_by(self.tensors, lambda t: t.component)

    def bytes_by_role(self) -> dict[str, int]:
        return _sum_by(self.tensors, lambda t: t.role)

    def count_by_format(self) -> dict[str, int]:
        counts: dict[str, int] = defaultdict(int)
        for t in self.tensors:
            counts[t.format] += 1
        return dict(counts)

    def select(self, component: str | None = None, roles: Iterable[str] | None = None) -> list[TensorInfo]:
        """Tensors of one component (all if None) whose role is in `roles` (all if None)."""
        wanted = set(roles) if roles is not None else None
        return [t for t in self.tensors if (component is None or t.component == component) and (wanted is None or t.role in wanted)]

    def banks_of(self, component: str) -> list[ExpertBankInfo]:
        return [b for b in self.banks if b.component == component]

    @property
    def text_config(self) -> dict:
        if "text" not in self.configs:
            raise ArtifactError("artifact has no `text` component")
        return self.configs["text"]


def _quantized(t: TensorInfo, rows_per_expert: int) -> bool:
    """A row-split parent, or an nvfp4 one whose experts are whole 128-row scale tiles."""
    return (t.layout == ROW_SPLIT and t.format in GROUPED_FORMATS) or (
        t.layout == BLOCK_SCALE and t.format == NVFP4 and rows_per_expert % NVFP4_TILE_ROWS == 0
    )


def _record_ready(gate_up: TensorInfo, down: TensorInfo, count: int) -> bool:
    """True when both banks are quantized parents shaped to cut into ExpertRecordLayout records."""
    if len(gate_up.shape) != 2 or len(down.shape) != 2 or gate_up.shape[0] % count:
        return False
    return (
        _quantized(gate_up, gate_up.shape[0] // count)
        and _quantized(down, down.shape[0] // count)
        and down.shape[0] == count * gate_up.shape[1]
        and gate_up.shape[0] == count * 2 * down.shape[1]
    )


def _dense_record_ready(gate_up: TensorInfo, down: TensorInfo) -> bool:
    """True when both banks are contiguous words of one format that cut into DenseRecordLayout records."""
    return (
        all(t.layout == CONTIGUOUS and t.format in ("bf16", "fp32") and len(t.shape) == 2 for t in (gate_up, down))
        and gate_up.format == down.format
    )


def _sum_by(tensors: list[TensorInfo], key) -> dict[str, int]:
    totals: dict[str, int] = defaultdict(int)
    for t in tensors:
        totals[key(t)] += t.bytes
    return dict(totals)
