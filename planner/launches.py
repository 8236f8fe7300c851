"""The launch table of one decode forward: which kernels a step of T tokens for each of B sequences at
context L launches, how many of each, and the bytes and flops each one moves.

The table mirrors the engine's captured step (`ninfer_offload/model/*.py` with `kernels/backend.py`):

* every Gated DeltaNet layer: one product for q|k|v|z and the a/b gates (`both`), the short convolution
  (in that product's epilogue for one token of one sequence, else `_conv_update_kernel`), the recurrence,
  and the gated norm + output product (one launch on the matrix-vector path, the norm apart past it);
* every attention layer: the q|k|v|gate product, `attention_inputs` (norms, rotary, KV write), the
  split-KV decode and its merge, the gated output product (past the matrix-vector path the gate is two
  torch kernels and the product tiled);
* every MoE layer: the router + shared-expert gate/up product, the softmax top-k, the routed gate/up
  (SwiGLU) and the routed down with the shared expert's down in the same launch;
* the layer norms: computed inside the next product for one token (`_fusable`); a multi-token step of
  one sequence folds the mixer's and launches the MoE input's; a batch launches both;
* the output head, the final norm and the step's own small torch kernels (embedding gather, positions,
  sampling inputs: counted from the recorded tables, `STEP_ELEMENTWISE`).

The regime thresholds are the kernels' (`kernels/quant_linear.py`, checked equal by the tests). Routed
experts read the expected distinct experts of the step (`touched_experts`, from the routing statistics).
`tests/test_launches.py` checks the counts per family against recorded profiles.
"""

from __future__ import annotations

from dataclasses import dataclass

from ninfer_offload.artifact.dims import ModelDims
from ninfer_offload.artifact.inventory import Inventory

FAMILIES = (
    "dense_product",  # quantized matrix-vector / tiled products, the output head included
    "routed_gate_up",
    "routed_down",
    "gdn_recurrence",
    "gdn_conv",
    "attention",  # attention inputs, split-KV decode, merge
    "router_topk",
    "norm",
    "elementwise",  # torch's small kernels: embedding gather, gates, positions, sampling inputs
)
# kernels/quant_linear.py: the matrix-vector kernel takes up to GEMV_MAX_TOKENS rows of a product of at least
# MMA_MIN_ROWS rows and up to SMALL_GEMV_MAX_TOKENS rows of a smaller one.
GEMV_MAX_TOKENS = 8
SMALL_GEMV_MAX_TOKENS = 4
MMA_MIN_ROWS = 8192
# The step's own torch kernels besides the layers' (embedding gather, positions, logits inputs), as the recorded
# tables count them: one token, several tokens of one sequence, several sequences.
STEP_ELEMENTWISE = {"one": 10, "tokens": 12, "batch": 9}
BF16 = 2
FP32 = 4


@dataclass(frozen=True)
class Launch:
    """`count` launches of one kernel family per forward, each reading and writing `bytes`, doing `flops` on tensor
    cores and `core_flops` on CUDA cores (the matrix-vector kernels' multiply-adds, which grow with every token)."""

    family: str
    count: int
    bytes: float
    flops: float = 0.0
    core_flops: float = 0.0


@dataclass(frozen=True)
class ForwardWeights:
    """Per-layer weight bytes and output rows of the products a forward launches, from the artifact's inventory."""

    mixer_in: tuple[tuple[float, int], ...]  # (bytes, rows) of each layer's input product (GDN: q|k|v|z + gates)
    mixer_out: tuple[float, ...]  # bytes of each layer's output product
    moe_in: tuple[tuple[float, int], ...]  # router + shared score + shared gate/up
    shared_down: tuple[float, ...]
    expert_gate_up: tuple[float, ...]  # one routed expert's gate/up bytes, per layer
    expert_down: tuple[float, ...]
    head: float
    head_rows: int

    @classmethod
    def of(cls, inventory: Inventory) -> "ForwardWeights":
        """The text component's products, summed per layer and role."""
        dims = ModelDims.from_text_config(inventory.text_config)
        h = dims.hidden_size
        layers = range(dims.num_layers)
        by: dict[tuple, list] = {}
        for t in inventory.tensors:  # the products: matrices reading the hidden state ("in") or writing it ("out")
            if t.component == "text" and len(t.shape) == 2 and h in t.shape:
                by.setdefault((t.layer, t.role, "in" if t.shape[1] == h else "out"), []).append(t)
        mixer = ["attention" if dims.is_attention(i) else "gdn" for i in layers]

        def product(layer: int, roles: tuple[str, ...], side: str) -> tuple[float, int]:
            tensors = [t for role in roles for t in by.get((layer, role, side), [])]
            return float(sum(t.bytes for t in tensors)), sum(t.shape[0] for t in tensors)

        banks = inventory.banks_of("text")
        tensors = {t.id: t for t in inventory.tensors}

        def expert_share(bank, role: str) -> float:
            """One expert's bytes of the bank's `role` objects."""
            return sum(tensors[i].bytes for i in bank.object_ids if tensors[i].role == role) / bank.num_experts

        text = [t for t in inventory.tensors if t.component == "text"]
        head = next((t for t in text if t.role == "output_head"), None) or next(t for t in text if t.role == "token_embedding")
        return cls(
            mixer_in=tuple(product(i, (mixer[i],), "in") for i in layers),
            mixer_out=tuple(product(i, (mixer[i],), "out")[0] for i in layers),
            moe_in=tuple(product(i, ("router", "shared_expert"), "in") for i in layers),
            shared_down=tuple(product(i, ("shared_expert",), "out")[0] for i in layers),
            expert_gate_up=tuple(expert_share(b, "routed_gate_up") for b in banks),
            expert_down=tuple(expert_share(b, "routed_down") for b in banks),
            head=float(head.bytes),
            head_rows=head.shape[0],
        )


