"""The engine's self-checks catch each kind of broken state, and say what broke.

`scheduler_checks.check_invariants` / `check_output` (run per step with
`EngineCore(check_invariants=True)`, and by this suite's driver) are only worth their
cost if they fail on a broken state, and name the request or block at fault, so the
failure can be followed. Every other property feeds them valid states only.

Here, after every step of an ordinary run, copies of the scheduler are broken one way
each (a request queued twice, lost, in the wrong queue or status, holding blocks it
should not or none; a count or a block's bookkeeping off) and the check must raise
AssertionError naming the culprit and the kind of fault. A state at the edge of the
rules (a request computed up to its tokens plus those in flight) must pass.
"""

from __future__ import annotations

import dataclasses
import pickle
from collections.abc import Callable

from hypothesis import example, given

from deepinfer.kv_cache.block_pool import KVBlock
from deepinfer.outputs import SchedulerOutput
from deepinfer.request import Request, RequestStatus
from deepinfer.scheduler import Scheduler
from deepinfer.scheduler_checks import check_invariants, check_output
from tests.property.examples import CHUNKED_PROMPT_BESIDE_A_WAITING_ONE
from tests.property.harness import Checker, Driver, run_case
from tests.property.strategies import (
    EngineCase,
    Workload,
    any_case_and_workload,
    scaled,
)

# A corruption of a scheduler copy: returns the words the failure must contain (the
# culprit and the kind of fault), or None when the state offers nothing to corrupt.
Corruption = Callable[[Scheduler], "list[str] | None"]


def _running(s: Scheduler) -> Request | None:
    return s.running[0] if s.running else None


def _not_in_progress(s: Scheduler) -> Request | None:
    """A waiting request that is no chunked prefill in progress (it holds no blocks)."""
    return next((r for r in s.waiting if r.status is not RequestStatus.PREFILLING), None)


def _in_progress(s: Scheduler) -> Request | None:
    return next((r for r in s.waiting if r.status is RequestStatus.PREFILLING), None)


def _both_waiting_and_running(s: Scheduler) -> list[str] | None:
    if (req := _running(s)) is None:
        return None
    s.waiting.add(req)
    return [req.request_id, "both"]


def _running_twice(s: Scheduler) -> list[str] | None:
    if (req := _running(s)) is None:
        return None
    s.running.append(req)
    return ["twice"]


def _waiting_twice(s: Scheduler) -> list[str] | None:
    if (req := _not_in_progress(s)) is None:
        return None
    s.waiting.add(req)
    return ["twice"]


def _lost(s: Scheduler) -> list[str] | None:
    """A live request that is in no queue (as if a queue dropped it)."""
    if (req := _not_in_progress(s)) is None:
        return None
    s.waiting.remove(req)
    s.num_submitted -= 1  # the count alone would not notice
    return ["disagree"]


def _running_status(s: Scheduler) -> list[str] | None:
    if (req := _running(s)) is None:
        return None
    req.status = RequestStatus.WAITING
    return [req.request_id, "status"]


def _running_without_blocks(s: Scheduler) -> list[str] | None:
    if (req := _running(s)) is None:
        return None
    s.kv.free(req)
    return [req.request_id, "no blocks"]


def _waiting_status(s: Scheduler) -> list[str] | None:
    if (req := _not_in_progress(s)) is None:
        return None
    req.status = RequestStatus.RUNNING
    return [req.request_id, "status"]


def _prefill_behind(s: Scheduler) -> list[str] | None:
    """A request marked as a chunked prefill in progress, not at the front."""
    if (req := _not_in_progress(s)) is None:
        return None
    req.status = RequestStatus.PREFILLING
    return [req.request_id, "lead"]


def _prefill_without_blocks(s: Scheduler) -> list[str] | None:
    if (req := _in_progress(s)) is None:
        return None
    s.kv.free(req)
    return [req.request_id, "holds blocks"]


def _computed_too_many(s: Scheduler) -> list[str] | None:
    if not s.requests:
        return None
    req = next(iter(s.requests.values()))
    req.num_computed_tokens = (
        req.num_tokens + req.num_output_placeholders + req.num_pending_drafts + 1
    )
    return [req.request_id, "computed"]


def _miscounted(s: Scheduler) -> list[str] | None:
    s.num_submitted += 1
    accounted = s.num_submitted - 1
    return [f"{s.num_submitted} submitted", str(accounted)]


def _ref_cnt(s: Scheduler) -> list[str] | None:
    if not s.kv.pool.blocks:  # (blocks are made as first taken)
        return None
    block = s.kv.pool.blocks[0]
    block.ref_cnt += 1
    return [f"block {block.block_id}", "ref_cnt"]


def _off_free_list(s: Scheduler) -> list[str] | None:
    pool = s.kv.pool
    free = next((b for b in pool.blocks if b.ref_cnt == 0), None)
    if free is None:
        return None
    if pool._free.pop(free.block_id, None) is None:
        del pool._empty[free.block_id]
    return [f"block {free.block_id}", "free"]


def _unindexed(s: Scheduler) -> list[str] | None:
    pool = s.kv.pool
    block = next((b for b in pool.blocks if b.block_hash is not None), None)
    if block is None:
        return None
    del pool._cached[block.block_hash]  # type: ignore[arg-type]
    return [f"block {block.block_id}", "index"]


def _stray_index_entry(s: Scheduler) -> list[str] | None:
    """An index entry under a hash its block does not have."""
    pool = s.kv.pool
    block = next((b for b in pool.blocks if b.block_hash is not None), None)
    if block is None:
        return None
    stray = max(pool._cached) + 1
    pool._cached[stray] = block
    return [str(stray), f"block {block.block_id}"]


