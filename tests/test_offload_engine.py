"""The plan drives the load (CPU): which experts end up pinned in VRAM, in cache slots or in host
memory, the offset table that reaches them, the cache policies at work, prefill chunks staging their
host experts, and logits equal to the all-resident engine whatever the placement."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch

from kernels_support import DEVICE, needs_triton_device
from ninfer_offload import Engine, NinferError
from ninfer_offload.kernels.moe import PREFILL_TILES
from ninfer_offload.planner import memory
from ninfer_offload.planner.options import PREFILL_SPAN_CHUNKS
from ninfer_offload.runtime.memory_check import check_host_memory
from ninfer_offload.runtime.step_inputs import step_inputs

PROMPT = torch.randint(0, 512, (24,), generator=torch.Generator().manual_seed(11)).tolist()
STEPS = [3, 99, 250, 7, 61, 300, 12, 8, 444, 17, 42, 5]
# 160 tokens x top-2 = 320 (token, expert) pairs: more than moe.PREFILL_MIN_PAIRS, so the prefill stages its host experts
LONG_PROMPT = torch.randint(0, 512, (160,), generator=torch.Generator().manual_seed(12)).tolist()


@pytest.fixture(scope="module")
def resident(tiny_artifact_official):
    engine = Engine.load(tiny_artifact_official, spec="none")
    yield engine
    engine.close()


def _run(engine: Engine, prompt: list[int] = PROMPT) -> list[torch.Tensor]:
    session = engine.session()
    out = [session.prefill(prompt)]
    out += [session.step(token) for token in STEPS]
    session.close()
    return out


@pytest.fixture(scope="module")
def resident_long(resident) -> list[torch.Tensor]:
    return _run(resident, LONG_PROMPT)


def test_plan_decides_where_each_expert_lives(tiny_artifact_official, resident, small_card, half_expert_budget):
    engine = Engine.load(tiny_artifact_official, profile=str(small_card), vram_budget=half_expert_budget, spec="none")
    plan, store = engine.expert_plan.plan, engine.store
    assert plan.feasible and 0 < plan.experts_resident < plan.experts_total
    pinned = engine.expert_plan.placement.pinned
    # every pinned expert is one the plan put in VRAM; the rest of the plan's share went to the cache
    assert all(set(ids) <= set(planned) for ids, planned in zip(pinned, plan.resident_experts))
    assert 0 < store.cache_slots and sum(map(len, pinned)) < plan.experts_resident
    table = store.table.numpy()
    cache = store.cache
    for layer in range(engine.config.num_layers):
        host = store.host[layer]
        for expert in range(engine.config.num_experts):
            offset = int(table[layer, expert])
            nbytes = store.layouts[layer].nbytes
            if expert in pinned[layer]:
                assert 0 <= offset < store.cache_start
            elif cache.cached[layer, expert]:
                slot = cache.owner.index((layer, expert))
                assert offset == store.slot_offset(slot)
            else:
                assert offset == host[expert].data_ptr() - store.arena.data_ptr()
                continue
            assert torch.equal(store.arena[offset : offset + nbytes], host[expert])  # the VRAM copy is the host record
    assert store.staging_slots == 2 * engine.config.num_experts  # two buffers of PREFILL_STAGING_SLOTS, each at most a layer's experts
    slots = store.cache_slots + store.staging_slots
    assert store.cache_start + slots * store.slot_bytes == store.arena.numel() == engine.expert_plan.arena_bytes
    for got, want in zip(_run(engine), _run(resident)):
        assert torch.equal(got, want)
    stats = store.stats
    assert 0 < stats.hit_rate < 1 and stats.pcie_bytes > 0
    assert "plan small_card" in engine.placement_report()


@pytest.mark.parametrize("policy", ["static", "lru", "decayed", "batch"])
def test_every_cache_policy_gives_the_resident_logits(tiny_artifact_official, resident, policy):
    engine = Engine.load(tiny_artifact_official, experts="host", num_slots=5, cache_policy=policy, spec="none")
    for got, want in zip(_run(engine), _run(resident)):
        assert torch.equal(got, want)
    stats = engine.store.stats
    assert stats.uses == (len(PROMPT) + len(STEPS)) * engine.config.top_k * engine.config.num_layers
    assert (stats.promotions > 0) == (policy != "static")
    cache = engine.store.cache
    assert cache.cached.sum() == 5 == sum(owner is not None for owner in cache.owner)  # slots stay full, no slot holds two


def test_adaptive_cache_follows_the_traffic(tiny_artifact_official):
    """Replayed routing that keeps picking experts 7 and 6 in every layer: once the prefill's counts are
    read, the cache takes those 12 in and every later use hits."""
    engine = Engine.load(tiny_artifact_official, experts="host", num_slots=12, cache_policy="lru", spec="none")
    layers, top_k = engine.config.num_layers, engine.config.top_k
    hot = torch.tensor([[7, 6]] * layers).view(layers, 1, top_k)
    engine.store.replay_routing(hot)
    session = engine.session()
    session.prefill([1])
    before = engine.store.stats.hits
    for _ in range(4):
        session.step(2)
    stats = engine.store.stats
    assert stats.hits - before == 4 * layers * top_k
    assert engine.store.cache.cached[:, [6, 7]].all()


def _record_bytes(engine: Engine) -> np.ndarray:
    return np.array([layout.nbytes for layout in engine.store.layouts])


def test_a_prefill_never_stages_the_mtp_layer(tiny_artifact_official):
    """The MTP layer's experts sit after the text layers' in the store; a prompt chunk runs only the text
    layers, so only they stage (a copy for the MTP layer would cross PCIe for nothing)."""
    engine = Engine.load(tiny_artifact_official, experts="host", num_slots=5, mtp=True, spec="none")
    store = engine.store
    assert len(store.layouts) == store.text_layers + 1 == engine.config.num_layers + 1
    session = engine.session()
    session.prefill(LONG_PROMPT)
    session.close()
    records = store.staged_records.numpy()
    assert records[: store.text_layers].sum(axis=1).min() > 0 and records[store.text_layers].sum() == 0
    engine.close()


def test_mtp_forwards_are_not_the_expert_stores_steps(tiny_artifact_official, monkeypatch):
    """With host experts and speculation, only the target's forwards go through the expert store's step
    bookkeeping (cache boundaries, count reads and promotions, the CPU miss path's tuner): each round's one
    verification, never its MTP forwards (drafts, the round's follow-up, the prompt's); greedy output stays
    the plain engine's."""
    from ninfer_offload.runtime.expert_store import ExpertStore
    from ninfer_offload.runtime.generate import generate
    from ninfer_offload.runtime.sampling import SamplingParams

    greedy = SamplingParams(greedy=True)
    plain = Engine.load(tiny_artifact_official, experts="host", num_slots=5, spec="none")
    want = generate(plain, PROMPT, max_tokens=12, sampling=greedy).run().token_ids
    plain.close()
    engine = Engine.load(tiny_artifact_official, experts="host", num_slots=5, spec="mtp", draft_tokens=3)
    steps = []
    original = ExpertStore.around_step

    def counted(self, tokens, ctx=None):
        steps.append(ctx is not None and ctx.staged)  # staged: a prompt chunk
        return original(self, tokens, ctx)

    monkeypatch.setattr(ExpertStore, "around_step", counted)
    result = generate(engine, PROMPT, max_tokens=12, sampling=greedy).run()
    assert result.token_ids == want
    assert steps.count(False) == result.speculation["rounds"] > 0 and steps.count(True) >= 1
    engine.close()


def test_a_prefill_stages_each_host_expert_once(tiny_artifact_official, resident_long):
    """A long prompt's chunks copy every expert they use that is not in VRAM into a staging slot once and
    read it there (ahead of each layer's routing): the only PCIe bytes of the prefill are the
    staged records, no use of a host expert is left to the host, and the logits (prefill, then decode
    steps that do not stage) equal the resident ones."""
    engine = Engine.load(tiny_artifact_official, experts="host", num_slots=5, spec="none")
    store = engine.store
    session = engine.session()
    prefill = session.prefill(LONG_PROMPT)
    stats = dataclasses.replace(store.stats)  # a copy: the store keeps counting into its own
    staged_uses = int(store.shared_uses.sum())
    assert stats.staged > 0 and staged_uses == stats.uses - stats.hits > 0  # every miss was served from staging
    records = store.staged_records.numpy().copy()
    assert records.max() == 1  # one chunk: each staged record once
    assert stats.staged == records.sum() and stats.pcie_bytes == (records.sum(axis=1) * _record_bytes(engine)).sum()
    assert stats.to_json()["staged"] == stats.staged
    steps = [session.step(token) for token in STEPS]
    session.close()
    after = store.stats
    assert after.staged == stats.staged and int(store.shared_uses.sum()) == staged_uses  # decode steps never stage
    assert after.pcie_bytes > stats.pcie_bytes  # their misses are read over PCIe as before
    for got, want in zip([prefill, *steps], resident_long):
        assert torch.equal(got, want)


def test_a_prefill_that_stages_nothing_reads_its_host_experts_over_pcie(tiny_artifact_official, resident_long):
    """No host expert expected to be used often enough: no layer copies anything, each keeps its own table
    and reads its host experts where they are, and the logits equal the resident ones."""
    engine = Engine.load(tiny_artifact_official, experts="host", num_slots=5, cache_policy="static", spec="none")
    engine.store.staging.ahead_min_uses = float("inf")
    for got, want in zip(_run(engine, LONG_PROMPT), resident_long):
        assert torch.equal(got, want)
    stats = engine.store.stats
    assert stats.staged == 0 and stats.pcie_bytes > 0
    engine.close()


def test_a_prefill_after_promotions_stages_from_the_moved_table(tiny_artifact_official, resident_long):
    """Decode steps that promote and evict experts, then a long prompt in a new sequence: staging builds each
    layer's table copy from the host's view of the table, which follows every move (it equals the device
    table), and the logits equal the resident ones."""
    engine = Engine.load(tiny_artifact_official, experts="host", num_slots=5, cache_policy="lru", spec="none")
    _run(engine)
    store = engine.store
    assert store.stats.promotions > 0 and store.stats.staged == 0
    assert np.array_equal(store.table_host, store.table.cpu().numpy())
    for got, want in zip(_run(engine, LONG_PROMPT), resident_long):
        assert torch.equal(got, want)
    assert store.stats.staged > 0 and np.array_equal(store.table_host, store.table.cpu().numpy())
    engine.close()


def test_a_span_stages_each_host_expert_once_for_its_chunks(tiny_artifact_official):
    """`prefill_chunk=160`: a 360-token prompt is one forward of three chunks (160, 160, 40) that each layer runs in
    turn, so each host expert a layer needs is staged once for all three (the short last chunk reads what the first
    staged); an 800-token prompt takes two spans of PREFILL_SPAN_CHUNKS chunks at most (640, then 160 tokens), an
    expert staged at most once by each. Every position's logits, and the decode steps after, equal those of a
    resident engine prefilling chunk by chunk, and so do `generate`'s tokens."""
    resident = Engine.load(tiny_artifact_official, spec="none", prefill_chunk=160)
    engine = Engine.load(tiny_artifact_official, experts="host", num_slots=5, cache_policy="static", spec="none", prefill_chunk=160)
    assert (resident.prefill_span, engine.prefill_span) == (160, 160 * PREFILL_SPAN_CHUNKS)
    layers = engine.config.num_layers
    in_vram = engine.store.cache.in_vram[:layers]
    for length, most in ((360, 1), (800, 2)):
        prompt = (LONG_PROMPT * 5)[:length]
        before = engine.store.staged_records[:layers].numpy().copy()
        assert torch.equal(engine.logits(prompt), resident.logits(prompt))
        records = engine.store.staged_records[:layers].numpy() - before
        assert records.sum() > 0 and records.max() == most  # once per span
        assert not records[in_vram].any()  # never an expert already in VRAM (a static cache: it did not change)
    for a, b in zip(_run(engine, prompt), _run(resident, prompt)):
        assert torch.equal(a, b)
    # the decode loop gives a prompt alone the engine's spans: generate stages each host expert once for 360 tokens
    from ninfer_offload.runtime.generate import generate
    from ninfer_offload.runtime.sampling import SamplingParams

    before = engine.store.staged_records[:layers].numpy().copy()
    greedy = SamplingParams(greedy=True)
    got = generate(engine, prompt[:360], max_tokens=4, sampling=greedy).run().token_ids
    assert got == generate(resident, prompt[:360], max_tokens=4, sampling=greedy).run().token_ids
    assert (engine.store.staged_records[:layers].numpy() - before).max() == 1
    resident.close()
    engine.close()


def test_a_prefill_staged_ahead_takes_the_likeliest_host_experts(tiny_artifact_official, resident_long, monkeypatch):
    """Staging ahead of routing into two buffers of three slots: each layer stages, before its routing is
    known, the three host experts the plan's pick rates rank first (the cache is static, so the host
    knows which are outside VRAM); the uses of the other host experts are read over PCIe, and the logits
    still equal the resident ones."""
    monkeypatch.setattr(memory, "PREFILL_STAGING_SLOTS", 3)
    engine = Engine.load(tiny_artifact_official, experts="host", num_slots=5, cache_policy="static", spec="none")
    store = engine.store
    assert store.staging_slots == 6
    session = engine.session()
    prefill = session.prefill(LONG_PROMPT)
    uses, shared_uses, records = store.uses.numpy(), store.shared_uses.numpy(), store.staged_records.numpy()
    in_vram = store.cache.in_vram[: engine.config.num_layers]
    block = PREFILL_TILES.block_m
    reads = np.zeros_like(uses)  # the unstaged host experts' reads: one per block of their pairs
    for layer, vram in enumerate(in_vram):
        outside = np.flatnonzero(~vram)
        ranked = outside[np.argsort(-store.placement.scores[layer, outside], kind="stable")][:3]
        assert np.array_equal(np.flatnonzero(records[layer]), np.sort(ranked))
        unstaged = ~vram & (records[layer] == 0)
        reads[layer] = np.where(unstaged, -(-uses[layer] // block), 0)
        followers = uses[layer] - reads[layer]
        assert np.array_equal(shared_uses[layer], np.where(records[layer] > 0, uses[layer], np.where(unstaged, followers, 0)))
    stats = store.stats
    assert reads.sum() > 0 and (uses[reads > 0] > reads[reads > 0]).all() and stats.staged == records.sum()  # blocks share reads
    assert stats.pcie_bytes == ((records.sum(axis=1) + reads.sum(axis=1)) * _record_bytes(engine)).sum()
    steps = [session.step(token) for token in STEPS]
    session.close()
    for got, want in zip([prefill, *steps], resident_long):
        assert torch.equal(got, want)


@needs_triton_device
@pytest.mark.parametrize("slots", [8, 3])
def test_the_moe_kernels_read_the_staging_slots(tiny_artifact_official, monkeypatch, slots):
    """The Triton MoE kernels on a prefill chunk's bank, every layer, in passes (the staged experts after
    their copies; on CUDA those run on the store's copy stream): with all its host experts staged the bank
    drops the host records (so every pass takes the VRAM tiles) and the output equals the resident engine's;
    with three slots per buffer it keeps them (the experts left in host memory take the PCIe-friendly tiles)
    and the output matches to rounding."""
    monkeypatch.setattr(memory, "PREFILL_STAGING_SLOTS", slots)
    load = dict(device=DEVICE, dtype="float32", backend="triton", spec="none")
    resident = Engine.load(tiny_artifact_official, **load)
    host = Engine.load(tiny_artifact_official, experts="host", num_slots=3, cache_policy="static", **load)
    generator = torch.Generator().manual_seed(5)
    tokens, experts, top_k = len(LONG_PROMPT), host.config.num_experts, host.config.top_k
    x = torch.randn(tokens, host.config.hidden_size, generator=generator).to(DEVICE)
    ids = torch.stack([torch.randperm(experts, generator=generator)[:top_k] for _ in range(tokens)]).to(DEVICE)
    weights = torch.softmax(torch.randn(tokens, top_k, generator=generator), -1).to(DEVICE)
    used = torch.bincount(ids.reshape(-1).cpu(), minlength=experts).numpy() > 0
    _, chunk = step_inputs([0], [host.state.scratch_slot], [0], 1, host.max_context, host.device, prefill=True, staged=True)
    for layer in range(host.config.num_layers):
        want = resident.store.routed(resident.backend, layer, x, ids, weights)
        with host.store.around_step(1, chunk):
            got = host.store.routed(host.backend, layer, x, ids, weights, ctx=chunk)
            bank, later = host.store.staging.bank(layer, ids, tokens)
        outside = ~host.store.cache.in_vram[layer]
        missing, staged = int((used & outside).sum()), later.cpu().numpy()
        # staged before the routing: host experts only; the bank keeps the host records unless all are staged
        assert not (staged & ~outside).any() and (bank.host is None) == (staged.sum() == outside.sum())
        assert missing > 0
        if bank.host is None:
            assert torch.equal(got, want)
        else:
            assert float((got - want).double().norm() / want.double().norm()) < 1e-5
    resident.close()
    host.close()


def test_a_budget_below_what_the_plan_needs_is_one_line(tiny_artifact_official, small_card):
    with pytest.raises(NinferError) as err:
        Engine.load(tiny_artifact_official, profile=str(small_card), vram_budget=4096)
    message = str(err.value)
    assert "\n" not in message and "small_card" in message and "budget" in message


def test_a_budget_without_a_profile_on_the_cpu_is_refused(tiny_artifact_official):
    with pytest.raises(NinferError, match="--profile"):
        Engine.load(tiny_artifact_official, vram_budget=1 << 30)


def test_not_enough_host_memory_names_the_fix():
    with pytest.raises(NinferError) as err:
        check_host_memory(1 << 60)
    assert "\n" not in str(err.value) and "--vram-budget" in str(err.value)


def test_resident_engine_keeps_no_host_copy(resident):
    assert resident.store.host == [] and resident.store.cache is None
    assert np.all(resident.store.pinned)


def test_a_resident_load_holds_few_packing_buffers_at_once(tiny_artifact_official, monkeypatch):
    """Each layer's records are packed into a host buffer; once copied into the arena, a resident load
    must let it go (on CUDA these are pinned: holding them all would pin the whole model at once), so
    no more than the packing threads' buffers (and the one being copied) are ever alive together."""
    import gc
    import weakref

    from ninfer_offload.runtime.expert_store import ExpertStore
    from ninfer_offload.runtime.loader import PACK_THREADS

    buffers, most_alive = [], [0]
    original = ExpertStore.host_buffer

    def tracked(self, layer):
        buffer = original(self, layer)
        buffers.append(weakref.ref(buffer))
        gc.collect()
        most_alive[0] = max(most_alive[0], sum(ref() is not None for ref in buffers))
        return buffer

    monkeypatch.setattr(ExpertStore, "host_buffer", tracked)
    engine = Engine.load(tiny_artifact_official, mtp=True)
    assert len(buffers) == engine.config.num_layers + 1 > PACK_THREADS + 1
    assert most_alive[0] <= PACK_THREADS + 1
    engine.close()


def test_prompt_pieces_follow_what_is_running(tiny_artifact_official, monkeypatch):
    """The decode loop's default pieces (40 tokens beside running streams here) on a load with staged host experts: a
    prompt admitted while another stream decodes goes in engine chunks (160 tokens: its stall is its staging's
    whatever its length), a prompt alone in a span of the rest; on the resident load the loop keeps 40-token pieces
    beside a running stream and a prompt alone goes in chunks; pieces given to the loop are kept. Each stream's tokens
    equal across the loads."""
    from ninfer_offload.runtime import decoder as decode_loop
    from ninfer_offload.runtime.decoder import Decoder, GenerationRequest, Token
    from ninfer_offload.runtime.sampling import SamplingParams
    from ninfer_offload.runtime.step_runner import StepRunner

    pieces = []
    original = StepRunner.prefill

    def recorded(self, piece, slot, start):
        pieces.append(len(piece))
        return original(self, piece, slot, start)

    monkeypatch.setattr(StepRunner, "prefill", recorded)
    monkeypatch.setattr(decode_loop, "PIECE_BESIDE_STREAMS", 40)
    greedy = SamplingParams(greedy=True)
    long_prompt = (LONG_PROMPT * 3)[:400]
    results = {}
    for name, load in (("host", dict(experts="host", num_slots=5, cache_policy="static")), ("resident", {})):
        engine = Engine.load(tiny_artifact_official, spec="none", prefill_chunk=160, max_sequences=2, **load)
        decoder = Decoder(engine)
        running = decoder.add(GenerationRequest(PROMPT, 30, greedy))
        while not running.output:
            list(decoder.step())
        pieces.clear()
        late = decoder.add(GenerationRequest(long_prompt, 2, greedy))
        tokens = {id(running): list(running.output), id(late): []}
        while not (running.ended and late.ended):
            for event in decoder.step():
                if isinstance(event, Token):
                    tokens[id(event.sequence)].append(event.token)
        results[name] = (list(pieces), tokens[id(running)], tokens[id(late)])
        for label, loop in (("alone", Decoder(engine)), ("given", Decoder(engine, prefill_chunk=100))):
            pieces.clear()
            solo = loop.add(GenerationRequest(long_prompt, 2, greedy))
            while not solo.ended:
                list(loop.step())
            results[f"{name} {label}"] = list(pieces)
        engine.close()
    assert results["host"][0] == [160, 160, 80]
    assert results["resident"][0] == [40] * 10
    assert results["host alone"] == [400] and results["resident alone"] == [160, 160, 80]
    assert results["host given"] == results["resident given"] == [100] * 4
    assert results["host"][1:] == results["resident"][1:]


def test_replayed_routing_follows_each_chunk_of_a_span(tiny_artifact_official):
    """Routing replayed for a whole span (benchmarks' trace rows, `ExpertStore.replay_routing`) reaches each chunk at its
    own rows (`StepContext.span_row`): the span's logits equal a resident engine's fed the same rows chunk by chunk."""
    prompt = (LONG_PROMPT * 3)[:360]
    host = Engine.load(tiny_artifact_official, experts="host", num_slots=5, cache_policy="static", spec="none", prefill_chunk=160)
    resident = Engine.load(tiny_artifact_official, spec="none", prefill_chunk=160)
    layers, experts, top_k = len(host.store.layouts), host.config.num_experts, host.config.top_k
    generator = torch.Generator().manual_seed(9)
    ids = torch.stack([torch.stack([torch.randperm(experts, generator=generator)[:top_k] for _ in prompt]) for _ in range(layers)])
    host.store.replay_routing(ids)
    want = []
    session = resident.session()
    for c0 in range(0, len(prompt), 160):
        resident.store.replay_routing(ids[:, c0 : c0 + 160])
        want.append(session.append(prompt[c0 : c0 + 160])[0])
    session.close()
    assert torch.equal(host.logits(prompt), torch.cat(want))
    host.close()
    resident.close()
