"""BlockPool and KVCacheManager: ref counts, the free LRU, prefix hits."""

from __future__ import annotations

import pytest

from deepinfer.kv_cache.block_pool import BlockPool, KVBlock
from deepinfer.kv_cache.hashing import update_block_hashes
from deepinfer.kv_cache.manager import KVCacheManager
from deepinfer.request import Request
from deepinfer.scheduler import Scheduler
from tests.factories import make_config, make_request


def test_allocate_and_free_track_ref_counts() -> None:
    pool = BlockPool(4)
    blocks = pool.allocate(3)
    assert [b.ref_cnt for b in blocks] == [1, 1, 1]
    assert pool.num_free_blocks == 1
    assert pool.usage == pytest.approx(0.75)
    pool.free(blocks)
    assert pool.num_free_blocks == 4
    with pytest.raises(RuntimeError, match="^block 0 freed more often than taken$"):
        pool.free(blocks[:1])


def test_allocating_more_than_free_is_a_bug() -> None:
    pool = BlockPool(2)
    with pytest.raises(RuntimeError, match="^asked for 3 blocks with only 2 free$"):
        pool.allocate(3)


def test_a_cache_of_no_blocks_is_refused_naming_the_count() -> None:
    """An executor that finds no room for one KV block is told so, not a ZeroDivisionError."""
    with pytest.raises(ValueError, match="^num_blocks=0: the KV cache needs at least one block$"):
        Scheduler(make_config(), 0)
    with pytest.raises(ValueError, match="^num_blocks=-1: "):
        BlockPool(-1)


def test_is_free_follows_the_reference_count() -> None:
    pool = BlockPool(2)
    a, b = pool.allocate(2)
    pool.touch([a])
    assert not pool.is_free(a) and not pool.is_free(b)
    pool.free([a, b])
    assert not pool.is_free(a) and pool.is_free(b)
    pool.free([a])
    assert pool.is_free(a)


def test_caching_a_block_is_a_no_op_when_off_or_when_it_already_holds_content() -> None:
    off = BlockPool(1, enable_caching=False)
    (x,) = off.allocate(1)
    off.cache(x, 5)
    assert x.block_hash is None and off.lookup(5) is None
    pool = BlockPool(2)
    a, b = pool.allocate(2)
    pool.cache(a, 5)
    pool.cache(a, 6)  # a block's content does not change once full: the first hash stays
    pool.cache(b, 5)  # the same content in another block: the first one stays indexed
    assert a.block_hash == 5 and b.block_hash is None
    assert pool.lookup(5) is a and pool.lookup(6) is None
    pool.check_invariants({a.block_id: 1, b.block_id: 1})


def test_free_cached_blocks_count_as_free_and_evict_lru() -> None:
    pool = BlockPool(3)
    a, b, c = pool.allocate(3)
    pool.cache(a, 111)
    pool.cache(b, 222)
    pool.free([a])  # freed first: evicted first
    pool.free([b])
    assert pool.usage == pytest.approx(1 / 3)
    assert pool.lookup(111) is a and pool.lookup(222) is b
    (taken,) = pool.allocate(1)
    assert taken is a and pool.lookup(111) is None and pool.lookup(222) is b
    assert pool.num_evictions == 1


def test_touch_revives_a_free_cached_block() -> None:
    pool = BlockPool(2)
    (a,) = pool.allocate(1)
    pool.cache(a, 7)
    pool.free([a])
    pool.touch([a])
    assert a.ref_cnt == 1 and pool.num_free_blocks == 1
    pool.touch([a])
    assert a.ref_cnt == 2
    pool.check_invariants({a.block_id: 2})


def test_chain_hash_depends_on_the_whole_prefix() -> None:
    r1 = make_request("a", [1, 2, 3, 4, 5, 6, 7, 8])
    r2 = make_request("b", [9, 9, 9, 9, 5, 6, 7, 8])
    h1 = update_block_hashes(r1, 4)
    h2 = update_block_hashes(r2, 4)
    assert len(h1) == 2 and h1[0] != h2[0] and h1[1] != h2[1]  # same 2nd block, other parent


