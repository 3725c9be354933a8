"""The KV tiers below HBM (deepinfer/kv_cache/tiers.py) against a reference model of their
rules (docs/design.md, "KV tiers below HBM"), as a hypothesis state machine, and a
step's copies (`step_copies`) against the copy rule restated.

The model keeps, per tier, its own LRU list and each held block's slot, and per engine
its counts and the saves it owes the executor. Its rules, from the specification:

- a block HBM evicts goes down to the engine's first tier; one that tier holds already
  is only made its most recently used there (nothing written, no save); otherwise it is
  written (a save of its HBM block, when that tier is the first), and the tier's least
  recently used block, if it is full, moves on the same way to the next tier, whose own
  victim is dropped when it is the last;
- a slot is in [0, capacity) and no two held blocks share one; a held block keeps its
  slot, and a block that pushes another out takes its slot (a free slot otherwise: the
  model takes the one the tier chose, and checks it was free);
- a lookup finds the nearest tier holding a block (host first); a load makes it that
  tier's most recently used and leaves it there;
- the counts: per tier, blocks written, read back and dropped (a shared store counts
  every engine's); per engine, what it wrote and read per tier and dropped.

Two engines may share one store (the same `TierLRU`), as a cluster's instances do.
"""

from __future__ import annotations

import copy

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, rule

from deepinfer.kv_cache.manager import KVCacheManager
from deepinfer.kv_cache.tiers import HOST, STORE, KVTiers, TierLRU, step_copies
from deepinfer.outputs import KVLoad, KVSave
from tests.property.harness import note
from tests.property.strategies import scaled


class TierModel:
    def __init__(self, name: str, capacity: int) -> None:
        self.name, self.capacity = name, capacity
        self.lru: list[int] = []  # least recently used first
        self.slots: dict[int, int] = {}
        self.saved = self.loaded = self.dropped = 0

    def touch(self, h: int) -> None:
        self.lru.remove(h)
        self.lru.append(h)


class EngineModel:
    def __init__(self, tiers: list[TierModel]) -> None:
        self.tiers = tiers
        self.saved = dict.fromkeys((HOST, STORE), 0)
        self.loaded = dict.fromkeys((HOST, STORE), 0)
        self.dropped = 0
        self.saves: list[KVSave] = []

    def find(self, h: int) -> TierModel | None:
        return next((t for t in self.tiers if h in t.slots), None)


class TiersMachine(RuleBasedStateMachine):
    @initialize(
        host=st.lists(st.sampled_from([0, 1, 2, 3]), min_size=1, max_size=2),
        store=st.sampled_from([0, 1, 2, 4]),
    )
    def setup(self, host: list[int], store: int) -> None:
        """One or two engines, each with a host tier or none; a store they share, or none
        (an engine without a host tier always gets one then)."""
        if not store and not all(host):
            store = 2
        shared = TierLRU(STORE, store) if store else None
        store_model = TierModel(STORE, store) if store else None
        self.tiers: list[KVTiers] = []
        self.models: list[EngineModel] = []
        for cap in host:
            own = TierLRU(HOST, cap) if cap else None
            tiers = KVTiers(own, shared)
            assert tiers.host is own and tiers.store is shared
            assert tiers.shares_store == (shared is not None)
            self.tiers.append(tiers)
            chain = ([TierModel(HOST, cap)] if cap else []) + ([store_model] if store_model else [])
            self.models.append(EngineModel(chain))  # type: ignore[arg-type]
        self.lru_by_model = {
            id(m): t
            for tiers, em in zip(self.tiers, self.models)
            for m, t in zip(em.tiers, tiers.order)
        }

    def _tier(self, m: TierModel) -> TierLRU:
        return self.lru_by_model[id(m)]

    @rule(pick=st.integers(0, 1), h=st.integers(0, 9), block_id=st.integers(0, 7))
    def demote(self, pick: int, h: int, block_id: int) -> None:
        e = pick % len(self.tiers)
        tiers, model = self.tiers[e], self.models[e]
        tiers.demote(h, block_id)
        pushed: int | None = h
        for k, t in enumerate(model.tiers):
            assert pushed is not None
            if pushed in t.slots:
                t.touch(pushed)
                note(f"a demotion stopped at {t.name}: held there already")
                return
            victim = t.lru.pop(0) if len(t.lru) == t.capacity else None
            if victim is not None:
                slot = t.slots.pop(victim)
            else:
                slot = self._tier(t).slot(pushed)  # a free slot: the tier's choice, checked
                assert 0 <= slot < t.capacity and slot not in t.slots.values(), (t.name, slot)
            t.lru.append(pushed)
            t.slots[pushed] = slot
            t.saved += 1
            model.saved[t.name] += 1
            if k == 0:
                model.saves.append(KVSave(t.name, block_id, pushed, slot))
            pushed = victim
            if pushed is None:
                return
        note("a block dropped past the last tier")
        model.dropped += 1
        model.tiers[-1].dropped += 1

    @rule(pick=st.integers(0, 1), h=st.integers(0, 9))
    def load(self, pick: int, h: int) -> None:
        e = pick % len(self.tiers)
        tiers, model = self.tiers[e], self.models[e]
        found, want = tiers.find(h), model.find(h)
        if want is None:
            assert found is None, (h, found.name if found else None)
            return
        assert found is self._tier(want), (h, want.name)
        if len(model.tiers) > 1 and want is model.tiers[1]:
            note("a block found in the store")
        tiers.read(found, h)
        want.touch(h)
        want.loaded += 1
        model.loaded[want.name] += 1

    @rule(pick=st.integers(0, 1))
    def take_saves(self, pick: int) -> None:
        e = pick % len(self.tiers)
        got = self.tiers[e].take_saves()
        assert got == self.models[e].saves
        self.models[e].saves = []
        assert self.tiers[e].take_saves() == []

    @rule(pick=st.integers(0, 1))
    def overfilled_tier_is_refused(self, pick: int) -> None:
        """A copy of the tiers with a tier forced past its capacity fails its check,
        naming the tier and both counts."""
        broken = copy.deepcopy(self.tiers[pick % len(self.tiers)])
        tier = broken.order[-1]
        for h in range(100, 100 + tier.capacity + 1 - len(tier)):
            tier._lru[h] = 0
        with pytest.raises(AssertionError) as err:
            broken.check_invariants()
        assert f"{tier.name}: {tier.capacity + 1} blocks" in str(err.value)
        assert f"capacity {tier.capacity}" in str(err.value)

    @invariant()
    def tiers_are_the_model(self) -> None:
        for tiers, model in zip(self.tiers, self.models):
            tiers.check_invariants()
            assert [t.name for t in tiers.order] == [t.name for t in model.tiers]
            for tier, t in zip(tiers.order, model.tiers):
                assert tier.hashes() == t.lru, (t.name, tier.hashes(), t.lru)
                assert len(tier) == len(t.lru) and all(h in tier for h in t.lru)
                assert {h: tier.slot(h) for h in t.lru} == t.slots, t.name
                counts = (tier.num_saved, tier.num_loaded, tier.num_dropped)
                assert counts == (t.saved, t.loaded, t.dropped), (t.name, counts)
            assert (tiers.saved, tiers.loaded, tiers.dropped) == (
                model.saved,
                model.loaded,
                model.dropped,
            )