def expected_touched(hits: float, tokens: int) -> float:
    """Expected times an expert with `hits` expected picks per token is needed by a step of `tokens`
    tokens that route independently (each needed expert moves once per step)."""
    q = min(hits, 1.0)
    return 1.0 - (1.0 - q) ** tokens


def touched_experts(hits: tuple[tuple[float, ...], ...], tokens: int) -> list[float]:
    """Expected distinct routed experts per layer that a step of `tokens` independently routed tokens reads."""
    return [sum(expected_touched(q, tokens) for q in row) for row in hits]


def on_matrix_vector(rows: int, tokens: int) -> bool:
    """Whether `tokens` rows of an n-row product take the matrix-vector kernel (else the tiled one)."""
    return tokens <= GEMV_MAX_TOKENS and (tokens <= SMALL_GEMV_MAX_TOKENS or rows >= MMA_MIN_ROWS)


def on_cuda_cores(rows: int, tokens: int) -> bool:
    """Whether the product's multiply-adds run on CUDA cores: the matrix-vector kernel but for several tokens of a
    product of at least MMA_MIN_ROWS rows (`quant_linear.on_tensor_cores`)."""
    return on_matrix_vector(rows, tokens) and (tokens == 1 or rows < MMA_MIN_ROWS)


def forward_launches(
    dims: ModelDims, weights: ForwardWeights, tokens: int, sequences: int, context: int, touched_experts: list[float],
    kv_bytes_per_token: int,
) -> list[Launch]:
    """The launches of one forward over `tokens` positions of each of `sequences` sequences at `context` tokens
    of KV each; `touched_experts[layer]`: the expected distinct routed experts the step reads there."""
    rows = tokens * sequences
    h = dims.hidden_size
    one, single = rows == 1, sequences == 1
    regime = "one" if one else ("tokens" if single else "batch")
    act = rows * h * BF16  # one activation matrix
    state = dims.linear_num_value_heads * dims.linear_key_head_dim * dims.linear_value_head_dim * FP32
    window = (dims.linear_conv_kernel - 1) * dims.conv_channels * BF16
    out: list[Launch] = []

    def product(weight_bytes: float, weight_rows: int, columns: int) -> None:
        flops = 2.0 * rows * weight_rows * columns
        cores = on_cuda_cores(weight_rows, rows)
        out.append(Launch("dense_product", 1, weight_bytes + act, 0.0 if cores else flops, flops if cores else 0.0))

    for layer in range(dims.num_layers):
        in_bytes, in_rows = weights.mixer_in[layer]
        product(in_bytes, in_rows, h)
        gemv_out = on_matrix_vector(h, rows)
        if dims.is_attention(layer):
            kv = sequences * context * kv_bytes_per_token
            out.append(Launch("attention", 1, act + sequences * tokens * kv_bytes_per_token, 0.0))  # inputs, KV write
            out.append(Launch("attention", 1, kv, flops=4.0 * rows * context * dims.num_attention_heads * dims.head_dim))
            out.append(Launch("attention", 1, act, 0.0))  # merge of the split-KV partials
            if not gemv_out:  # sigmoid(gate) and its product before the tiled output product
                out += [Launch("elementwise", 1, 2 * act, 0.0)] * 2
        else:
            if not one:
                out.append(Launch("gdn_conv", 1, 2 * sequences * window + rows * dims.conv_channels * BF16 * 2, 0.0))
            # read each sequence's state, write it back, and keep the state of every position of a multi-token step
            out.append(Launch("gdn_recurrence", 1, sequences * state * (1 + tokens), core_flops=4.0 * rows * state / FP32))
            if not gemv_out:
                out.append(Launch("norm", 1, 3 * act, 0.0))
        mixed = dims.num_attention_heads * dims.head_dim if dims.is_attention(layer) else dims.linear_value_size
        product(weights.mixer_out[layer], h, mixed)
        moe_bytes, moe_rows = weights.moe_in[layer]
        product(moe_bytes, moe_rows, h)
        out.append(Launch("router_topk", 1, rows * dims.num_experts * FP32, 0.0))
        touched = touched_experts[layer]
        expert_flops = 2.0 * rows * dims.top_k * h * dims.moe_intermediate_size  # one of gate, up, down
        gate_up_bytes = touched * weights.expert_gate_up[layer] + act
        down_bytes = touched * weights.expert_down[layer] + weights.shared_down[layer] + act
        out.append(Launch("routed_gate_up", 1, gate_up_bytes, core_flops=2 * expert_flops))
        out.append(Launch("routed_down", 1, down_bytes, core_flops=expert_flops))
        separate_norms = 0 if one else (1 if single and rows <= GEMV_MAX_TOKENS else 2)
        out += [Launch("norm", 1, 3 * act, 0.0)] * separate_norms
    head_flops = 2.0 * rows * weights.head_rows * h
    head_on_cores = on_cuda_cores(weights.head_rows, rows)
    out.append(Launch("dense_product", 1, weights.head + act, 0.0 if head_on_cores else head_flops, head_flops if head_on_cores else 0.0))
    out += [Launch("norm", 1, 3 * act, 0.0)] * (2 if one else 1)  # final norm (and the last residual add)
    out += [Launch("elementwise", 1, act, 0.0)] * STEP_ELEMENTWISE[regime]
    return out


def counts(launches: list[Launch]) -> dict[str, int]:
    """Launches per family."""
    result = dict.fromkeys(FAMILIES, 0)
    for launch in launches:
        result[launch.family] += launch.count
    return result
