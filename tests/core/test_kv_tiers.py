"""The KV tiers below HBM (deepinfer/kv_cache/tiers.py): LRU per tier, an evicted block's
way down (host, then the shared store, then dropped), and a prefix hit in a lower tier
loaded into HBM (a copy: the tier keeps it) instead of computed."""

from __future__ import annotations

import pytest

from deepinfer.config import EngineConfig
from deepinfer.engine import EngineCore
from deepinfer.kv_cache.tiers import HOST, STORE, KVTiers, TierLRU, step_copies
from deepinfer.outputs import KVLoad, KVSave, SchedulerOutput
from tests.factories import ScriptedExecutor, StepClock, make_config, make_request
from tests.factories import run_to_completion as run


def test_a_tier_keeps_its_most_recently_used_blocks() -> None:
    tier = TierLRU(HOST, 2)
    assert tier.put(1) is None and tier.put(2) is None
    assert tier.put(1) is None  # held: made the most recent, not written again
    assert tier.num_saved == 2
    assert tier.put(3) == 2  # 2 is now the least recently used
    tier.read(1)  # a load keeps the block, the most recent
    assert tier.put(4) == 3
    assert tier.hashes() == [1, 4] and tier.num_loaded == 1


def test_an_evicted_block_moves_down_host_then_store_then_is_dropped() -> None:
    host, store = TierLRU(HOST, 1), TierLRU(STORE, 2)
    tiers = KVTiers(host, store)
    for h in (1, 2, 3, 4):
        tiers.demote(h, block_id=h)
    # host holds the newest; its victims went to the store, whose oldest was dropped.
    assert host.hashes() == [4] and store.hashes() == [2, 3]
    assert tiers.saved == {HOST: 4, STORE: 3} and tiers.dropped == 1
    assert store.num_dropped == 1
    assert tiers.find(4) is host and tiers.find(2) is store and tiers.find(1) is None


def test_a_store_shared_by_two_engines_serves_both() -> None:
    store = TierLRU(STORE, 4)
    a, b = KVTiers(TierLRU(HOST, 1), store), KVTiers(None, store)
    a.demote(7, block_id=0)
    a.demote(8, block_id=1)  # 7 leaves a's host for the store
    assert b.find(7) is store and b.find(8) is None
    b.read(store, 7)
    assert b.loaded == {HOST: 0, STORE: 1} and a.loaded == {HOST: 0, STORE: 0}


def test_tiers_refuse_what_they_cannot_be() -> None:
    with pytest.raises(ValueError, match="capacity 0 blocks"):
        TierLRU(HOST, 0)
    with pytest.raises(ValueError, match="host tier, a store, or both"):
        KVTiers()
    with pytest.raises(ValueError, match="kv_host_cache_gib=-1"):
        EngineConfig(kv_host_cache_gib=-1)
    with pytest.raises(ValueError, match="kv_host_cache_gib=1 with enable_prefix_caching=False"):
        EngineConfig(kv_host_cache_gib=1, enable_prefix_caching=False)


def test_an_engine_refuses_a_host_size_it_was_given_no_tier_for() -> None:
    cfg = make_config(kv_host_cache_gib=1.0)
    with pytest.raises(ValueError, match="kv_host_cache_gib=1.0: this engine was given no host"):
        EngineCore(cfg, ScriptedExecutor(10), clock=StepClock())


def _engine(host_blocks: int, num_gpu_blocks: int = 6) -> EngineCore:
    cfg = make_config(num_gpu_blocks=num_gpu_blocks, kv_host_cache_gib=1.0)
    tiers = KVTiers(TierLRU(HOST, host_blocks))
    return EngineCore(
        cfg, ScriptedExecutor(num_gpu_blocks), clock=StepClock(), check_invariants=True,
        kv_tiers=tiers,
    )  # fmt: skip


PROMPT = list(range(100, 112))  # 3 full blocks of 4 tokens


def _evict_then_ask_again(host_blocks: int) -> tuple[EngineCore, SchedulerOutput]:
    """A's prompt is cached, then B's and C's evict it from the 6-block HBM (into the host
    tier, as far as it holds); the step that starts A's prompt again."""
    engine = _engine(host_blocks)
    for rid, p in (("a", PROMPT), ("b", list(range(200, 220))), ("c", list(range(300, 320)))):
        engine.add_request(make_request(rid, p, max_tokens=1))
        run(engine)
    assert engine.scheduler.kv.find_cached_prefix(make_request("probe", PROMPT)) == []
    engine.add_request(make_request("a2", PROMPT, max_tokens=1))
    return engine, engine.scheduler.schedule()


def test_a_prefix_evicted_to_host_is_loaded_not_computed() -> None:
    """Its first two blocks (the last token is computed) come from the host, and the step
    says so."""
    engine, out = _evict_then_ask_again(host_blocks=8)
    s = engine.scheduler
    assert [load.tier for load in out.kv_loads] == [HOST, HOST]
    (sr,) = out.scheduled
    assert sr.num_computed_tokens == 8 and sr.num_tokens == 4
    assert [load.block_id for load in out.kv_loads] == sr.new_block_ids[:2]
    assert s.kv.prefix_hit_blocks[HOST] == 2
    assert s.requests["a2"].num_cached_tokens == 8
    tiers = s.kv.tiers
    assert tiers is not None and tiers.loaded[HOST] == 2
    assert all(h in tiers.order[0] for h in (load.block_hash for load in out.kv_loads))  # copies


def test_without_room_in_the_host_tier_the_prefix_is_computed() -> None:
    engine, out = _evict_then_ask_again(host_blocks=1)
    assert out.kv_loads == () and out.scheduled[0].num_computed_tokens == 0
    tiers = engine.scheduler.kv.tiers
    assert tiers is not None and tiers.dropped > 0


def test_a_load_reads_the_steps_own_save_of_its_hash_to_its_slot_else_its_tier() -> None:
    """The rule both executors follow (the torch executor copies by it, the simulator
    prices by it): a load whose block the step saved to its slot reads that save, a device
    copy crossing no link; a load of a slot the step saves another block into reads the
    slot as it was (loads read before saves write); a slot saved twice keeps the later."""
    saves = [KVSave(HOST, 2, 20, 0), KVSave(HOST, 5, 50, 1), KVSave(HOST, 6, 60, 1)]
    loads = [
        KVLoad(HOST, 3, 30, 0),  # slot 0 before this step's save of 20 into it
        KVLoad(HOST, 7, 50, 1),  # 50: saved by this step to slot 1, then found again
        KVLoad(STORE, 8, 20, 0),  # the store's slot 0: no save of this step goes there
    ]
    copies = step_copies(loads, saves)
    assert copies.sources == (None, 1, None)
    assert copies.written == (0, 2)  # slot 1 ends with 60, the later save
    assert copies.link_loads(loads) == {HOST: 1, STORE: 1}
    assert step_copies([], saves).written == (0, 2)
    assert step_copies(loads, []).sources == (None, None, None)
