"""KVCacheManager: which blocks each request holds, prefix lookups, allocation.

`allocate` is the one call that either takes every block a step needs or
takes nothing and returns None (then the scheduler preempts or waits); there
is no separate check-then-act.
"""

from __future__ import annotations

from collections.abc import Sequence

from deepinfer.kv_cache.block_pool import BlockPool, KVBlock
from deepinfer.kv_cache.hashing import update_block_hashes
from deepinfer.kv_cache.tiers import HBM, LOWER_TIERS, KVTiers, TierLRU
from deepinfer.outputs import KVLoad, KVSave
from deepinfer.request import Request

# A prefix block found in a lower tier: its chain hash and the tier holding it.
TierHit = tuple[int, TierLRU]


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


class KVCacheManager:
    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        enable_caching: bool = True,
        tiers: KVTiers | None = None,
    ) -> None:
        if tiers is not None and not enable_caching:
            raise ValueError(
                "KV tiers below HBM hold prefix-cache blocks: they need prefix caching on"
            )
        self.block_size = block_size
        self.enable_caching = enable_caching
        self.pool = BlockPool(num_blocks, enable_caching)
        self.tiers = tiers  # lower tiers evicted prefix blocks move to (kv_cache/tiers.py)
        self.pool.tiers = tiers
        self._loads_ahead: list[KVLoad] = []  # loads of the step being scheduled (take_loads)
        self.req_blocks: dict[str, list[KVBlock]] = {}  # req_id -> its block table
        self._num_cached: dict[str, int] = {}  # req_id -> leading blocks registered in the cache
        self._cached_ahead: list[KVBlock] = []  # cached while scheduling (take_cached_ahead)
        self.num_lookup_tokens = 0  # prompt tokens looked up
        self.num_hit_tokens = 0  # of those, found in the cache
        # Over the requests started with a lookup: prompt blocks a lookup could cover, and
        # of those the blocks found, by tier ("hbm", "host", "store").
        self.num_prefix_blocks_looked_up = 0
        self.prefix_hit_blocks = dict.fromkeys((HBM, *LOWER_TIERS), 0)

    @property
    def num_blocks(self) -> int:
        return self.pool.num_blocks

    @property
    def usage(self) -> float:
        return self.pool.usage

    def holds_blocks(self, req_id: str) -> bool:
        return req_id in self.req_blocks

    def num_cached_blocks(self, req_id: str) -> int:
        """Leading blocks of the request registered in the prefix cache so far."""
        return self._num_cached.get(req_id, 0)

    def block_ids(self, req_id: str) -> list[int]:
        return [b.block_id for b in self.req_blocks.get(req_id, ())]

    def find_cached_prefix(self, request: Request) -> list[KVBlock]:
        """Longest run of cached blocks matching the request's leading tokens.

        At most `num_tokens - 1` tokens are covered: the last token must be
        computed so that the step produces logits to sample from.
        """
        if not self.enable_caching:
            return []
        bs, num_tokens, lookup = self.block_size, request.num_tokens, self.pool.lookup
        hits: list[KVBlock] = []
        for h in update_block_hashes(request, bs)[: (num_tokens - 1) // bs]:
            block = lookup(h)
            if block is None:
                break
            hits.append(block)
        self.num_lookup_tokens += num_tokens
        self.num_hit_tokens += len(hits) * bs
        return hits

    def find_tier_hits(self, request: Request, start: int) -> list[TierHit]:
        """The request's prefix blocks from block `start` on (past its HBM hits) found in
        the lower tiers, up to the first block in none of them (or back in HBM: a block
        behind a missing one is left to the computation). The same limit as
        `find_cached_prefix`: the last token is computed. Empty without tiers."""
        tiers = self.tiers
        if tiers is None:
            return []
        hashes = request.block_hashes  # (find_cached_prefix brought them up to date)
        limit = (request.num_tokens - 1) // self.block_size
        hits: list[TierHit] = []
        lookup = self.pool.lookup
        for h in hashes[start:limit]:
            tier = tiers.find(h)
            if tier is None or lookup(h) is not None:
                break
            hits.append((h, tier))
        return hits

    def count_lookup(self, request: Request, num_hbm_hits: int, loads: Sequence[TierHit]) -> None:
        """A request started with a prefix lookup: its hits by tier, over its prompt blocks a
        lookup could cover."""
        self.num_prefix_blocks_looked_up += (request.num_tokens - 1) // self.block_size
        hit = self.prefix_hit_blocks
        hit[HBM] += num_hbm_hits
        for _, tier in loads:
            hit[tier.name] += 1

    def allocate(
        self,
        request: Request,
        num_new_tokens: int,
        cached: Sequence[KVBlock] = (),
        *,
        reserve_tokens: int = 0,
        num_draft_tokens: int = 0,
        num_lookahead_tokens: int = 0,
        loads: Sequence[TierHit] = (),
    ) -> list[KVBlock] | None:
        """Give `request` the blocks to compute `num_new_tokens` more tokens.

        `cached`: prefix-cache hits to take first (the request then starts at
        `len(cached) * block_size` computed tokens). `reserve_tokens`: hold
        blocks for at least this many tokens (a chunked prefill reserves its
        whole prompt with its first chunk). `num_lookahead_tokens`: slots past the
        step's tokens that the drafter writes (chained MTP drafts' KV). Returns the blocks appended to the
        request's table (hits first), or None, having changed nothing, when
        the free blocks do not suffice or a hit no longer holds the content the
        lookup found (another allocation evicted it in between: look up again).
        """
        bs = self.block_size
        if cached:
            for block, block_hash in zip(cached, request.block_hashes):
                if block.block_hash != block_hash:
                    return None
        req_id = request.request_id
        held = self.req_blocks.get(req_id)
        num_computed = request.num_computed_tokens
        if cached or loads:
            num_computed += (len(cached) + len(loads)) * bs
        need_tokens = num_computed + num_new_tokens + num_lookahead_tokens
        if reserve_tokens > need_tokens:
            need_tokens = reserve_tokens
        num_needed = -(-need_tokens // bs) - len(cached)
        if held:
            num_needed -= len(held)
        if num_needed > 0:
            # Hits that sit in the free list stop being allocatable once touched.
            num_free_hits = sum(1 for b in cached if b.ref_cnt == 0) if cached else 0
            if num_needed > self.pool.num_free_blocks - num_free_hits:
                return None
        else:
            num_needed = 0
        if held is None:
            held = self.req_blocks[req_id] = []
            self._num_cached[req_id] = 0
        if cached or loads:
            self.pool.touch(cached)
            new = list(cached)
            slots = []
            if loads:  # read before this allocation's evictions are written below them
                tiers = self.tiers
                assert tiers is not None
                for h, tier in loads:
                    tiers.read(tier, h)
                    slots.append(tier.slot(h))  # (the evictions below may reuse it)
            fresh = self.pool.allocate(num_needed)
            for (h, tier), slot, block in zip(loads, slots, fresh):
                self._loads_ahead.append(KVLoad(tier.name, block.block_id, h, slot))
            new.extend(fresh)
            self._num_cached[req_id] = len(cached)
            held.extend(new)
        elif num_needed:  # most calls: a decode token, in a block already held or one new
            new = self.pool.allocate(num_needed)
            held.extend(new)
        else:
            new = []
        # Drafts may be rejected: never cache blocks whose content is a guess.
        num_full = (num_computed + num_new_tokens - num_draft_tokens) // bs
        if self.enable_caching and num_full > self._num_cached[req_id]:  # (most calls: not)
            self._cache_full_blocks(request, num_full, True)
        return new

    def _cache_full_blocks(self, request: Request, num_full: int, ahead: bool) -> None:
        """Register the request's leading `num_full` blocks (those of them its known tokens
        fill) in the prefix cache. ahead: the tokens are being scheduled, not yet computed
        (`take_cached_ahead`)."""
        req_id = request.request_id
        start = self._num_cached[req_id]
        known = request.num_tokens // self.block_size
        if known < num_full:
            num_full = known
        if num_full <= start:
            return
        hashes = request.block_hashes
        if len(hashes) < num_full:
            hashes = update_block_hashes(request, self.block_size)
        blocks, cache = self.req_blocks[req_id], self.pool.cache
        for i in range(start, num_full):
            if cache(blocks[i], hashes[i]) and ahead:
                self._cached_ahead.append(blocks[i])
        self._num_cached[req_id] = num_full

    def take_loads(self) -> list[KVLoad]:
        """The lower-tier loads of allocations since the last call: the step being
        scheduled needs them in its blocks before it runs."""
        loads, self._loads_ahead = self._loads_ahead, []
        return loads

    def take_saves(self) -> list[KVSave]:
        """The blocks allocations evicted into a lower tier since the last call (the
        step being scheduled copies them out before it overwrites them); empty without
        tiers."""
        return self.tiers.take_saves() if self.tiers is not None else []

    def take_cached_ahead(self) -> list[KVBlock]:
        """The blocks cached by allocations since the last call: their content is the
        step being scheduled, written only if that step runs (else `forget`)."""
        blocks, self._cached_ahead = self._cached_ahead, []
        return blocks

    def forget(self, blocks: Sequence[KVBlock]) -> None:
        """Un-cache blocks whose step failed: no later lookup finds their (unwritten)
        content."""
        for block in blocks:
            self.pool.uncache(block)

    def cache_computed(self, request: Request) -> None:
        """Register blocks that became full once sampled tokens were appended: up to the
        newest token, whose KV the next step writes (under async scheduling the computed
        count already covers that step, which may still fail)."""
        req_id = request.request_id
        if req_id in self.req_blocks:
            computed = request.num_computed_tokens
            if computed // self.block_size <= self._num_cached[req_id] or not self.enable_caching:
                return  # (most calls: no block filled; `_cache_full_blocks` would return)
            last = request.num_tokens - 1
            num_full = (computed if computed < last else last) // self.block_size
            self._cache_full_blocks(request, num_full, False)

    def trim(self, request: Request, num_tokens: int) -> None:
        """Free blocks past what `num_tokens` tokens need (rejected draft slots)."""
        blocks = self.req_blocks.get(request.request_id)
        if not blocks:
            return
        keep = max(cdiv(num_tokens, self.block_size), self._num_cached[request.request_id])
        if len(blocks) > keep:
            surplus = blocks[keep:]
            del blocks[keep:]
            self.pool.free(reversed(surplus))

    def free(self, request: Request) -> None:
        """Release every block the request holds (tail first)."""
        blocks = self.req_blocks.pop(request.request_id, None)
        self._num_cached.pop(request.request_id, None)
        if blocks:
            self.pool.free(reversed(blocks))

    def check_invariants(self) -> None:
        holders: dict[int, int] = {}
        for req_id, blocks in self.req_blocks.items():
            ids = [b.block_id for b in blocks]
            if len(set(ids)) != len(ids):
                raise AssertionError(f"{req_id} holds a block twice: {ids}")
            for b in ids:
                holders[b] = holders.get(b, 0) + 1
        self.pool.check_invariants(holders)
        if self.tiers is not None:
            self.tiers.check_invariants()