def test_block_keys_are_each_blocks_content_key() -> None:
    """The keys of a run of blocks in one call are content_key's, block by block: in the
    prompt, across its end and in the outputs."""
    r = make_request("a", [1, 2, 3, 4, 5, 6, 7])
    r.append_output_tokens([8, 9, 10, 11, 12])
    for size in (1, 3, 4, 5):
        for stop in range(r.num_tokens // size + 1):
            for first in range(stop + 1):
                spans = range(first * size, stop * size, size)
                assert r.block_keys(first, stop, size) == [
                    r.content_key(s, s + size) for s in spans
                ]


def test_prefix_hit_covers_at_most_num_tokens_minus_one() -> None:
    kv = KVCacheManager(num_blocks=8, block_size=4)
    first = make_request("a", 8)
    assert kv.allocate(first, 8) is not None
    kv.free(first)
    again = make_request("b", 8)  # identical 8-token prompt: 2 full blocks cached
    hits = kv.find_cached_prefix(again)
    assert len(hits) == 1  # the last token must be computed, so only 1 block is reused
    longer = make_request("c", list(range(1, 10)))
    assert len(kv.find_cached_prefix(longer)) == 2


def test_allocate_is_all_or_nothing() -> None:
    kv = KVCacheManager(num_blocks=3, block_size=4)
    r = make_request("a", 20)
    assert kv.allocate(r, 20) is None
    assert kv.pool.num_free_blocks == 3 and not kv.holds_blocks("a")


def test_a_free_hit_is_not_counted_twice_as_free() -> None:
    """A hit sitting in the free list cannot also be handed out as a new block."""
    kv = KVCacheManager(num_blocks=3, block_size=4)
    a = make_request("a", [1, 2, 3, 4, 5])
    assert kv.allocate(a, 5) is not None
    kv.free(a)
    b = make_request("b", [1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13])  # needs 4 blocks
    hits = kv.find_cached_prefix(b)
    assert len(hits) == 1
    assert kv.allocate(b, 13 - 4, hits) is None  # 1 hit + 3 new > 3 blocks
    kv.check_invariants()


def _corrupt(how: str) -> tuple[KVCacheManager, str]:
    """A manager with one invariant broken by hand, and the message that names it."""
    kv = KVCacheManager(num_blocks=3, block_size=2)
    req = make_request("a", 4)
    assert kv.allocate(req, 4) is not None  # blocks 0 and 1, both full and cached
    kv.pool.free(kv.pool.allocate(1))  # block 2: made, and free again
    b0, b1, b2 = kv.pool.blocks
    if how == "twice":
        kv.req_blocks["a"].append(b0)
        return kv, r"^a holds a block twice: \[0, 1, 0\]$"
    if how == "ref_cnt":
        b1.ref_cnt = 2
        return kv, "^block 1: ref_cnt 2 != 1 tables holding it$"
    if how == "never":
        kv.req_blocks["a"].append(KVBlock(7))
        return kv, "^block 7: held but never allocated$"
    if how == "stray_free":
        kv.pool._empty[9] = KVBlock(9)
        return kv, "^1 \\+ 1 blocks on the free lists, 1 made blocks free$"
    if how == "free_list":
        kv.pool._empty.pop(b2.block_id)
        return kv, "^block 2: free-list membership is wrong$"
    if how == "unindexed":
        b2.block_hash = 77
        return kv, "^block 2: cached hash not in the index$"
    if how == "cached_empty":  # (allocation evicts only blocks off the cached list)
        b2.block_hash = 77
        kv.pool._cached[77] = b2
        return kv, "^block 2: cached, on the list of empty ones$"
    assert how == "index"
    h = b1.block_hash
    assert h is not None
    kv.pool._cached[h + 1] = b1
    return kv, f"^index entry {h + 1} points at block 1$"


@pytest.mark.parametrize(
    "how", ["twice", "ref_cnt", "never", "free_list", "unindexed", "cached_empty", "index"]
)
def test_check_invariants_names_the_broken_block(how: str) -> None:
    """The engine's per-step self-check (check_invariants=True) names what it found."""
    kv, message = _corrupt(how)
    with pytest.raises(AssertionError, match=message):
        kv.check_invariants()


def test_a_cache_salt_keeps_prefixes_apart() -> None:
    """Equal tokens under another salt (or none) are another prefix: no hit."""
    kv = KVCacheManager(num_blocks=8, block_size=2)
    first = Request("a", [1, 2, 3, 4, 5], cache_salt="s")
    assert kv.allocate(first, 5) is not None
    kv.free(first)
    assert kv.find_cached_prefix(Request("b", [1, 2, 3, 4, 5])) == []
    assert kv.find_cached_prefix(Request("c", [1, 2, 3, 4, 5], cache_salt="t")) == []
    assert len(kv.find_cached_prefix(Request("d", [1, 2, 3, 4, 5], cache_salt="s"))) == 2


def test_a_pool_makes_its_blocks_as_they_are_first_taken() -> None:
    """A small model on a large GPU gets a cache of ~10^8 blocks in the simulator (a tiny
    test model on the H200: 5 minutes and gigabytes to make one object a block). A block
    is made when first taken, in id order; the order of allocation is the same as with
    every block made up front: freed blocks without content first (latest first), then
    never-used ones, then freed cached ones (least recently freed first)."""
    pool = BlockPool(10**6)
    assert pool.num_free_blocks == 10**6 and pool.usage == 0.0
    a = pool.allocate(3)
    assert [b.block_id for b in a] == [0, 1, 2] and len(pool.blocks) == 3
    pool.cache(a[0], 111)
    pool.free(a)  # tail first in real use; here 0 (cached) goes last, 1 and 2 first
    assert pool.num_free_blocks == 10**6
    assert [b.block_id for b in pool.allocate(4)] == [2, 1, 3, 4]
    pool.check_invariants({2: 1, 1: 1, 3: 1, 4: 1})
    small = BlockPool(3)
    taken = small.allocate(2)
    small.cache(taken[1], 5)
    small.free(taken)
    assert [b.block_id for b in small.allocate(3)] == [0, 2, 1]  # uncached, fresh, cached
    assert small.lookup(5) is None and small.num_evictions == 1
