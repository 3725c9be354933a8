"""KV cache tiers below HBM: where a cached prefix block lives once HBM evicts it.

Three places, by chain hash: HBM (the BlockPool's index), the engine's host DRAM, and a
store that several engines share (Mooncake's design). The rules:

- A prefix block HBM evicts moves down to the host tier (if configured, else to the
  store); the host tier's least recently used block moves to the store; the store's is
  dropped. A block already in a tier is only made its most recently used: its copy there
  is still valid (a prefix block's KV never changes), so nothing is written again.
- A prefix lookup that stops in HBM goes on in the lower tiers (host first: it is the
  nearer one). A block found there is loaded into a freshly allocated HBM block (cached
  there again) before the step that first uses it, and counts as computed.
- A loaded block stays in its tier (a copy, made its most recently used): the store is
  shared, so moving a block out would take it from the other engines; and for the host
  tier a copy makes the block's next eviction from HBM free (it is already there),
  where a move would copy it back over PCIe. The cost is capacity: a block may be in
  HBM and in a lower tier at once (never twice in one place).
- Loads are read before the evictions of the same allocation are written (the executor
  reads a step's loads before it writes its saves): a block being loaded may be the
  victim of the same allocation's demotions without being lost. A block one allocation
  of a step evicts and a later one finds again is loaded from that save.

Each block a tier holds has a slot, [0, capacity): where its copy lives. A block pushed
out gives its slot to the block that pushed it, so a tier's slots are a fixed buffer the
executor allocates once. What the executor copies comes with each step: its loads
(`SchedulerOutput.kv_loads`: tier, slot, HBM block) and its saves (`kv_saves`: the HBM
blocks the step's allocations evicted into the first lower tier, with the slot each
takes; `KVTiers.take_saves`). A block moving on from the host tier to the store is
bookkeeping only: no executor copies it (the torch executor keeps a host tier and
refuses a store, a simulator plan).

How a step's copies are made is a rule here too (`step_copies`), so that the executor
performs and the simulator prices the same copies: a load whose block the same step
saved to its slot reads the save (a device copy of the block as the step found it in
HBM), any other load reads its tier (over the tier's link); a slot the step saves twice
ends with the later save.

Pure bookkeeping: capacities and counts in blocks. What a move costs (bytes over a link)
is the simulator's (sim/kv_tiers.py); the torch executor performs the host tier's copies
(executors/host_kv_tier.py).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from typing import NamedTuple

from deepinfer.outputs import KVLoad, KVSave

HBM, HOST, STORE = "hbm", "host", "store"
LOWER_TIERS = (HOST, STORE)


class TierLRU:
    """One lower tier: up to `capacity` block hashes, least recently used first, each in
    its slot.

    `num_saved` / `num_loaded` / `num_dropped`: blocks written into it, read back from
    it, and dropped from it (for a shared store: over every engine that shares it)."""

    __slots__ = ("name", "capacity", "_lru", "num_saved", "num_loaded", "num_dropped")

    def __init__(self, name: str, capacity: int) -> None:
        if name not in LOWER_TIERS:
            raise ValueError(f"tier {name!r}: expected one of {LOWER_TIERS}")
        if capacity < 1:
            raise ValueError(f"tier {name}: capacity {capacity} blocks: must be >= 1")
        self.name = name
        self.capacity = capacity
        self._lru: OrderedDict[int, int] = OrderedDict()  # block hash -> its slot
        self.num_saved = 0
        self.num_loaded = 0
        self.num_dropped = 0

    def __contains__(self, block_hash: int) -> bool:
        return block_hash in self._lru

    def __len__(self) -> int:
        return len(self._lru)

    def hashes(self) -> list[int]:
        """The hashes held, least recently used first."""
        return list(self._lru)

    def slot(self, block_hash: int) -> int:
        """Where the tier holds `block_hash`'s copy: [0, capacity)."""
        return self._lru[block_hash]

    def put(self, block_hash: int) -> int | None:
        """Write a block (or make it the most recently used, if held); returns the hash it
        pushed out past the capacity (whose slot it takes), or None."""
        lru = self._lru
        if block_hash in lru:
            lru.move_to_end(block_hash)
            return None
        victim = None
        if len(lru) < self.capacity:  # (blocks leave only when pushed out: slots fill in order)
            slot = len(lru)
        else:
            victim, slot = lru.popitem(last=False)
        lru[block_hash] = slot
        self.num_saved += 1
        return victim

    def read(self, block_hash: int) -> None:
        """A block loaded back into HBM: it stays here, the most recently used."""
        self._lru.move_to_end(block_hash)
        self.num_loaded += 1


