"""Build the text model (and optionally the MTP module and the proposal head) and the expert store from an artifact.

Routed experts are repacked per expert into one record each (`ExpertRecordLayout` for row-split
and nvfp4 banks, `DenseRecordLayout` for lossless ones), straight into the store's host pool (pinned on
CUDA) when experts are offloaded, else into a temporary buffer; the store copies the pinned ones
into its VRAM arena.
"""

from __future__ import annotations

import time
from collections import deque
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

import psutil
import torch
from rich.console import Console
from rich.progress import track

from ninfer_offload.artifact.dims import ModelDims
from ninfer_offload.artifact.errors import ArtifactError
from ninfer_offload.artifact.formats import BLOCK_SCALE, CONTIGUOUS, ROW_SPLIT
from ninfer_offload.artifact.records import DenseRecordLayout, ExpertRecordLayout, RecordLayout
from ninfer_offload.artifact.verify import require_valid
from ninfer_offload.model.attention import Rotary
from ninfer_offload.model.proposal import ProposalHead
from ninfer_offload.model.text_model import MTP_PREFIX, DecoderLayer, MtpModule, TextModel
from ninfer_offload.model.weights import WeightReader
from ninfer_offload.runtime.expert_cache import DEFAULT_POLICY
from ninfer_offload.runtime.expert_store import ExpertPlacement, ExpertStore
from ninfer_offload.runtime.memory_check import register_pinned_allocations


PACK_THREADS = 4  # layers packed at once


@dataclass
class LoadedModel:
    config: ModelDims
    text: TextModel
    mtp: MtpModule | None
    store: ExpertStore
    proposal: ProposalHead | None = None
    # Wall seconds of the load's phases: "store" (the VRAM arena), "experts" (reading, packing and placing the
    # routed experts, and meanwhile each decoder layer's other weights), "pinning" (the page-locking of host buffers,
    # summed over the packing threads), "layer_weights" (the decoder layers' other weights, within "experts"),
    # "weights" (everything else: embedding, head, MTP module, proposal head)
    load_seconds: dict[str, float] = field(default_factory=dict)


def _record_layout(artifact, prefix: str, config: ModelDims) -> tuple[RecordLayout, str, str]:
    """The record layout of the routed experts under `prefix`, and the ids of their two bank objects.

    Requires the fused bank arrangement of docs/format.md §8.5: expert e's gate rows [2Ie, 2Ie+I) and up
    rows [2Ie+I, 2I(e+1)) of one gate/up bank, its down rows [He, H(e+1)) of one down bank. An nvfp4 bank
    must hold whole 128-row scale tiles per expert and valid scales and divisors.
    """
    e_count, inter, hidden = config.num_experts, config.moe_intermediate_size, config.hidden_size
    gate_up_id, _, _ = artifact.rows(f"{prefix}/moe/experts/0/gate")
    down_id, _, _ = artifact.rows(f"{prefix}/moe/experts/0/down")
    for e in range(e_count):
        expected = {
            "gate": (gate_up_id, 2 * inter * e, 2 * inter * e + inter),
            "up": (gate_up_id, 2 * inter * e + inter, 2 * inter * (e + 1)),
            "down": (down_id, hidden * e, hidden * (e + 1)),
        }
        for part, rows in expected.items():
            if artifact.rows(f"{prefix}/moe/experts/{e}/{part}") != rows:
                raise ArtifactError(
                    f"{prefix}/moe/experts/{e}/{part} is not bound to rows {list(rows[1:])} of a fused expert bank"
                )
    gate_up, down = artifact.object(gate_up_id), artifact.object(down_id)
    if gate_up.shape != (e_count * 2 * inter, hidden) or down.shape != (e_count * hidden, inter):
        raise ArtifactError(
            f"{prefix} expert banks have shapes {list(gate_up.shape)} and {list(down.shape)}, expected "
            f"{[e_count * 2 * inter, hidden]} and {[e_count * hidden, inter]}"
        )
    quantized = (ROW_SPLIT, BLOCK_SCALE)
    if gate_up.layout in quantized and down.layout in quantized:
        for part, bank in (("gate/up", gate_up), ("down", down)):
            if bank.layout == BLOCK_SCALE:
                require_valid(artifact, bank, f"{prefix} routed {part} bank")
        try:
            return ExpertRecordLayout.create(gate_up.format, down.format, hidden, inter), gate_up_id, down_id
        except ArtifactError as err:
            raise ArtifactError(f"{prefix} routed experts: {err}") from None
    if gate_up.layout == CONTIGUOUS and down.layout == CONTIGUOUS and gate_up.format == down.format != "int32":
        return DenseRecordLayout(gate_up.format, hidden, inter), gate_up_id, down_id
    raise ArtifactError(f"{prefix} expert banks are {gate_up.format}/{down.format}: unsupported for routed experts")