TiersMachine.TestCase.settings = settings(scaled(0.1, floor=30), stateful_step_count=30)
test_tiers_follow_their_rules = TiersMachine.TestCase


def test_tiers_refuse_what_they_cannot_be() -> None:
    """A tier of an unknown name or no capacity, tiers of none or misnamed, refused by name;
    so are tiers under a KV manager without prefix caching (they hold prefix-cache
    blocks), which is on by default."""
    with pytest.raises(ValueError, match=r"tier 'hbm': expected one of \('host', 'store'\)"):
        TierLRU("hbm", 2)
    with pytest.raises(ValueError, match="tier store: capacity 0 blocks: must be >= 1"):
        TierLRU(STORE, 0)
    assert TierLRU(HOST, 1).capacity == 1
    with pytest.raises(ValueError, match="^KVTiers: configure a host tier, a store, or both$"):
        KVTiers()
    with pytest.raises(ValueError, match="KVTiers: host tier named 'store'"):
        KVTiers(TierLRU(STORE, 1))
    with pytest.raises(ValueError, match="KVTiers: store tier named 'host'"):
        KVTiers(None, TierLRU(HOST, 1))
    tiers = KVTiers(TierLRU(HOST, 1))
    need = "^KV tiers below HBM hold prefix-cache blocks: they need prefix caching on$"
    with pytest.raises(ValueError, match=need):
        KVCacheManager(4, 4, enable_caching=False, tiers=tiers)
    assert KVCacheManager(4, 4, tiers=tiers).enable_caching


_TIER = st.sampled_from([HOST, STORE])
_saves = st.builds(KVSave, _TIER, st.integers(0, 5), st.integers(0, 3), st.integers(0, 2))
_loads = st.builds(KVLoad, _TIER, st.integers(0, 5), st.integers(0, 3), st.integers(0, 2))


@scaled(0.2, floor=60)
@given(loads=st.lists(_loads, max_size=5), saves=st.lists(_saves, max_size=5))
def test_step_copies_follow_the_copy_rule(loads: list[KVLoad], saves: list[KVSave]) -> None:
    """A load reads a save of the step of its hash to its tier's slot where one exists, its
    tier's slot otherwise (over the tier's link); of the saves to one slot the last is
    written; the loads crossing each link are counted."""
    copies = step_copies(loads, saves)
    assert len(copies.sources) == len(loads)
    for ld, j in zip(loads, copies.sources):
        same = [
            s for s in saves if (s.tier, s.slot, s.block_hash) == (ld.tier, ld.slot, ld.block_hash)
        ]
        if not same:
            assert j is None, (ld, j)
            continue
        note("a load reads the step's own save")
        assert j is not None and saves[j] in same, (ld, j)
    last = [
        j
        for j, s in enumerate(saves)
        if not any((t.tier, t.slot) == (s.tier, s.slot) for t in saves[j + 1 :])
    ]
    assert list(copies.written) == last
    crossing = [ld.tier for ld, j in zip(loads, copies.sources) if j is None]
    assert copies.link_loads(loads) == {t: crossing.count(t) for t in set(crossing)}
