"""The one memory accounting: weights as loaded, KV cache, GDN state, prefill workspace, expert
staging slots (for streamed experts and for a prefill chunk's host experts).

All sizes follow from the text config and the plan or load options. The planner plans with these
functions, `Engine.load` checks free VRAM with `load_footprint` before it allocates, and the
runtime's buffers are sized by the same rules (tests compare them byte for byte).
"""

from __future__ import annotations

from dataclasses import dataclass

from ninfer_offload.artifact.dims import ModelDims
from ninfer_offload.artifact.formats import BLOCK_SCALE, NVFP4, ROW_SPLIT, elements, runtime_geometry
from ninfer_offload.artifact.inventory import Inventory
from ninfer_offload.planner.options import PREFILL_SPAN_CHUNKS, PROMPT_CACHE_VRAM, PROMPT_CACHE_VRAM_SHARE, PlanOptions

FP32, BF16, INT64 = 4, 2, 8
KV_ELEMENT_BYTES = {"fp32": 4, "bf16": 2, "fp8": 1, "int8": 1}
INT8_SCALE_BYTES = 2  # int8 KV keeps one fp16 scale per (token, KV head) for K and for V
ROUTED_ROLES = ("routed_gate_up", "routed_down")
PINNED_ALIGN = 256  # where pinned host tensors start (the MoE kernels read expert records at multiples of it)


def kv_layer_bytes_per_token(dims: ModelDims, kv_dtype: str) -> int:
    """K and V bytes of one token in one full-attention layer."""
    per_layer = 2 * dims.num_kv_heads * dims.head_dim * KV_ELEMENT_BYTES[kv_dtype]
    if kv_dtype == "int8":
        per_layer += 2 * dims.num_kv_heads * INT8_SCALE_BYTES
    return per_layer


def gdn_state_bytes(dims: ModelDims, element_bytes: int = BF16) -> int:
    """One sequence's GDN state: FP32 recurrent state [V heads, K dim, V dim] and the conv window of
    the previous W-1 inputs (in the compute dtype) of every linear-attention layer."""
    recurrent = dims.linear_num_value_heads * dims.linear_value_head_dim * dims.linear_key_head_dim * FP32
    conv = (dims.linear_conv_kernel - 1) * dims.conv_channels * element_bytes
    return dims.num_gdn_layers * (recurrent + conv)


# The scratch slot's KV rows (at least; the engine's state pool gets this): the most a captured step writes there
# per entry, a padding entry of a batched admission of `runtime.batched_prefill.BATCHED_PREFILL_TOKENS[-1]` tokens.
SCRATCH_KV_ROWS = 64


def state_pool_bytes(
    dims: ModelDims, sequences: int, capacity: int, draft_tokens: int, mtp_layer: bool, kv_dtype: str, element_bytes: int = BF16
) -> dict[str, int]:
    """KV cache and GDN state of the runtime's state pool (`model.state_pool.StatePool`).

    KV: per attention layer (and the MTP layer), `capacity` rows per sequence plus the scratch
    slot's rows (SCRATCH_KV_ROWS, or 1 + draft_tokens if more). GDN: one live state per sequence and for the scratch slot, each
    with one kept state per draft token (rollback of a verified step).
    """
    kv_rows = sequences * capacity + max(SCRATCH_KV_ROWS, 1 + draft_tokens)
    return {
        "kv_cache": (dims.num_attention_layers + mtp_layer) * kv_rows * kv_layer_bytes_per_token(dims, kv_dtype),
        "gdn_state": (sequences + 1) * (1 + draft_tokens) * gdn_state_bytes(dims, element_bytes),
    }


def prompt_cache_vram_bytes(requested: int | None, budget: int | None) -> int:
    """The prompt cache's device tier: `requested`, else PROMPT_CACHE_VRAM_SHARE of `budget` (the VRAM the load may use;
    None: unknown) and at most PROMPT_CACHE_VRAM."""
    if requested is not None:
        return requested
    return PROMPT_CACHE_VRAM if budget is None else min(PROMPT_CACHE_VRAM, int(budget * PROMPT_CACHE_VRAM_SHARE))


