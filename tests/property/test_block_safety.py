"""Block safety: every block is free or held, reference counts are exact, and
ended or preempted requests hold nothing.

The block tables are rebuilt from the SchedulerOutputs alone (mirror.KVMirror),
so the core's tables and ref counts are checked against an independent account.
"""

from __future__ import annotations

from hypothesis import given

from tests.property.checkers_kv import AllFreeAtEnd, BlockSafety, EndedHoldNothing
from tests.property.harness import Driver, run_case
from tests.property.mirror import KVMirror
from tests.property.strategies import EngineCase, Workload, any_case_and_workload, scaled


def _run(case: EngineCase, workload: Workload, make: type[BlockSafety]) -> Driver:
    d = Driver(case, workload, [])
    mirror = KVMirror.for_driver(d)
    d.checkers = [mirror, make(mirror)]
    return d.run()


@scaled(1.0)
@given(any_case_and_workload())
def test_every_block_is_free_or_held_and_ref_counts_equal_holders(
    cw: tuple[EngineCase, Workload],
) -> None:
    """After every half step and abort: each block's ref count equals the number of
    block tables (as the outputs describe them) that hold it, never negative; the
    free blocks are exactly those no table holds; a block is never handed out fresh
    while a table holds it."""
    case, workload = cw
    _run(case, workload, BlockSafety)


@scaled(1.0)
@given(any_case_and_workload())
def test_finished_aborted_and_preempted_requests_hold_no_blocks(
    cw: tuple[EngineCase, Workload],
) -> None:
    """A request that finished, was aborted or was preempted holds no blocks, in the
    core and in the tables the outputs describe."""
    case, workload = cw
    _run(case, workload, EndedHoldNothing)


@scaled(1.0)
@given(any_case_and_workload())
def test_at_the_end_every_block_is_free_or_evictable_cached(
    cw: tuple[EngineCase, Workload],
) -> None:
    """When the workload is done every block is free (ref count 0); a block that still
    carries a prefix hash is findable under it, i.e. cached and evictable."""
    case, workload = cw
    run_case(case, workload, AllFreeAtEnd())
