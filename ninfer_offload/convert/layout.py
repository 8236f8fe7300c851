"""The artifact layout of a Qwen3.5/3.6-MoE checkpoint: parents, their sources, bindings and uses.

A `Parent` is one physical object. Its rows (elements for rank 1) are the concatenation of its
`sources` (checkpoint tensors after a §9 transform) and are cut into `members`, each the logical
parameter of one binding with its Use inputs (docs/format.md §8.4-8.5). The plan is a pure function of
the model dims, the recipe and which tensor names exist (fused or per-expert experts, prefixes),
so it can be built, and checked against the official directory, without reading any weight.
Parents come in converter order (§8.6): every multi-member group first, then every single.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from math import prod

from ninfer_offload.artifact.dims import ModelDims
from ninfer_offload.convert.hf_config import ModelSpec, VisionDims
from ninfer_offload.convert.recipes import BF16, FP32, NVFP4, role_format

# Source transforms (docs/format.md §9).
NONE = "none"
QUERY_HALF = "query_half"  # per-head rows [0, d) of q_proj's [query | gate] head blocks
GATE_HALF = "gate_half"  # per-head rows [d, 2d)
TAPS_MAJOR = "taps_major"  # conv1d [C, 1, W] -> [W, C]
FLATTEN = "flatten"  # C-order reshape to [shape[0] * ..., last] (fused banks) or [N, rest] (patch)

# Sources that are not checkpoint tensors: the proposal head's gathered output-head rows and its
# token ids, read through `convert.proposal.ProposalReader`.
PROPOSAL_HEAD, PROPOSAL_IDS = "proposal:head", "proposal:token_ids"


@dataclass(frozen=True)
class Source:
    """Rows of a parent taken from one checkpoint tensor of shape `shape` after `transform`."""

    tensor: str
    shape: tuple[int, ...]
    transform: str = NONE
    heads: int = 0  # QUERY_HALF / GATE_HALF only
    rows: int = 0  # rows (rank 2) or elements (rank 1) contributed to the parent

    @property
    def virtual(self) -> bool:
        """Made by the converter (the proposal's), not read from the checkpoint."""
        return self.tensor in (PROPOSAL_HEAD, PROPOSAL_IDS)


@dataclass(frozen=True)
class Member:
    """One binding over rows [begin, begin + rows) of its parent."""

    binding: str
    rows: int
    inputs: tuple[str, ...] = ()


@dataclass(frozen=True)
class Parent:
    """One physical object: its logical shape, storage format, row sources and bindings."""

    shape: tuple[int, ...]
    format: str
    sources: list[Source]
    members: list[Member]

    @property
    def row_elements(self) -> int:
        """Elements per row (1 for rank 1): binding ranges are rows times this."""
        return prod(self.shape[1:])

    @property
    def divisors(self) -> int:
        """FP32 divisors of an nvfp4 parent: one per member, each member its own matrix (docs/format.md §7.1); else 1."""
        return len(self.members) if self.format == NVFP4 else 1

    def nvfp4_problem(self) -> str | None:
        """Why this nvfp4 parent cannot be stored (members must be equal runs of whole 128-row tiles, K % 64 == 0), or None."""
        rows = {m.rows for m in self.members}
        k = self.shape[-1]
        if len(self.shape) != 2 or len(rows) != 1 or min(rows) % 128 or k % 64:
            return f"nvfp4 needs matrices of a multiple of 128 rows and of 64 columns, got {sorted(rows)} rows x {k} columns"
        return None


def _source(tensor: str, shape: tuple[int, ...], transform: str = NONE, heads: int = 0) -> Source:
    if transform in (QUERY_HALF, GATE_HALF):
        rows = shape[0] // 2
    elif transform == TAPS_MAJOR:
        rows = shape[2]
    elif transform == FLATTEN:
        rows = prod(shape[:-1]) if len(shape) == 3 else shape[0]
    else:
        rows = shape[0]
    return Source(tensor, tuple(shape), transform, heads, rows)


def _parent(fmt: str, sources: list[Source], members: list[Member]) -> Parent:
    first = sources[0]
    if first.transform == TAPS_MAJOR:
        tail: tuple[int, ...] = (first.shape[0],)
    elif first.transform == FLATTEN:
        tail = (first.shape[-1],) if len(first.shape) == 3 else (prod(first.shape[1:]),)
    else:
        tail = first.shape[1:]
    rows = sum(s.rows for s in sources)
    assert rows == sum(m.rows for m in members), (sources, members)
    return Parent((rows, *tail), fmt, sources, members)


def _single(fmt: str, source: Source, binding: str, *inputs: str) -> Parent:
    return _parent(fmt, [source], [Member(binding, source.rows, inputs)])


class LayoutBuilder:
    """Collects the multi-member groups and the singles of one model, each in declaration order."""

    def __init__(self, spec: ModelSpec, recipe: str, has: Callable[[str], bool], text_prefix: str, with_mtp: bool):
        self.spec, self.recipe, self.has, self.tp, self.with_mtp = spec, recipe, has, text_prefix, with_mtp
        self.groups: list[Parent] = []
        self.singles: list[Parent] = []

    def fmt(self, role: str, layer: int | None = None) -> str:
        return role_format(self.recipe, role, layer, self.spec.text.num_layers)

    # ---------------------------------------------------------------- text blocks

    def attention(self, p: str, name: str, d: ModelDims) -> None:
        """Gated attention of layer prefix `p` (HF) / `name` (binding)."""
        mix = f"{name}/mixer_input"
        q_rows, kv_rows = d.num_attention_heads * d.head_dim, d.num_kv_heads * d.head_dim
        q_proj = (2 * q_rows, d.hidden_size)
        fmt = self.fmt("projection")
        self.groups.append(
            _parent(
                fmt,
                [
                    _source(f"{p}self_attn.q_proj.weight", q_proj, QUERY_HALF, d.num_attention_heads),
                    _source(f"{p}self_attn.k_proj.weight", (kv_rows, d.hidden_size)),
                    _source(f"{p}self_attn.q_proj.weight", q_proj, GATE_HALF, d.num_attention_heads),
                    _source(f"{p}self_attn.v_proj.weight", (kv_rows, d.hidden_size)),
                ],
                [
                    Member(f"{name}/attention/query", q_rows, (mix,)),
                    Member(f"{name}/attention/key", kv_rows, (mix,)),
                    Member(f"{name}/attention/gate", q_rows, (mix,)),
                    Member(f"{name}/attention/value", kv_rows, (mix,)),
                ],
            )
        )
        self.singles += [
            _single(BF16, _source(f"{p}input_layernorm.weight", (d.hidden_size,)), f"{name}/input_norm"),
            _single(BF16, _source(f"{p}self_attn.q_norm.weight", (d.head_dim,)), f"{name}/attention/query_norm"),
            _single(BF16, _source(f"{p}self_attn.k_norm.weight", (d.head_dim,)), f"{name}/attention/key_norm"),
            _single(
                fmt, _source(f"{p}self_attn.o_proj.weight", (d.hidden_size, q_rows)), f"{name}/attention/output",
                f"{name}/attention/gated_output",
            ),
            _single(BF16, _source(f"{p}post_attention_layernorm.weight", (d.hidden_size,)), f"{name}/post_attention_norm"),
        ]

    def gdn(self, p: str, name: str, d: ModelDims) -> None:
        """Gated DeltaNet of layer prefix `p` / binding prefix `name`."""
        mix = f"{name}/mixer_input"
        k, v = d.linear_key_size, d.linear_value_size
        conv = d.conv_channels
        fmt = self.fmt("projection")
        self.groups.append(
            _parent(
                fmt,
                [
                    _source(f"{p}linear_attn.in_proj_qkv.weight", (conv, d.hidden_size)),
                    _source(f"{p}linear_attn.in_proj_z.weight", (v, d.hidden_size)),
                ],
                [
                    Member(f"{name}/gdn/query", k, (mix,)),
                    Member(f"{name}/gdn/key", k, (mix,)),
                    Member(f"{name}/gdn/value", v, (mix,)),
                    Member(f"{name}/gdn/z", v, (mix,)),
                ],
            )
        )
        nv = d.linear_num_value_heads
        self.groups.append(
            _parent(
                self.fmt("control"),
                [
                    _source(f"{p}linear_attn.in_proj_a.weight", (nv, d.hidden_size)),
                    _source(f"{p}linear_attn.in_proj_b.weight", (nv, d.hidden_size)),
                ],
                [Member(f"{name}/gdn/a_projection", nv, (mix,)), Member(f"{name}/gdn/b_projection", nv, (mix,))],
            )
        )
        self.singles += [
            _single(BF16, _source(f"{p}input_layernorm.weight", (d.hidden_size,)), f"{name}/input_norm"),
            _single(FP32, _source(f"{p}linear_attn.A_log", (nv,)), f"{name}/gdn/a_log"),
            _single(FP32, _source(f"{p}linear_attn.dt_bias", (nv,)), f"{name}/gdn/dt_bias"),
            _single(BF16, _source(f"{p}linear_attn.conv1d.weight", (conv, 1, d.linear_conv_kernel), TAPS_MAJOR), f"{name}/gdn/convolution"),
            _single(BF16, _source(f"{p}linear_attn.norm.weight", (d.linear_value_head_dim,)), f"{name}/gdn/norm"),
            _single(fmt, _source(f"{p}linear_attn.out_proj.weight", (d.hidden_size, v)), f"{name}/gdn/output", f"{name}/gdn/gated_output"),
            _single(BF16, _source(f"{p}post_attention_layernorm.weight", (d.hidden_size,)), f"{name}/post_attention_norm"),
        ]

    def moe(self, p: str, name: str, d: ModelDims, gate_up_fmt: str, down_fmt: str, shared_fmt: str) -> None:
        """Router + shared score, routed banks, shared expert of layer prefix `p` / binding prefix `name`."""
        ffn = f"{name}/ffn_input"
        e_count, h, i, s = d.num_experts, d.hidden_size, d.moe_intermediate_size, d.shared_intermediate_size
        self.groups.append(
            _parent(
                self.fmt("control"),
                [_source(f"{p}mlp.gate.weight", (e_count, h)), _source(f"{p}mlp.shared_expert_gate.weight", (1, h))],
                [Member(f"{name}/moe/router", e_count, (ffn,)), Member(f"{name}/moe/shared_score", 1, (ffn,))],
            )
        )
        gate_up_members, down_members = [], []
        for e in range(e_count):
            ex = f"{name}/moe/experts/{e}"
            gate_up_members += [Member(f"{ex}/gate", i, (ffn,)), Member(f"{ex}/up", i, (ffn,))]
            down_members.append(Member(f"{ex}/down", h, (f"{ex}/product",)))
        experts = f"{p}mlp.experts."
        if self.has(f"{experts}gate_up_proj") or self.has(f"{experts}down_proj"):  # fused banks
            gate_up_sources = [_source(f"{experts}gate_up_proj", (e_count, 2 * i, h), FLATTEN)]
            down_sources = [_source(f"{experts}down_proj", (e_count, h, i), FLATTEN)]
        else:
            gate_up_sources = [
                _source(f"{experts}{e}.{kind}_proj.weight", (i, h)) for e in range(e_count) for kind in ("gate", "up")
            ]
            down_sources = [_source(f"{experts}{e}.down_proj.weight", (h, i)) for e in range(e_count)]
        self.groups.append(_parent(gate_up_fmt, gate_up_sources, gate_up_members))
        self.groups.append(_parent(down_fmt, down_sources, down_members))
        shared = f"{p}mlp.shared_expert."
        self.groups.append(
            _parent(
                shared_fmt,
                [_source(f"{shared}gate_proj.weight", (s, h)), _source(f"{shared}up_proj.weight", (s, h))],
                [Member(f"{name}/moe/shared/gate", s, (ffn,)), Member(f"{name}/moe/shared/up", s, (ffn,))],
            )
        )
        self.singles.append(
            _single(shared_fmt, _source(f"{shared}down_proj.weight", (h, s)), f"{name}/moe/shared/down", f"{name}/moe/shared/product")
        )

    def text(self) -> None:
        d, tp = self.spec.text, self.tp
        head = output_head_tensor(self.spec, self.has, tp)
        head_inputs = ("text/final_hidden", "mtp/final_hidden") if self.with_mtp else ("text/final_hidden",)
        table = (d.vocab_size, d.hidden_size)
        self.singles += [
            _single(self.fmt("token_embedding"), _source(f"{tp}embed_tokens.weight", table), "text/token_embedding"),
            _single(self.fmt("output_head"), _source(head, table), "text/output_head", *head_inputs),
            _single(BF16, _source(f"{tp}norm.weight", (d.hidden_size,)), "text/final_norm"),
        ]
        for layer in range(d.num_layers):
            p, name = f"{tp}layers.{layer}.", f"text/layers/{layer}"
            (self.attention if d.is_attention(layer) else self.gdn)(p, name, d)
            self.moe(p, name, d, self.fmt("routed_gate_up", layer), self.fmt("routed_down", layer), self.fmt("shared_expert"))

    def mtp(self) -> None:
        d = self.spec.text
        fmt = self.fmt("projection")
        self.singles += [
            _single(fmt, _source("mtp.fc.weight", (d.hidden_size, 2 * d.hidden_size)), "mtp/input_projection", "mtp/stem_input"),
            _single(BF16, _source("mtp.pre_fc_norm_embedding.weight", (d.hidden_size,)), "mtp/embedding_norm"),
            _single(BF16, _source("mtp.pre_fc_norm_hidden.weight", (d.hidden_size,)), "mtp/hidden_norm"),
            _single(BF16, _source("mtp.norm.weight", (d.hidden_size,)), "mtp/final_norm"),
        ]
        self.attention("mtp.layers.0.", "mtp/layers/0", d)
        routed = self.fmt("mtp_routed")
        self.moe("mtp.layers.0.", "mtp/layers/0", d, routed, routed, self.fmt("projection"))

    def proposal(self, rows: int) -> None:
        """The proposal head over `rows` token ids (rows of the output head) and the ids themselves."""
        shape = (rows, self.spec.text.hidden_size)
        self.singles += [
            _single(self.fmt("proposal_head"), _source(PROPOSAL_HEAD, shape), "proposal/head", "mtp/final_hidden"),
            _single("int32", _source(PROPOSAL_IDS, (rows,)), "proposal/token_ids"),
        ]

    def vision(self, v: VisionDims) -> None:
        vp = "model.visual."
        h = v.hidden
        self.singles += [
            _single(
                self.fmt("vision_patch"),
                _source(f"{vp}patch_embed.proj.weight", (h, v.in_channels, v.temporal_patch, v.patch, v.patch), FLATTEN),
                "vision/patch_embedding", "vision/patch_input",
            ),
            _single(BF16, _source(f"{vp}patch_embed.proj.bias", (h,)), "vision/patch_embedding_bias"),
            _single(BF16, _source(f"{vp}pos_embed.weight", (v.positions, h)), "vision/position_embedding"),
        ]
        for i in range(v.depth):
            b, name = f"{vp}blocks.{i}.", f"vision/layers/{i}"
            attn_in = f"{name}/attention_input"
            self.groups.append(
                _parent(
                    self.fmt("vision_qkv"),
                    [_source(f"{b}attn.qkv.weight", (3 * h, h))],
                    [Member(f"{name}/attention/{n}", h, (attn_in,)) for n in ("query", "key", "value")],
                )
            )
            self.groups.append(
                _parent(
                    BF16,
                    [_source(f"{b}attn.qkv.bias", (3 * h,))],
                    [Member(f"{name}/attention/{n}_bias", h) for n in ("query", "key", "value")],
                )
            )
            self.singles += [
                _single(BF16, _source(f"{b}norm1.weight", (h,)), f"{name}/norm1_weight"),
                _single(BF16, _source(f"{b}norm1.bias", (h,)), f"{name}/norm1_bias"),
                _single(BF16, _source(f"{b}norm2.weight", (h,)), f"{name}/norm2_weight"),
                _single(BF16, _source(f"{b}norm2.bias", (h,)), f"{name}/norm2_bias"),
                _single(
                    self.fmt("vision_output"), _source(f"{b}attn.proj.weight", (h, h)), f"{name}/attention/output",
                    f"{name}/attention_output",
                ),
                _single(BF16, _source(f"{b}attn.proj.bias", (h,)), f"{name}/attention/output_bias"),
                _single(
                    self.fmt("vision_fc1"), _source(f"{b}mlp.linear_fc1.weight", (v.intermediate, h)), f"{name}/mlp/fc1",
                    f"{name}/mlp_input",
                ),
                _single(BF16, _source(f"{b}mlp.linear_fc1.bias", (v.intermediate,)), f"{name}/mlp/fc1_bias"),
                _single(
                    self.fmt("vision_fc2"), _source(f"{b}mlp.linear_fc2.weight", (h, v.intermediate)), f"{name}/mlp/fc2",
                    f"{name}/mlp_activation",
                ),
                _single(BF16, _source(f"{b}mlp.linear_fc2.bias", (h,)), f"{name}/mlp/fc2_bias"),
            ]
        m, merged, merger_fmt = f"{vp}merger.", v.merged, self.fmt("vision_merger")
        self.singles += [
            _single(BF16, _source(f"{m}norm.weight", (h,)), "vision/merger/norm_weight"),
            _single(BF16, _source(f"{m}norm.bias", (h,)), "vision/merger/norm_bias"),
            _single(merger_fmt, _source(f"{m}linear_fc1.weight", (merged, merged)), "vision/merger/fc1", "vision/merger/input"),
            _single(BF16, _source(f"{m}linear_fc1.bias", (merged,)), "vision/merger/fc1_bias"),
            _single(merger_fmt, _source(f"{m}linear_fc2.weight", (v.out_hidden, merged)), "vision/merger/fc2", "vision/merger/activation"),
            _single(BF16, _source(f"{m}linear_fc2.bias", (v.out_hidden,)), "vision/merger/fc2_bias"),
        ]


@dataclass(frozen=True)
class Layout:
    """Parents in object order."""

    parents: list[Parent]

    def tensors(self) -> set[str]:
        """The checkpoint tensors it reads."""
        return {s.tensor for p in self.parents for s in p.sources if not s.virtual}


def output_head_tensor(spec: ModelSpec, has: Callable[[str], bool], text_prefix: str) -> str:
    """The checkpoint tensor of the output head: `lm_head.weight`, or the embedding of a tied checkpoint without it."""
    tied_only = spec.tied and not has("lm_head.weight")
    return f"{text_prefix}embed_tokens.weight" if tied_only else "lm_head.weight"


def plan_layout(
    spec: ModelSpec, recipe: str, has: Callable[[str], bool], text_prefix: str, mtp: bool, vision: bool, proposal_rows: int = 0
) -> Layout:
    """Every parent of the artifact, components text (+ mtp) (+ vision) (+ a proposal head of
    `proposal_rows` rows), in converter order.

    `has(name)` tells whether the checkpoint holds a tensor (it selects fused or per-expert banks).
    """
    builder = LayoutBuilder(spec, recipe, has, text_prefix, mtp)
    builder.text()
    if mtp:
        builder.mtp()
    if vision:
        builder.vision(spec.vision)
    if proposal_rows:
        builder.proposal(proposal_rows)
    return Layout(builder.groups + builder.singles)
