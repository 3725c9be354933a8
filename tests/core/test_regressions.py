"""Regression tests: shrunk examples from the property suite (tests/property) and the
watermark deadlock, as plain scenarios.

Each bug test (B1-B5) failed before its fix landed (it was a strict xfail) and
pins the fix now.
"""

from __future__ import annotations

import pytest

from deepinfer.config import EngineConfig
from deepinfer.kv_cache.manager import KVCacheManager
from deepinfer.request import Request, RequestStatus
from deepinfer.sampling_params import SamplingParams
from tests.factories import make_engine, make_request, run_to_completion
from tests.property.checkers_kv import BlockSafety, Budgets, PrefixCache, WatermarkNewPrompts
from tests.property.checkers_progress import (
    Completion,
    NoIdleStep,
    RequestConservation,
    TokenConservation,
)
from tests.property.harness import Driver
from tests.property.mirror import KVMirror
from tests.property.strategies import EngineCase, ReqSpec


def _request(rid: str, n: int, max_tokens: int, priority: int, first: int) -> Request:
    params = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
    return Request(rid, list(range(first, first + n)), params, priority=priority)


def test_preempted_request_waits_behind_a_37_token_prefill_that_takes_the_whole_cache() -> None:
    """The watermark deadlock, with a preemption in the way: R is preempted by A's
    growth; P (37 tokens, all 10 blocks of 4, higher priority) overtakes it and is
    prefilled in chunks at usage 1.0 > 0.9, exempt from the watermark while in
    progress; then R recomputes. Everything finishes, in both drivers."""
    cfg = EngineConfig(
        block_size=4,
        num_gpu_blocks=10,
        max_num_seqs=8,
        max_num_batched_tokens=8,
        prefill_watermark=0.9,
        policy="priority",
    )
    engine = make_engine(cfg)
    a, r = _request("a", 15, 10, 1, 1), _request("r", 11, 20, 1, 100)
    p = _request("p", 37, 3, 0, 500)
    engine.add_request(a)
    engine.add_request(r)
    for _ in range(3):
        engine.step()
    engine.add_request(p)
    run_to_completion(engine)
    assert a.status is r.status is p.status is RequestStatus.FINISHED
    assert r.num_preemptions >= 1 and p.num_output_tokens == 3
    full = [s for s in engine.steps if s.kv_usage > 0.9 and s.num_prompt_tokens]
    assert len(full) >= 4, "P's chunks ran with the cache above the watermark"
    specs = (
        ReqSpec("a", 0, tuple(range(1, 16)), 10, 1),
        ReqSpec("r", 0, tuple(range(100, 111)), 20, 1),
        ReqSpec("p", 3, tuple(range(500, 537)), 3, 0),
    )
    d = Driver(EngineCase(cfg, 0.7), specs, [])
    mirror = KVMirror.for_driver(d)
    d.checkers = [
        mirror,
        BlockSafety(mirror),
        PrefixCache(mirror),
        WatermarkNewPrompts(mirror),
        Budgets(),
        NoIdleStep(),
        Completion(),
        RequestConservation(),
        TokenConservation(),
    ]
    d.run()
    assert d.reqs["r"].num_preemptions >= 1


@pytest.mark.parametrize("size", ["shrunk", "10x4"])
def test_a_request_preempting_itself_for_an_in_progress_prefill_does_not_stall(size: str) -> None:
    """Shrunk by the property suite: with 3 one-token blocks and a budget of 2, r0
    (1 prompt token) runs while r1's 2-token prompt is chunked and reserves the rest;
    r0 needs a block for its second token and can only preempt itself."""
    if size == "shrunk":
        engine = make_engine(
            block_size=1,
            num_gpu_blocks=3,
            max_num_batched_tokens=2,
            max_num_seqs=2,
            prefill_watermark=0.5,
            enable_prefix_caching=False,
        )
        first, second = make_request("r0", 1, max_tokens=2), make_request("r1", 2, max_tokens=1)
        engine.add_request(first)
        engine.add_request(second)
    else:  # the same through 10 blocks of 4: a 33-token prompt reserves 9 of them
        engine = make_engine(block_size=4, num_gpu_blocks=10, max_num_batched_tokens=8)
        first = make_request("a", 3, max_tokens=20)
        engine.add_request(first)
        engine.step()
        second = make_request("p", 33, max_tokens=2)
        engine.add_request(second)
    run_to_completion(engine)
    assert first.status is second.status is RequestStatus.FINISHED


def test_without_chunked_prefill_a_preempted_request_longer_than_the_budget_finishes() -> None:
    """Shrunk by the property suite: two 1-token prompts, 2 blocks of 2, budget 2. r1 is
    preempted with 3 tokens, which one unchunked step of 2 tokens can never recompute."""
    engine = make_engine(
        block_size=2,
        num_gpu_blocks=2,
        max_num_batched_tokens=2,
        max_num_seqs=2,
        enable_chunked_prefill=False,
        enable_prefix_caching=False,
        prefill_watermark=0.5,
    )
    reqs = [make_request("r0", [7], max_tokens=3), make_request("r1", [8], max_tokens=3)]
    for r in reqs:
        engine.add_request(r)
    run_to_completion(engine)
    assert all(r.status is RequestStatus.FINISHED for r in reqs)


def test_a_stale_prefix_hit_is_not_claimed_after_its_block_was_reused() -> None:
    """Block theft: B's lookup finds block 0 (cached, free); C's allocation evicts it and
    takes it; B then claims its stale hit. B must not end up sharing C's block."""
    kv = KVCacheManager(num_blocks=5, block_size=4)
    a = make_request("a", [1, 2, 3, 4])
    kv.allocate(a, 4)
    kv.free(a)  # block 0 holds [1, 2, 3, 4]: cached and free
    filler = make_request("f", list(range(50, 62)))
    kv.allocate(filler, 12)
    kv.free(filler)  # blocks 3, 2, 1 cached and freed after block 0: evicted after it
    b = make_request("b", [1, 2, 3, 4, 9])
    hits = kv.find_cached_prefix(b)
    assert [h.block_id for h in hits] == [0]
    c = make_request("c", list(range(100, 108)))
    assert [blk.block_id for blk in kv.allocate(c, 8) or []] == [4, 0]  # evicts block 0
    got = kv.allocate(b, 1, hits)
    shared = set(kv.block_ids("b")) & set(kv.block_ids("c"))
    assert got is None or not shared, f"b and c share blocks {shared} with different tokens"


def test_next_turn_prompt_reuses_the_block_straddling_the_previous_prompt_and_output() -> None:
    """Found by the KV state machine: the same tokens must hash the same whether they
    were prompt or output. A's prompt (3 tokens) + its first output fill one block;
    B's prompt repeats A's prompt and outputs, so that block is a hit."""
    engine = make_engine(block_size=4, num_gpu_blocks=20)
    a = make_request("a", [1, 2, 3], max_tokens=2)
    engine.add_request(a)
    run_to_completion(engine)
    b = make_request("b", [1, 2, 3, *a.output_token_ids, 99], max_tokens=1)
    engine.add_request(b)
    run_to_completion(engine)
    assert b.num_cached_tokens == 4
