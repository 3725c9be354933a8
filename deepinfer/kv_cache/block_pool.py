"""BlockPool: KV blocks with reference counts, an LRU of free blocks, and the
prefix-cache index of full blocks by chain hash.

A free block may still hold cached content (its hash stays in the index): it
is "evictable". Allocation takes the least recently freed block and evicts its
hash at that moment, so a cached block stays findable until it is reused.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable

from deepinfer.kv_cache.tiers import KVTiers


class KVBlock:
    __slots__ = ("block_id", "ref_cnt", "block_hash")

    def __init__(self, block_id: int) -> None:
        self.block_id = block_id
        self.ref_cnt = 0
        self.block_hash: int | None = None  # set once the block is full and cached

    def __repr__(self) -> str:
        return f"KVBlock({self.block_id}, ref={self.ref_cnt}, hash={self.block_hash})"


class BlockPool:
    """Owns every block; the only place ref counts change.

    Blocks are made as they are first taken, in id order (`blocks` holds those made so
    far: block_id == index): the simulator sizes a small model's cache on a large GPU at
    up to ~10^8 blocks, of which a run touches a few thousand. Allocation order is that
    of a free list with every block on it from the start: blocks freed without content
    first (the latest first), then never-used ones, then freed cached ones (least
    recently freed first: evicted last)."""

    def __init__(self, num_blocks: int, enable_caching: bool = True) -> None:
        if num_blocks <= 0:
            raise ValueError(f"num_blocks={num_blocks}: the KV cache needs at least one block")
        self.num_blocks = num_blocks
        self.enable_caching = enable_caching
        self.blocks: list[KVBlock] = []
        # Freed blocks, by block_id, in allocation order: without content (nothing of
        # value: reused first, latest first), and cached (least recently freed first).
        self._empty: OrderedDict[int, KVBlock] = OrderedDict()
        self._free: OrderedDict[int, KVBlock] = OrderedDict()
        self._cached: dict[int, KVBlock] = {}  # chain hash -> block holding that content
        self.num_evictions = 0
        # Hashes whose cached state changed since the last `drain_cache_changes` (None:
        # not tracked): a router's view of which prefixes the instance holds.
        self._changed: set[int] | None = None
        # Lower tiers a cached block moves down to when allocation evicts it (tiers.py);
        # None: evicted content is gone.
        self.tiers: KVTiers | None = None

    @property
    def num_free_blocks(self) -> int:
        """Blocks that can be allocated now (evictable cached blocks included)."""
        return len(self._empty) + self.num_blocks - len(self.blocks) + len(self._free)

    @property
    def num_blank_blocks(self) -> int:
        """Free blocks whose allocation evicts nothing (no cached content in them)."""
        return len(self._empty) + self.num_blocks - len(self.blocks)

    @property
    def usage(self) -> float:
        """Fraction of blocks held by requests; evictable cached blocks count as free."""
        return 1.0 - self.num_free_blocks / self.num_blocks

    def lookup(self, block_hash: int) -> KVBlock | None:
        return self._cached.get(block_hash)

    def is_free(self, block: KVBlock) -> bool:
        return block.ref_cnt == 0

    def allocate(self, n: int) -> list[KVBlock]:
        """Take `n` free blocks (LRU first), evicting their cached content.

        The caller checks `num_free_blocks` first; asking for more is a bug.
        """
        empty, blocks, num_blocks = self._empty, self.blocks, self.num_blocks
        free = len(empty) + num_blocks - len(blocks) + len(self._free)
        if n > free:
            raise RuntimeError(f"asked for {n} blocks with only {free} free")
        out = []
        for _ in range(n):
            if empty:  # (no content in these: check_invariants)
                block = empty.popitem(last=False)[1]
            elif len(blocks) < num_blocks:
                block = KVBlock(len(blocks))
                blocks.append(block)
            else:
                block = self._free.popitem(last=False)[1]
                if block.block_hash is not None:
                    if self.tiers is not None:
                        self.tiers.demote(block.block_hash, block.block_id)
                    self._evict(block)
            block.ref_cnt = 1
            out.append(block)
        return out

    def touch(self, blocks: Iterable[KVBlock]) -> None:
        """Take a reference on cached blocks found by a prefix lookup."""
        for block in blocks:
            if block.ref_cnt == 0:  # a cached block, freed behind the never-used ones
                del self._free[block.block_id]
            block.ref_cnt += 1

    def free(self, blocks: Iterable[KVBlock]) -> None:
        """Drop one reference on each block; blocks reaching zero become free.

        Pass a request's blocks tail first: freed later means evicted later, so
        the shared head of a prefix outlives its private tail.
        """
        empty, cached, caching = self._empty, self._free, self.enable_caching
        for block in blocks:
            ref_cnt = block.ref_cnt = block.ref_cnt - 1
            if ref_cnt:
                if ref_cnt < 0:
                    raise RuntimeError(f"block {block.block_id} freed more often than taken")
            elif block.block_hash is None or not caching:
                # Uncached blocks are reused first: nothing of value in them.
                empty[block.block_id] = block
                empty.move_to_end(block.block_id, last=False)
            else:
                cached[block.block_id] = block

    def cache(self, block: KVBlock, block_hash: int) -> bool:
        """Record that a held, full block holds the content named by `block_hash`;
        whether it was recorded now."""
        if not self.enable_caching or block.block_hash is not None:
            return False
        if block_hash in self._cached:
            return False  # another block already holds this content; keep the first
        block.block_hash = block_hash
        self._cached[block_hash] = block
        if self._changed is not None:
            self._changed.add(block_hash)
        return True

    def uncache(self, block: KVBlock) -> None:
        """Forget a block's content (a failed step never wrote it): no lookup finds it."""
        if block.block_hash is None:
            return
        if self._cached.get(block.block_hash) is block:
            del self._cached[block.block_hash]
            if self._changed is not None:
                self._changed.add(block.block_hash)
        block.block_hash = None

    def _evict(self, block: KVBlock) -> None:
        assert block.block_hash is not None
        if self._cached.get(block.block_hash) is block:
            del self._cached[block.block_hash]
            if self._changed is not None:
                self._changed.add(block.block_hash)
        block.block_hash = None
        self.num_evictions += 1

    def track_cache_changes(self) -> None:
        """Record from now on which content hashes become cached or stop being cached."""
        if self._changed is None:
            self._changed = set()

    def drain_cache_changes(self) -> dict[int, bool]:
        """Each hash whose cached state changed since the last drain -> whether it is
        cached now (empty when not tracked)."""
        changed = self._changed
        if not changed:
            return {}
        self._changed = set()
        cached = self._cached
        return {h: h in cached for h in changed}

    def reset_prefix_cache(self) -> None:
        """Forget every cached block that no request holds."""
        for block in self._free.values():
            if block.block_hash is not None:
                self._evict(block)

    def check_invariants(self, holders: dict[int, int]) -> None:
        """`holders`: block_id -> number of block tables that hold it."""
        made = len(self.blocks)
        for block_id in holders:
            if not 0 <= block_id < made:
                raise AssertionError(f"block {block_id}: held but never allocated")
        for block in self.blocks:
            held = holders.get(block.block_id, 0)
            if block.ref_cnt != held:
                raise AssertionError(
                    f"block {block.block_id}: ref_cnt {block.ref_cnt} != {held} tables holding it"
                )
            in_free = (block.block_id in self._free) + (block.block_id in self._empty)
            if in_free != (block.ref_cnt == 0):
                raise AssertionError(f"block {block.block_id}: free-list membership is wrong")
            if block.block_hash is not None and self._cached.get(block.block_hash) is not block:
                raise AssertionError(f"block {block.block_id}: cached hash not in the index")
            if block.block_hash is not None and block.block_id in self._empty:
                raise AssertionError(f"block {block.block_id}: cached, on the list of empty ones")
        free = sum(b.ref_cnt == 0 for b in self.blocks)
        if len(self._free) + len(self._empty) != free:
            raise AssertionError(
                f"{len(self._free)} + {len(self._empty)} blocks on the free lists, "
                f"{free} made blocks free"
            )
        for h, block in self._cached.items():
            if block.block_hash != h:
                raise AssertionError(f"index entry {h} points at block {block.block_id}")
