"""The plan drives the load (CPU): which experts end up pinned in VRAM, in cache slots or in host
memory, the offset table that reaches them, the cache policies at work, and logits equal to the
all-resident engine whatever the placement."""

from __future__ import annotations


import numpy as np
import pytest
import torch

from ninfer_offload import Engine, NinferError
from ninfer_offload.runtime.memory_check import check_host_memory

PROMPT = torch.randint(0, 512, (24,), generator=torch.Generator().manual_seed(11)).tolist()
STEPS = [3, 99, 250, 7, 61, 300, 12, 8, 444, 17, 42, 5]


@pytest.fixture(scope="module")
def resident(tiny_artifact_official):
    engine = Engine.load(tiny_artifact_official, spec="none")
    yield engine
    engine.close()


def _run(engine: Engine) -> list[torch.Tensor]:
    session = engine.session()
    out = [session.prefill(PROMPT)]
    out += [session.step(token) for token in STEPS]
    session.close()
    return out


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
    assert store.cache_start + store.cache_slots * store.slot_bytes == store.arena.numel() == engine.expert_plan.arena_bytes
    for got, want in zip(_run(engine), _run(resident)):
        assert torch.equal(got, want)
    stats = store.stats
    assert 0 < stats.hit_rate < 1 and stats.pcie_bytes > 0
    assert "plan small_card" in engine.placement_report()


@pytest.mark.parametrize("policy", ["static", "lru", "decayed"])
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