# The most bytes of partial softmaxes one decode-attention launch holds (`kernels.attention.DECODE_PARTIAL_BYTES`,
# the same number: its spans grow with the capacity to stay within it).
DECODE_PARTIAL_BYTES = 80 << 20


def workspace_bytes(dims: ModelDims, options: PlanOptions) -> int:
    """Prefill activations of one chunk plus the logits of one decode step (bf16 activations) and the
    decode attention's partial softmaxes.

    Per prefill token: residual, normed input, mixer output and MoE output (4 x hidden), the widest
    mixer projection (GDN q|k|v|z or attention q|gate|k|v), the routed experts' gate/up output and
    activation (2 x top_k x 2I) and the shared expert's, and the routed experts' weighted output
    rows before their per-token sum (fp32, top_k x hidden). Logits: fp32 for every sequence and
    every verified position.
    """
    gdn_width = 2 * dims.linear_key_size + 2 * dims.linear_value_size
    attention_width = 2 * dims.num_attention_heads * dims.head_dim + 2 * dims.num_kv_heads * dims.head_dim
    width = dims.moe_intermediate_size
    per_token = BF16 * (4 * dims.hidden_size + max(gdn_width, attention_width) + 2 * dims.top_k * 2 * width + 2 * width)
    per_token += FP32 * dims.top_k * dims.hidden_size
    logits = FP32 * dims.vocab_size * options.concurrency * (1 + options.draft_count)
    return options.prefill_chunk * per_token + logits + DECODE_PARTIAL_BYTES


# Slots of each of the two prefill staging buffers of an offloaded load (`runtime.prefill_staging`): a prefill
# chunk copies each host expert a layer is expected to use into a slot of one buffer, once, while the layer
# before computes on the other, instead of reading it over PCIe per block of tokens. A 4096-token chunk uses
# nearly all 256 experts of a layer; the measured 15 GiB H200 load held 6,226 of 10,240 experts in VRAM (156 per
# layer on average), so ~100 per layer are on the host, more in the layers the plan favours least. 128 slots
# per buffer (~460 MiB for both of 1.7-1.8 MiB records, 3% of that budget) hold them; where more are outside
# VRAM the likeliest are staged and the rest read over PCIe.
PREFILL_STAGING_SLOTS = 128