def load_model(
    artifact,
    config: ModelDims,
    device: torch.device,
    dtype: torch.dtype,
    placement: ExpertPlacement,
    miss_path: str | None = None,
    cache_policy: str = DEFAULT_POLICY,
    with_mtp: bool = False,
    progress: bool = False,
    with_proposal: bool = False,
) -> LoadedModel:
    """Read every weight the text model of `config` (and the MTP module if `with_mtp`, the proposal
    head if `with_proposal`) needs onto `device`, the routed experts where `placement` puts them."""
    if with_mtp and "mtp/input_projection" not in artifact.bindings:
        raise ArtifactError(
            f"{artifact.path.name} has no MTP weights: use --spec none (or convert the checkpoint with its mtp.* tensors)"
        )
    prefixes = [f"text/layers/{i}" for i in range(config.num_layers)] + ([MTP_PREFIX] if with_mtp else [])
    banks = [_record_layout(artifact, prefix, config) for prefix in prefixes]
    layouts = [layout for layout, _, _ in banks]
    if device.type == "cuda":
        register_pinned_allocations()  # before the store's and the packing threads' pinned buffers
    console = Console(stderr=True) if progress else None
    if console is not None and miss_path is not None:
        compiling = "compiling the CPU expert kernels (numba: about 25 s the first time, then read from its cache)"
        console.print(compiling, highlight=False, soft_wrap=True)
    began = time.perf_counter()
    store = ExpertStore(
        layouts, config.hidden_size, config.num_experts, config.top_k, placement, device, miss_path, cache_policy,
        text_layers=config.num_layers,
    )
    seconds, pinning = {"store": time.perf_counter() - began}, []
    began = time.perf_counter()
    if artifact.payload_bytes + (store.nbytes if store.offloaded else 0) < psutil.virtual_memory().available:
        artifact.prefetch()  # read ahead of the packing threads, when the page cache can hold the file next to the host pool
    steps = range(len(prefixes))
    if console is not None and console.is_terminal:  # a bar where it can redraw itself, not a line in a log
        steps = track(steps, description="loading experts", transient=True, console=console)
    # Payload views are taken here (opening the files is not thread-safe); packing runs in threads
    # (numpy copies release the GIL), at most PACK_THREADS layers at a time to bound host memory.
    payloads = [(artifact.payload(gate_up_id), artifact.payload(down_id)) for _, gate_up_id, down_id in banks]

    def pack(i: int) -> torch.Tensor:
        allocating = time.perf_counter()
        records = store.host_buffer(i)
        pinning.append(time.perf_counter() - allocating)
        banks[i][0].pack_all(*payloads[i], config.num_experts, records.numpy())
        return records

    reader = WeightReader(artifact, device, dtype)
    rotary = Rotary(config.rotary_dim, config.rope_theta, device)
    layers, layer_seconds = [], 0.0
    with ThreadPoolExecutor(PACK_THREADS) as pool:
        pending = deque(pool.submit(pack, i) for i in range(min(PACK_THREADS, len(prefixes))))
        for i in steps:
            records = pending.popleft().result()  # popped: a buffer the store does not keep is freed after its copy
            if i + PACK_THREADS < len(prefixes):
                pending.append(pool.submit(pack, i + PACK_THREADS))
            store.fill(i, records)
            del records
            if i < config.num_layers:  # while the threads pack the next layers' experts (the MTP layer loads with its module)
                loading = time.perf_counter()
                layers.append(DecoderLayer.load(reader, prefixes[i], i, config.layer_types[i], config, rotary, store))
                layer_seconds += time.perf_counter() - loading
    if store.cache is not None:
        store.cache.fill_initial()
    seconds["experts"], seconds["pinning"], seconds["layer_weights"] = time.perf_counter() - began, sum(pinning), layer_seconds
    began = time.perf_counter()
    h, v = config.hidden_size, config.vocab_size
    text = TextModel(
        config,
        embedding=reader.matrix("text/token_embedding", (v, h)),
        layers=layers,
        final_norm=reader.dense("text/final_norm", (h,)),
        head=reader.matrix("text/output_head", (v, h)),
        dtype=dtype,
    )
    mtp = MtpModule.load(reader, config.num_layers, config, rotary, store) if with_mtp else None
    proposal = ProposalHead.load(reader, artifact.components["text"].proposal, h, v) if with_proposal else None
    seconds["weights"] = time.perf_counter() - began
    return LoadedModel(config, text, mtp, store, proposal, seconds)
