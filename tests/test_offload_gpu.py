"""Offloaded decode on CUDA: the captured step reads host experts zero-copy, the cache moves records
between steps, and every logit equals the all-resident engine's. Skipped without CUDA."""

from __future__ import annotations


import pytest
import torch

from ninfer_offload import Engine
from ninfer_offload.runtime.expert_cache import ExpertCache
from ninfer_offload.runtime.prefill_staging import PrefillStaging
from ninfer_offload.runtime.step_inputs import pack_inputs, unpack_inputs

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

PROMPT = torch.randint(0, 512, (24,), generator=torch.Generator().manual_seed(3)).tolist()
LONG_PROMPT = torch.randint(0, 512, (160,), generator=torch.Generator().manual_seed(12)).tolist()  # 320 pairs: the prefill stages


def _decode(engine: Engine, steps: int, routing: list[torch.Tensor] | None = None, prompt: list[int] = PROMPT) -> list[torch.Tensor]:
    session = engine.session()
    out = [session.prefill(prompt)]
    token = int(out[0].argmax())
    for i in range(steps):
        if routing is not None:
            engine.store.replay_routing(routing[i])
        out.append(session.step(token).clone())
        token = int(out[-1].argmax())
    session.close()
    return out


@pytest.fixture(scope="module")
def resident(tiny_artifact_official):
    engine = Engine.load(tiny_artifact_official, device="cuda", spec="none")
    yield engine
    engine.close()


@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_offloaded_graph_steps_equal_resident(tiny_artifact_official, dtype):
    resident = Engine.load(tiny_artifact_official, device="cuda", dtype=dtype, spec="none")
    host = Engine.load(tiny_artifact_official, device="cuda", dtype=dtype, experts="host", num_slots=4, spec="none")
    assert host.graphs is not None and host.store.host[0].is_pinned()  # offloaded steps are captured too
    for got, want in zip(_decode(host, 12), _decode(resident, 12)):
        assert torch.equal(got, want)
    stats = host.store.stats
    assert stats.hits < stats.uses and stats.promotions > 0 and stats.pcie_bytes > 0


def test_the_host_check_counts_the_pool_as_the_allocator_locks_it(tiny_artifact_official):
    before = torch.cuda.host_memory_stats().get("allocated_bytes.current", 0)  # no key before the first pinned buffer
    host = Engine.load(tiny_artifact_official, device="cuda", experts="host", num_slots=4, spec="none")
    locked = torch.cuda.host_memory_stats()["allocated_bytes.current"] - before
    pool = host.expert_plan.host_ram_bytes(pinned=True)
    assert all(records.is_pinned() for records in host.store.host)
    assert host.expert_plan.host_bytes < pool < 1.5 * host.expert_plan.host_bytes  # power-of-two chunks
    assert pool <= locked < pool + 2**20  # plus the store's small pinned buffers
    host.close()


def test_greedy_generation_offloaded_equals_resident_steps(tiny_artifact_official, resident):
    """`generate` queues each greedy step behind the one that picks its token (the id never goes through the
    host): with host-resident experts and the cache moving records between steps, the tokens are those of
    resident steps taken one by one."""
    from ninfer_offload.runtime.sampling import SamplingParams

    expected = [int(logits.argmax()) for logits in _decode(resident, 11)]
    host = Engine.load(tiny_artifact_official, device="cuda", experts="host", num_slots=4, spec="none")
    result = host.generate(PROMPT, max_tokens=12, sampling=SamplingParams(greedy=True)).run()
    assert result.token_ids == expected and result.decode_steps == 11
    assert host.store.stats.promotions > 0
    host.close()


def test_planned_split_equals_resident(tiny_artifact_official, resident, small_card, half_expert_budget):
    split = Engine.load(tiny_artifact_official, device="cuda", profile=str(small_card), vram_budget=half_expert_budget, spec="none")
    assert 0 < sum(map(len, split.expert_plan.placement.pinned)) < split.config.num_layers * split.config.num_experts
    for got, want in zip(_decode(split, 10), _decode(resident, 10)):
        assert torch.equal(got, want)


@pytest.mark.parametrize("miss_path", [None, "cpu"])
def test_an_offloaded_step_has_no_host_sync(tiny_artifact_official, miss_path):
    """The forward a decode graph records, run eagerly in sync-debug mode: a synchronizing call anywhere
    in it (routing to the host, reading the table, counting uses, handing misses to the host) raises."""
    engine = Engine.load(tiny_artifact_official, device="cuda", experts="host", num_slots=4, spec="none", miss_path=miss_path)
    packed = pack_inputs([5], [engine.state.scratch_slot], [0], 1, engine.state.capacity).to("cuda")
    tokens, ctx = unpack_inputs(packed, 1, 1, prefill=False, keep_states=False, host=None)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        engine.runner.forward(tokens, ctx)
    finally:
        torch.cuda.set_sync_debug_mode("default")


