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
  issues a step's loads first on its copy stream, then its saves): a block being
  loaded may be the victim of the same allocation's demotions without being lost.

Pure bookkeeping: capacities and counts in blocks. What a move costs (bytes over a link)
is the simulator's (sim/kv_tiers.py); the torch executor refuses the tiers until it
performs the copies.
"""

from __future__ import annotations

from collections import OrderedDict

HBM, HOST, STORE = "hbm", "host", "store"
LOWER_TIERS = (HOST, STORE)


class TierLRU:
    """One lower tier: up to `capacity` block hashes, least recently used first.

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
        self._lru: OrderedDict[int, None] = OrderedDict()
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

    def put(self, block_hash: int) -> int | None:
        """Write a block (or make it the most recently used, if held); returns the hash it
        pushed out past the capacity, or None."""
        lru = self._lru
        if block_hash in lru:
            lru.move_to_end(block_hash)
            return None
        lru[block_hash] = None
        self.num_saved += 1
        if len(lru) > self.capacity:
            victim, _ = lru.popitem(last=False)
            return victim
        return None

    def read(self, block_hash: int) -> None:
        """A block loaded back into HBM: it stays here, the most recently used."""
        self._lru.move_to_end(block_hash)
        self.num_loaded += 1


class KVTiers:
    """One engine's lower tiers: its own host DRAM and a store it may share with other
    engines (the same `TierLRU` object), either of them absent.

    Per engine, by tier: `saved` (blocks this engine wrote there) and `loaded` (blocks it
    read back)."""

    __slots__ = ("host", "store", "order", "saved", "loaded", "dropped")

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

    @property
    def shares_store(self) -> bool:
        return self.store is not None

    def demote(self, block_hash: int) -> None:
        """HBM evicted the block holding `block_hash`: down one tier, the victims of each
        tier down the next; the last tier's victim is dropped."""
        pushed: int | None = block_hash
        for tier in self.order:
            assert pushed is not None
            before = tier.num_saved
            pushed = tier.put(pushed)
            self.saved[tier.name] += tier.num_saved - before
            if pushed is None:
                return
        self.dropped += 1
        self.order[-1].num_dropped += 1

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