class KVTiers:
    """One engine's lower tiers: its own host DRAM and a store it may share with other
    engines (the same `TierLRU` object), either of them absent.

    Per engine, by tier: `saved` (blocks this engine wrote there) and `loaded` (blocks it
    read back)."""

    __slots__ = ("host", "store", "order", "saved", "loaded", "dropped", "_saves")

    def __init__(self, host: TierLRU | None = None, store: TierLRU | None = None) -> None:
        if host is None and store is None:
            raise ValueError("KVTiers: configure a host tier, a store, or both")
        if host is not None and host.name != HOST:
            raise ValueError(f"KVTiers: host tier named {host.name!r}")
        if store is not None and store.name != STORE:
            raise ValueError(f"KVTiers: store tier named {store.name!r}")
        self.host = host
        self.store = store
        self.order: tuple[TierLRU, ...] = tuple(t for t in (host, store) if t is not None)
        self.saved = dict.fromkeys(LOWER_TIERS, 0)
        self.loaded = dict.fromkeys(LOWER_TIERS, 0)
        self.dropped = 0  # blocks this engine's evictions pushed out of its last tier
        self._saves: list[KVSave] = []  # HBM blocks written down since `take_saves`

    @property
    def shares_store(self) -> bool:
        return self.store is not None

    def demote(self, block_hash: int, block_id: int) -> None:
        """HBM evicted block `block_id`, holding `block_hash`: down one tier (a save, unless
        the tier holds it already), the victims of each tier down the next; the last
        tier's victim is dropped."""
        pushed: int | None = block_hash
        for tier in self.order:
            assert pushed is not None
            before = tier.num_saved
            moved, pushed = pushed, tier.put(pushed)
            if tier.num_saved != before:
                self.saved[tier.name] += 1
                if tier is self.order[0]:  # written from HBM (a lower tier's, from above)
                    self._saves.append(KVSave(tier.name, block_id, moved, tier.slot(moved)))
            if pushed is None:
                return
        self.dropped += 1
        self.order[-1].num_dropped += 1

    def take_saves(self) -> list[KVSave]:
        """The HBM blocks written down since the last call, in eviction order: the step
        being scheduled copies them before it overwrites them."""
        saves, self._saves = self._saves, []
        return saves

    def find(self, block_hash: int) -> TierLRU | None:
        """The nearest lower tier holding `block_hash`, or None."""
        for tier in self.order:
            if block_hash in tier:
                return tier
        return None

    def read(self, tier: TierLRU, block_hash: int) -> None:
        tier.read(block_hash)
        self.loaded[tier.name] += 1

    def check_invariants(self) -> None:
        for tier in self.order:
            if len(tier) > tier.capacity:
                raise AssertionError(
                    f"tier {tier.name}: {len(tier)} blocks over its capacity {tier.capacity}"
                )


class StepCopies(NamedTuple):
    """How one step's copies are made (`step_copies`), by the executor and as the simulator
    prices them."""

    # per load (SchedulerOutput.kv_loads): the index in kv_saves of the save it reads (the
    # step evicted its block, then found it again), or None: it reads its tier's slot
    sources: tuple[int | None, ...]
    # the indices in kv_saves of the saves written, ascending: per (tier, slot) the last
    written: tuple[int, ...]

    def link_loads(self, loads: Sequence[KVLoad]) -> dict[str, int]:
        """tier -> how many of `loads` (the loads these copies were made of) cross that
        tier's link; a load from the step's own save is a device copy, and crosses none."""
        counts: dict[str, int] = {}
        for load, source in zip(loads, self.sources):
            if source is None:
                counts[load.tier] = counts.get(load.tier, 0) + 1
        return counts


def step_copies(loads: Sequence[KVLoad], saves: Sequence[KVSave]) -> StepCopies:
    """The copies of a step that loads `loads` and saves `saves` (its kv_loads, kv_saves).

    The rule (module docstring; the core's read-before-write of one allocation): a load
    reads the step's save of its hash to its slot where there is one, the slot as the
    steps before left it otherwise; the saves are written after the loads have read, and
    a slot saved twice keeps the later.

    A load is matched to a save by (tier, slot, hash), not by their order in the step:
    this holds because a block a step loads is never freed, evicted and saved again within
    that step (loads come only with a request's start, which never preempts), so a save
    matching a load always precedes it."""
    saved_at = {(s.tier, s.slot, s.block_hash): j for j, s in enumerate(saves)}
    sources = tuple(saved_at.get((ld.tier, ld.slot, ld.block_hash)) for ld in loads)
    last = {(s.tier, s.slot): j for j, s in enumerate(saves)}
    return StepCopies(sources, tuple(sorted(last.values())))