@pytest.mark.parametrize("miss_path", ["cpu", "auto"])
def test_cpu_miss_path_graph_steps_match_resident(tiny_artifact_official, miss_path):
    """With a CPU miss path the decode steps are still captured: the host answers each layer's misses
    through the mailbox inside the graph, and the logits stay the resident ones (float32)."""
    resident = Engine.load(tiny_artifact_official, device="cuda", dtype="float32", spec="none")
    host = Engine.load(
        tiny_artifact_official, device="cuda", dtype="float32", experts="host", num_slots=4, spec="none", miss_path=miss_path
    )
    assert host.graphs is not None
    if miss_path == "auto":
        host.store.cpu_path.tuner.window, host.store.cpu_path.tuner.warmup = 2, 0
    for got, want in zip(_decode(host, 16), _decode(resident, 16)):
        assert torch.allclose(got, want, rtol=1e-3, atol=1e-3 * max(1.0, want.abs().max().item()))
    stats = host.store.stats
    assert stats.cpu_assignments > 0 and stats.miss_path["requests"] > 0
    assert any(key[3:] == ("handoff",) for key in host.graphs.graphs)  # the steps ran as graphs with the hand-off
    if miss_path == "auto":  # and its share-zero trials as the plain step
        assert any(len(key) == 3 for key in host.graphs.graphs)
    host.close()


def test_cache_never_serves_an_evicted_or_half_copied_record(tiny_artifact_official, monkeypatch):
    """Random routing through a 3-slot cache that promotes on every step. Each promotion first fills
    its slot with bytes whose fp16 scales are NaN and stalls the copy stream before copying the
    record in: a step that read an evicted slot, or a slot before its copy landed, would get NaN
    or a wrong expert and differ from the resident run."""
    copy = ExpertCache._copy

    def poisoned_copy(self, moves):
        for _, _, slot in moves:
            at = self.store.slot_offset(slot)
            self.store.arena[at : at + self.store.slot_bytes].fill_(0xFF)
        torch.cuda._sleep(2_000_000)  # ~1 ms on the copy stream: copies land well after the next step starts
        copy(self, moves)

    monkeypatch.setattr(ExpertCache, "_copy", poisoned_copy)
    engine = Engine.load(tiny_artifact_official, device="cuda", experts="host", num_slots=3, cache_policy="lru", spec="none")
    resident = Engine.load(tiny_artifact_official, device="cuda", spec="none")  # fresh: its graphs must record the routing hook
    layers, experts, k = engine.config.num_layers, engine.config.num_experts, engine.config.top_k
    gen = torch.Generator().manual_seed(5)

    def draw(tokens: int) -> torch.Tensor:
        return torch.stack([torch.randperm(experts, generator=gen)[:k] for _ in range(layers * tokens)]).view(layers, tokens, k).cuda()

    prompt_routing, routing = draw(len(PROMPT)), [draw(1) for _ in range(48)]
    engine.store.replay_routing(prompt_routing)
    resident.store.replay_routing(prompt_routing)
    for got, want in zip(_decode(engine, 48, routing), _decode(resident, 48, routing)):
        assert torch.equal(got, want)
    assert engine.store.stats.promotions > 10


def test_a_staged_prefill_equals_resident(tiny_artifact_official, resident):
    """A prompt past the MoE kernels' prefill threshold: each layer's host experts are copied from pinned
    memory into staging slots on the store's copy stream while the kernels compute the cached experts'
    pairs, then the kernels read the slots with the VRAM tiles (like the resident engine's), and the
    prefill logits, then the captured decode steps', equal the resident ones."""
    host = Engine.load(tiny_artifact_official, device="cuda", experts="host", num_slots=4, spec="none")
    for got, want in zip(_decode(host, 8, prompt=LONG_PROMPT), _decode(resident, 8, prompt=LONG_PROMPT)):
        assert torch.equal(got, want)
    assert host.store.stats.staged > 0