def _held_twice(s: Scheduler) -> list[str] | None:
    """A request's table lists one block twice (its count raised to match)."""
    if not s.kv.req_blocks:
        return None
    rid, blocks = next(iter(s.kv.req_blocks.items()))
    blocks.append(blocks[0])
    blocks[0].ref_cnt += 1
    return [rid, "twice"]


def _never_allocated(s: Scheduler) -> list[str] | None:
    """A table holds a block the pool has not made yet (blocks are made as first taken)."""
    pool = s.kv.pool
    if not s.kv.req_blocks or len(pool.blocks) >= pool.num_blocks:
        return None
    ghost = KVBlock(len(pool.blocks))
    next(iter(s.kv.req_blocks.values())).append(ghost)
    return [f"block {ghost.block_id}", "never allocated"]


def _stray_free_entry(s: Scheduler) -> list[str] | None:
    """A free list names a block the pool has not made yet."""
    pool = s.kv.pool
    if len(pool.blocks) >= pool.num_blocks:
        return None
    ghost = KVBlock(len(pool.blocks))
    pool._empty[ghost.block_id] = ghost
    return ["free lists", "made blocks free"]


CORRUPTIONS: list[Corruption] = [
    _both_waiting_and_running,
    _running_twice,
    _waiting_twice,
    _lost,
    _running_status,
    _running_without_blocks,
    _waiting_status,
    _prefill_behind,
    _prefill_without_blocks,
    _computed_too_many,
    _miscounted,
    _ref_cnt,
    _off_free_list,
    _unindexed,
    _stray_index_entry,
    _held_twice,
    _never_allocated,
    _stray_free_entry,
]


def _broken_steps(s: Scheduler, out: SchedulerOutput) -> list[tuple[SchedulerOutput, str]]:
    """Copies of `out` past one budget each, with the budget's name; entries of no
    tokens keep the other budgets intact."""
    cfg = s.config
    sr = out.scheduled[0]
    empty = dataclasses.replace(sr, num_tokens=0)
    over = [dataclasses.replace(sr, num_tokens=cfg.max_num_batched_tokens + 1)]
    many = [dataclasses.replace(empty, req_id=f"x{i}") for i in range(cfg.max_num_seqs + 1)]
    broken = [(over, "max_num_batched_tokens"), (many, "max_num_seqs")]
    if cfg.max_num_seqs >= 2:
        broken.append(([empty, empty], "twice"))
    return [(SchedulerOutput(out.step_id, scheduled), word) for scheduled, word in broken]


class BrokenStates(Checker):
    """After each step, every applicable corruption of a copy of the scheduler fails
    `check_invariants` with a message holding the corruption's words; a request
    computed exactly up to its tokens plus those in flight passes. Each non-empty step,
    pushed past one budget, fails `check_output`, naming the step and the budget."""

    def on_schedule(self, d: Driver, out: SchedulerOutput, in_flight: bool) -> None:
        if out.is_empty:
            return
        for broken, word in _broken_steps(d.sched, out):
            try:
                check_output(d.sched, broken)
            except AssertionError as e:
                msg = str(e)
                assert f"step {out.step_id}" in msg and word in msg, (
                    f"a step past {word}: check_output says {msg!r}"
                )
            else:
                raise AssertionError(f"check_output passed a step past {word}")

    def on_step_end(self, d: Driver) -> None:
        # Each corruption breaks its own deep copy of the state, unpickled from one
        # snapshot: several times cheaper than copy.deepcopy of the scheduler each time.
        state = pickle.dumps(d.sched, pickle.HIGHEST_PROTOCOL)
        for corrupt in CORRUPTIONS:
            s = pickle.loads(state)
            words = corrupt(s)
            if words is None:
                continue
            try:
                check_invariants(s)
            except AssertionError as e:
                msg = str(e)
                assert all(w in msg for w in words), (
                    f"{corrupt.__name__}: check_invariants says {msg!r}, not naming {words}"
                )
            else:
                raise AssertionError(f"{corrupt.__name__}: check_invariants passed")
        s = pickle.loads(state)
        for req in s.requests.values():
            req.num_computed_tokens = (
                req.num_tokens + req.num_output_placeholders + req.num_pending_drafts
            )
        check_invariants(s)  # computed up to the limit is legal


@scaled(0.2)
@given(any_case_and_workload())
@example(CHUNKED_PROMPT_BESIDE_A_WAITING_ONE)
def test_each_kind_of_broken_state_fails_the_self_checks_naming_its_culprit(
    cw: tuple[EngineCase, Workload],
) -> None:
    """Broken copies of every state a run passes through fail `check_invariants`: a
    request both waiting and running, queued twice, in no queue, in a queue its status
    does not belong to, running with no blocks, waiting with blocks it should not hold
    (or a prefill in progress without them, or one not at the front), computed past its
    tokens plus those in flight, a miscount of submitted requests; a block whose
    reference count, free-list membership or prefix-cache index entry is wrong, or one
    listed twice in a table. Each message names the request or block and the fault.
    Steps past a budget fail `check_output`, naming the step and the budget.

    Caught: `check_invariants__mutmut_3` (the both-queues check dropped: a later check
    fires, naming no 'both'), `_9` (`and` for `or`: a request repeated in one queue only
    is found by the count), `_42` (`>=`: the legal edge fails), every message replaced
    by None (`_7`, `_24`, `BlockPool.check_invariants__mutmut_8`, ...), and
    `check_output__mutmut_2`, `_4`, `_6`."""
    case, workload = cw
    run_case(case, workload, BrokenStates())