def prefill_span_chunks(prefill_chunk: int, max_context: int) -> int:
    """Chunks of an offloaded load's prefill forward: PREFILL_SPAN_CHUNKS, fewer where the context holds fewer."""
    return max(1, min(PREFILL_SPAN_CHUNKS, -(-max_context // prefill_chunk)))


def prefill_span_bytes(dims: ModelDims, options: PlanOptions) -> int:
    """What an offloaded load's prefill forward of several chunks (`prefill_span_chunks`) holds beyond one chunk's
    workspace (bf16): the other chunks' residual and layer output rows between layers, and the forward's final
    hidden states (each chunk's, then joined)."""
    chunks = prefill_span_chunks(options.prefill_chunk, options.max_context)
    rows = options.prefill_chunk * dims.hidden_size * BF16
    return 0 if chunks == 1 else (2 * (chunks - 1) + 2 * chunks) * rows


def prefill_staging_slots(num_experts: int) -> int:
    """Slots of an offloaded load's prefill staging: two buffers of `PREFILL_STAGING_SLOTS`, each at most one
    layer's experts."""
    return 2 * min(num_experts, PREFILL_STAGING_SLOTS)


def staging_slots(num_experts: int, top_k: int, tokens_per_step: int, requested: int | None = None) -> int:
    """Device slots for streamed experts: `requested` (at least top_k: one token's experts must fit),
    else two layers in flight (current + prefetch), each with every expert one step's tokens can pick."""
    if requested is not None:
        return max(top_k, requested)
    return 2 * min(num_experts, top_k * tokens_per_step)


def loaded_weight_bytes(inventory: Inventory, components: tuple[str, ...], element_bytes: int) -> int:
    """Device bytes of the non-routed weights of `components` as the loader keeps them: row-split
    objects in their stored bytes, nvfp4 objects with one divisor per row tile (`runtime_geometry`),
    FP32 objects (the GDN decay parameters) in FP32, INT32 objects (the proposal token ids) as int64
    indices, every other object (FP8-row ones decoded) in the compute dtype."""
    total = 0
    for t in inventory.tensors:
        if t.component not in components or t.role in ROUTED_ROLES:
            continue
        if t.layout == ROW_SPLIT:
            total += t.bytes
        elif t.layout == BLOCK_SCALE:
            total += runtime_geometry(NVFP4, *t.shape).encoded_size
        else:
            total += elements(t.shape) * {"fp32": FP32, "int32": INT64}.get(t.format, element_bytes)
    return total


@dataclass(frozen=True)
class LoadOptions:
    """What `Engine.load` puts on the device, in the planner's terms."""

    pinned_experts: tuple[int, ...]  # experts kept in VRAM per MoE layer (text layers, then the MTP layer)
    cache_slots: int  # uniform expert-cache slots
    staging_slots: int  # prefill staging slots (`prefill_staging_slots` when experts are offloaded, else 0)
    sequences: int
    capacity: int
    draft_tokens: int
    mtp: bool
    element_bytes: int  # compute dtype
    kv_dtype: str  # a KV_ELEMENT_BYTES key
    proposal_head: bool = False  # the proposal head is loaded (it drafts instead of the output head)
    prompt_cache_bytes: int = 0  # the prompt cache's device tier


def expert_arena_bytes(expert_bytes: list[int], pinned_experts: tuple[int, ...], cache_slots: int, staging_slots: int) -> int:
    """VRAM of the expert arena: each layer's pinned records, then the cache slots and the prefill staging
    slots, as wide as the widest record."""
    slots = cache_slots + staging_slots
    return sum(n * b for n, b in zip(pinned_experts, expert_bytes)) + slots * max(expert_bytes, default=0)


def load_footprint(inventory: Inventory, options: LoadOptions) -> dict[str, int]:
    """Device bytes of a load, by item (weights, experts, kv_cache, gdn_state, and prompt_cache where it has one):
    the accounting the loader allocates against and the load-time VRAM check refuses by."""
    dims = ModelDims.from_text_config(inventory.text_config)
    components = ("text", "mtp") if options.mtp else ("text",)
    banks = [bank for c in components for bank in inventory.banks_of(c)]
    loaded = components + (("proposal",) if options.proposal_head else ())
    return {
        "weights": loaded_weight_bytes(inventory, loaded, options.element_bytes),
        "experts": expert_arena_bytes(
            [bank.expert_bytes for bank in banks], options.pinned_experts, options.cache_slots, options.staging_slots
        ),
        **state_pool_bytes(
            dims, options.sequences, options.capacity, options.draft_tokens, options.mtp, options.kv_dtype, options.element_bytes
        ),
        **({"prompt_cache": options.prompt_cache_bytes} if options.prompt_cache_bytes else {}),
    }


def chunk_layers(sizes: list[int]) -> list[tuple[int, range]]:
    """(locked bytes, layers) of each chunk for layer pools of `sizes` bytes (multiples of PINNED_ALIGN), in
    layer order: the split into runs of consecutive layers, each in the power of two that holds it and its
    alignment slack, that locks the fewest bytes (of those, the one with the smallest first chunks)."""
    n = len(sizes)
    best: list[tuple[int, list[tuple[int, range]]]] = [(0, [])] * (n + 1)  # from layer i on: (bytes, its chunks)
    for start in range(n - 1, -1, -1):
        options = []
        for end in range(start + 1, n + 1):
            size = 1 << (sum(sizes[start:end]) + PINNED_ALIGN - 1).bit_length()
            total, rest = best[end]
            options.append((size + total, [size, *(s for s, _ in rest)], [(size, range(start, end)), *rest]))
        total, _, chunks = min(options, key=lambda option: option[:2])
        best[start] = (total, chunks)
    return best[0][1]


def pool_bytes(sizes: list[int], pinned: bool) -> int:
    """RAM a pool of layers of `sizes` bytes takes: its chunks when `pinned`, else the records."""
    return sum(size for size, _ in chunk_layers(sizes)) if pinned else sum(sizes)