def test_a_staged_prefill_waits_for_late_copies(tiny_artifact_official, resident, monkeypatch):
    """The staging copy first fills the slots it copies into with 0xFF bytes (NaN scales) and stalls the copy
    stream for about 1 ms before copying the records in: kernels that read a slot before its copy landed
    would give NaN or another layer's expert, and the logits would differ from the resident ones."""
    copy_records = PrefillStaging._copy_records

    def late_copy_records(self, layer, experts, slots):
        start, store = self.store.staging_offset(0), self.store
        staging = store.arena[start : start + self.slots * store.slot_bytes].view(self.slots, store.slot_bytes)
        staging.index_fill_(0, (slots - start) // store.slot_bytes, 0xFF)
        torch.cuda._sleep(2_000_000)
        copy_records(self, layer, experts, slots)

    monkeypatch.setattr(PrefillStaging, "_copy_records", late_copy_records)
    host = Engine.load(tiny_artifact_official, device="cuda", experts="host", num_slots=4, spec="none")
    for got, want in zip(_decode(host, 4, prompt=LONG_PROMPT), _decode(resident, 4, prompt=LONG_PROMPT)):
        assert torch.equal(got, want)
    assert host.store.stats.staged > 0


@pytest.mark.parametrize("experts", ["resident", "host"])
def test_speculative_greedy_on_cuda_equals_plain_greedy(tiny_artifact_official, experts):
    """MTP drafts verified by captured (K + 1)-token steps, resident and with host experts (float32):
    the greedy output is the plain graph-decoded one."""
    from ninfer_offload.runtime.generate import generate
    from ninfer_offload.runtime.sampling import SamplingParams

    greedy = SamplingParams(greedy=True)
    plain = Engine.load(
        tiny_artifact_official, device="cuda", dtype="float32", experts=experts, num_slots=4 if experts == "host" else None, spec="none"
    )
    spec = Engine.load(
        tiny_artifact_official, device="cuda", dtype="float32", experts=experts, spec="mtp", draft_tokens=3,
        num_slots=4 if experts == "host" else None,
    )
    want = generate(plain, PROMPT, max_tokens=24, sampling=greedy).run()
    got = generate(spec, PROMPT, max_tokens=24, sampling=greedy).run()
    assert got.token_ids == want.token_ids
    assert spec.graphs is not None and ("target", 1, 4) in spec.graphs.graphs  # the verify step was captured
    assert ("mtp", 1, 1) in spec.graphs.graphs  # and the drafting MTP step


def test_captured_mtp_steps_equal_eager_ones(tiny_artifact_official):
    """The MTP layer's graphs (one position while drafting, several after a round) give the eager
    step's draft logits and hidden states (float32)."""
    engines = [
        Engine.load(
            tiny_artifact_official, device="cuda", dtype="float32", mtp=True, draft_tokens=3, cuda_graphs=graphs, max_sequences=2
        )
        for graphs in (True, False)
    ]
    results = []
    for engine in engines:
        target = engine.session()
        _, hidden = target.append(PROMPT)
        session = engine.session()
        session.mtp(hidden[:5], PROMPT[1:6])
        first = engine.mtp_step([session], hidden[5:6], [PROMPT[6]])
        several = engine.mtp_step([session], hidden[6:9], PROMPT[7:10], 3)
        results.append((first, several))
    assert ("mtp", 1, 1) in engines[0].graphs.graphs and ("mtp", 1, 3) in engines[0].graphs.graphs
    for (captured, eager) in zip(results[0], results[1]):
        assert torch.allclose(captured[0], eager[0], atol=1e-4) and torch.allclose(captured[1], eager[1], atol=1e-4)


def test_batched_mtp_step_on_cuda_equals_each_sessions_own(tiny_artifact_official):
    """The MTP layer through the Triton decode kernels for two sequences at once (float32) gives what
    each gets alone."""
    engine = Engine.load(tiny_artifact_official, device="cuda", dtype="float32", mtp=True, max_sequences=4)
    _, hidden = engine.session().append(PROMPT)
    together, alone = [engine.session(), engine.session()], [engine.session()]
    together[0].mtp(hidden[:5], PROMPT[1:6])
    together[1].mtp(hidden[:11], PROMPT[1:12])
    alone[0].mtp(hidden[:11], PROMPT[1:12])
    rows = torch.stack([hidden[5], hidden[11]])
    logits, out = engine.mtp_step(together, rows, [PROMPT[6], PROMPT[12]])
    own_logits, own_out = alone[0].mtp(rows[1:], [PROMPT[12]])
    assert torch.allclose(logits[1], own_logits[0], atol=1e-4) and torch.allclose(out[1], own_out[0], atol=1e-4)


def test_captured_batch_steps_follow_host_max_uses_between_replays(tiny_artifact_official):
    """Three sequences decode together as captured steps with the CPU miss path (float32): `host_max_uses`, a device
    scalar the graph reads at replay, changes between steps without a new capture; the host takes no assignment at
    0 and some at 1 and up, and the logits stay the resident batch's."""
    prompts = [PROMPT[:n] for n in (7, 13, 24)]
    limits = [1, 0, 2, 64, 1]

    def batch(engine: Engine, path=None) -> list[torch.Tensor]:
        sessions = [engine.session() for _ in prompts]
        out = [torch.stack([s.prefill(p) for s, p in zip(sessions, prompts)])]
        for limit in limits:
            before = engine.store.stats.cpu_assignments if path is not None else 0
            if path is not None:
                path.set_host_max_uses(limit)
            out.append(engine.step_batch(sessions, out[-1].argmax(-1).tolist()))
            if path is not None:
                assert (engine.store.stats.cpu_assignments > before) == (limit > 0)
        for session in sessions:
            session.close()
        return out

    resident = Engine.load(tiny_artifact_official, device="cuda", dtype="float32", spec="none", max_sequences=3)
    host = Engine.load(
        tiny_artifact_official, device="cuda", dtype="float32", experts="host", num_slots=4, spec="none", miss_path="cpu",
        max_sequences=3,
    )
    got, want = batch(host, host.store.cpu_path), batch(resident)
    for g, w in zip(got, want):
        assert torch.allclose(g, w, rtol=1e-3, atol=1e-3 * max(1.0, w.abs().max().item()))
    steps = [key for key in host.graphs.graphs if key[0] == "target" and key[3:] == ("handoff",)]
    assert len(steps) == 1  # one captured batch step served every limit
    host.close()
    resident.close()
