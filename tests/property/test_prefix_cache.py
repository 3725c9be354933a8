"""Prefix cache: hits are what a plain dict of prefixes finds, never the whole
request, and a shared block holds the same tokens for every request using it.

mirror.KVMirror records the token written into each block slot by each step
(from the SchedulerOutputs) and keeps the reference dict: exact prefix ->
block registered for it, dropped when that block is handed out fresh.
"""

from __future__ import annotations

from hypothesis import example, given

from deepinfer.config import EngineConfig
from tests.property.checkers_kv import BlockSafety, PrefixCache
from tests.property.examples import ACCEPTED_DRAFTS_FILL_A_BLOCK_THEN_PREEMPTED
from tests.property.harness import Checker, Driver
from tests.property.mirror import KVMirror
from tests.property.strategies import (
    EngineCase,
    ReqSpec,
    Workload,
    any_case_and_workload,
    scaled,
    sim_token,
)

CACHING = any_case_and_workload(caching=True)


def _run(case: EngineCase, workload: Workload, *extra: type[Checker]) -> tuple[Driver, KVMirror]:
    d = Driver(case, workload, [])
    mirror = KVMirror.for_driver(d)
    d.checkers = [mirror, *(make(mirror) for make in extra)]  # type: ignore[call-arg]
    d.run()
    return d, mirror


class _HitsMatchDict(PrefixCache):
    def _shared(self, d: Driver, when: str) -> None:
        pass  # content is the next test's property


class _HitBound(Checker):
    def __init__(self, mirror: KVMirror) -> None:
        self.mirror = mirror

    def on_schedule(self, d: Driver, out: object, in_flight: bool) -> None:
        bs = d.case.config.block_size
        for a in self.mirror.admissions:
            assert a.hits * bs <= a.num_tokens - 1, (
                f"{a.req_id}: {a.hits} cached blocks of {bs} cover all {a.num_tokens} tokens"
            )
            assert a.start < a.num_tokens, f"{a.req_id} starts with nothing left to compute"


class _SharedContent(Checker):
    def __init__(self, mirror: KVMirror) -> None:
        self.mirror = mirror

    def on_schedule(self, d: Driver, out: object, in_flight: bool) -> None:
        assert not self.mirror.hit_mismatches, "\n".join(self.mirror.hit_mismatches)
        errors = self.mirror.shared_content_errors(d)
        assert not errors, "\n".join(errors[:5])

    def on_process(self, d: Driver, out: object, res: object) -> None:
        self.on_schedule(d, out, False)


@scaled(1.0)
@given(CACHING)
@example(ACCEPTED_DRAFTS_FILL_A_BLOCK_THEN_PREEMPTED)
def test_prefix_hits_equal_the_reference_dict_model(cw: tuple[EngineCase, Workload]) -> None:
    """Each (re)admitted request reuses exactly the blocks a plain dict finds for its
    leading full blocks (exact token prefixes, registered when computed, first block
    wins, dropped on reuse), capped at (num_tokens - 1) // block_size blocks."""
    case, workload = cw
    _run(case, workload, _HitsMatchDict)


@scaled(1.0)
@given(CACHING)
def test_a_prefix_hit_covers_at_most_num_tokens_minus_one(cw: tuple[EngineCase, Workload]) -> None:
    """A prefix hit never covers the last token: the step must compute at least one
    token so that it produces logits to sample from."""
    case, workload = cw
    _run(case, workload, _HitBound)


@scaled(1.0)
@given(CACHING)
def test_a_block_shared_by_two_requests_holds_the_same_tokens_in_both(
    cw: tuple[EngineCase, Workload],
) -> None:
    """Whenever two block tables hold the same block, the tokens the outputs wrote
    into it agree with both requests' tokens at those positions; a block reused from
    the cache holds exactly the tokens of the prefix it is reused for."""
    case, workload = cw
    _run(case, workload, _SharedContent)


@scaled(1.0)
@given(CACHING)
def test_a_block_handed_to_one_request_is_never_reused_by_another_while_referenced(
    cw: tuple[EngineCase, Workload],
) -> None:
    """A block appended fresh to a table is held by no other table at that moment
    (KVMirror asserts it for every allocation), and ref counts stay exact."""
    case, workload = cw
    _run(case, workload, BlockSafety)


def test_block_theft_interleaving_in_one_step() -> None:
    """Scripted: A leaves three full prompt blocks cached and free (LRU order: its
    third block, second, first). Then one step admits a large prompt C (six of the
    eight blocks) and B, which shares A's first block, in both orders. C first: C
    evicts A's third block and B, looking up afterwards, reuses the first and takes
    the second fresh. B first: B claims the first block before C allocates, and C
    must evict around it. Either way no claimed block is handed out again and no
    block is shared by requests whose tokens differ there."""
    cfg = EngineConfig(
        block_size=4,
        num_gpu_blocks=8,
        max_num_seqs=4,
        max_num_batched_tokens=64,
        prefill_watermark=1.0,
        enable_prefix_caching=True,
        async_scheduling=False,  # (the script counts steps one at a time)
    )
    a = ReqSpec("a", 0, tuple(range(1, 13)) + (50,), max_tokens=1)  # blocks 0-2 full, 3 not
    b = ReqSpec("b", 3, (1, 2, 3, 4, 60), max_tokens=2)  # its first block is A's first
    c = ReqSpec("c", 3, tuple(range(100, 124)), max_tokens=2)  # needs 6 blocks
    for order in ((a, c, b), (a, b, c)):
        d, _ = _run(EngineCase(cfg, 0.7), order, BlockSafety, _SharedContent)
        assert all(d.reqs[r].status.value == "finished" for r in "abc")
        assert d.engine.steps[1].num_scheduled_reqs == 2, "B and C start in the same step"
        assert d.reqs["b"].num_cached_tokens == 4, "B reuses A's first block in either order"
        assert d.sched.kv.pool.num_evictions == 2, "A's other two blocks were reused"


def test_blocks_filled_by_generated_tokens_are_hit_by_a_later_prompt() -> None:
    """Scripted: A's third block is filled by its first two outputs, so its hash is
    chained onto its prompt blocks' hashes in a later call than theirs; B, arriving
    once A is done, whose prompt is A's prompt, those two outputs and one more token,
    hits all three blocks (mutmut's `_update_block_hashes__mutmut_5`, `_6` and `_13`:
    a chain restarted or recomputed when it is extended, tests/property/MUTATION.md)."""
    cfg = EngineConfig(block_size=2, num_gpu_blocks=8, max_num_batched_tokens=16)
    a = ReqSpec("a", 0, (1, 2, 3, 4), max_tokens=3)
    outputs = tuple(sim_token("a", 4 + i) for i in range(2))
    b = ReqSpec("b", 6, a.prompt + outputs + (9,), max_tokens=1)
    d, _ = _run(EngineCase(cfg, 0.7), (a, b), _HitsMatchDict)
    assert d.reqs["a"].output_token_ids[:2] == list(outputs)
    assert d.reqs["b"].num_cached_tokens == 6
