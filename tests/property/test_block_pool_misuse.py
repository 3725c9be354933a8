"""Misuse of the block pool is an error that gives the figures involved.

The KV manager never misuses the pool (the other properties check that), so its
refusals are never seen by them. They guard against a bug in a caller, and are only
useful if they say what was asked: a cache of no blocks names the count, an allocation
beyond the free blocks names both counts (and takes nothing), a block freed more often
than taken names the block.
"""

from __future__ import annotations

import re

from hypothesis import given
from hypothesis import strategies as st

from deepinfer.kv_cache.block_pool import BlockPool
from tests.property.strategies import scaled


def _ints(text: str) -> list[int]:
    return [int(x) for x in re.findall(r"-?\d+", text)]


@scaled(0.2)
@given(st.integers(-3, 24), st.data())
def test_a_misused_block_pool_refuses_naming_the_counts_and_the_block(
    num_blocks: int, data: st.DataObject
) -> None:
    """A pool of fewer than one block is refused with a ValueError naming the count. In
    a valid pool with some blocks taken, asking for more than the free ones raises a
    RuntimeError giving the count asked for and the count free, and takes nothing;
    freeing a block once more than it was taken raises naming its id.

    Caught: `BlockPool.__init____mutmut_2` (a pool of 0 blocks accepted), `_4`,
    `allocate__mutmut_2` and `free__mutmut_6` (errors that say nothing)."""
    if num_blocks <= 0:
        try:
            BlockPool(num_blocks)
        except ValueError as e:
            assert num_blocks in _ints(str(e)), f"BlockPool({num_blocks}): {e}"
            return
        raise AssertionError(f"BlockPool({num_blocks}) accepted")
    pool = BlockPool(num_blocks, enable_caching=data.draw(st.booleans()))
    held = pool.allocate(data.draw(st.integers(0, num_blocks)))
    free = pool.num_free_blocks
    want = data.draw(st.integers(free + 1, free + 5))
    try:
        pool.allocate(want)
    except RuntimeError as e:
        assert _ints(str(e)) == [want, free], f"asked {want} of {free} free: {e}"
    else:
        raise AssertionError(f"{want} blocks allocated with {free} free")
    assert pool.num_free_blocks == free, "a refused allocation took blocks"
    if not held:
        return
    block = data.draw(st.sampled_from(held))
    pool.free([block])
    try:
        pool.free([block])
    except RuntimeError as e:
        assert _ints(str(e)) == [block.block_id], f"block {block.block_id} freed twice: {e}"
    else:
        raise AssertionError(f"block {block.block_id} freed more often than taken")
