"""Work conservation (docs/design.md): the scheduler does all the work its rules
allow, not only no more than they allow. A scheduler more cautious than its rules
passes every limit property and makes the simulator pessimistic; these catch it.

checkers_work.WorkConservation replays each step's rules from the state before it
and the KVMirror's prefix dict. Each test below asserts some of its rules and was
first seen to fail on the deliberately broken copy of deepinfer/scheduler.py named
in its docstring (one edit each, the rest of the suite passing or not).
"""

from __future__ import annotations

from hypothesis import example, given

from deepinfer.config import EngineRole
from tests.factories import make_config
from tests.property import checkers_work as W
from tests.property.examples import (
    BLOCK_FILLED_BY_A_DECODE_HIT_IN_THE_SAME_STEP,
    LAST_DECODE_ON_THE_BUDGETS_LAST_TOKEN,
    NO_WORK_AT_MAX_MODEL_LEN_BEFORE_ANOTHER,
    NO_WORK_AT_MAX_MODEL_LEN_THIRD_IN_RUNNING,
    RESTART_FILLS_WHOLE_BLOCKS,
    USAGE_AT_THE_WATERMARK,
)
from tests.property.harness import Driver
from tests.property.mirror import KVMirror
from tests.property.strategies import (
    EngineCase,
    ReqSpec,
    Workload,
    any_case_and_workload,
    scaled,
)


def _run(case: EngineCase, workload: Workload, *rules: str) -> None:
    d = Driver(case, workload, [])
    mirror = KVMirror.for_driver(d)
    d.checkers = [mirror, W.WorkConservation(mirror, rules)]
    d.run()


@scaled(0.8)
@example(USAGE_AT_THE_WATERMARK)
@given(any_case_and_workload(roles=(EngineRole.NORMAL,)))
def test_the_head_of_waiting_starts_whenever_no_rule_holds_it_back(
    cw: tuple[EngineCase, Workload],
) -> None:
    """The first waiting request not served in a step, with budget left, is a new or
    preempted request (a chunked prefill in progress is always continued) that some
    rule holds back: the step preempted, max_num_seqs are running or mid-prefill,
    usage is above prefill_watermark (NORMAL role), its prompt exceeds the budget left
    without chunked prefill, or the free blocks do not cover its prompt minus its
    prefix hits. Waiting requests are served in queue order, and that order is the
    policy's: chunked prefills in progress first, then under fcfs preempted requests
    ahead of new ones in submission order, under priority (priority, submission).

    Broken copies that fail it (each with this rule's message): in `_start`,
    `self.kv.usage > cfg.prefill_watermark - 0.1` and `>= cfg.prefill_watermark`
    (over-cautious watermark), `>= cfg.max_num_seqs - 1`; `_schedule_waiting`
    returning after the first request it starts. Queue order: the policy tests of
    `WaitingQueue.add` / `add_preempted` inverted (mutmut's `add__mutmut_1`..`_3`,
    `add_preempted__mutmut_1`..`_3`, tests/property/MUTATION.md)."""
    case, workload = cw
    _run(case, workload, W.HEAD, W.FCFS, W.QUEUE)


@scaled(0.6)
@example(NO_WORK_AT_MAX_MODEL_LEN_BEFORE_ANOTHER)
@example(NO_WORK_AT_MAX_MODEL_LEN_THIRD_IN_RUNNING)
@example(LAST_DECODE_ON_THE_BUDGETS_LAST_TOKEN)
@given(any_case_and_workload())
def test_running_requests_get_their_work_and_chunks_fill_the_budget(
    cw: tuple[EngineCase, Workload],
) -> None:
    """Every running request not preempted is scheduled each step unless the requests
    ahead of it spent the budget (or it has no token left to compute before
    max_model_len), and every request's tokens this step are min(its remaining work,
    the budget left): a prompt chunk is min(rest of the prompt, budget left); a running
    request gets its known tokens plus drafts not computed, capped by max_model_len.

    Broken copies that fail it (each with this test's rules' messages): in `_start`,
    `min(num_new, step.budget // 2 + 1)`; in `_continue_prefill`, a chunk capped at
    8 tokens; in `_schedule_running`, `i += 2` after scheduling a request (the next
    one skipped), drafts dropped while `req.num_computed_tokens` is odd; and, on the
    explicit examples, `i += 2`, `i = 1` or `break` after a request with no work, and
    the loop left while one token of budget remains (`budget > 1`)."""
    case, workload = cw
    _run(case, workload, W.RUNNING, W.CHUNK)


@scaled(0.6)
@example(RESTART_FILLS_WHOLE_BLOCKS)
@example(BLOCK_FILLED_BY_A_DECODE_HIT_IN_THE_SAME_STEP)
@given(any_case_and_workload())
def test_preemption_happens_only_when_an_allocation_fails_and_a_cached_prefix_is_hit(
    cw: tuple[EngineCase, Workload],
) -> None:
    """A step preempts exactly the running requests that failed allocations force
    out, newest first (the allocating request itself last), and none when the free
    blocks cover each running request's new blocks; a request that starts its prompt
    starts after exactly the cached blocks the reference dict finds for its tokens
    (never fewer: a cached prefix is hit); and no request holds a block its tokens do
    not need (its whole prompt while prefilling, else the tokens computed).

    Broken copies that fail it (each with this test's rules' messages):
    `KVCacheManager.allocate` refusing unless one block more than needed is free
    (`num_needed + 1 > ...`: needless preemptions); `victim = self.running[0]` (the
    oldest preempted); in `_start`, `find_cached_prefix(req)[:-1]` (a hit dropped);
    `req.num_computed_tokens = 1` in `_preempt` (a restarted request whose tokens fill
    whole blocks takes one block too many: mutmut's surviving mutant
    `_preempt__mutmut_5`, tests/property/MUTATION.md, which random workloads under the
    ci profile miss: the explicit example shows it); counting one draft where none
    was scheduled (`_schedule_running__mutmut_44`, on the other example)."""
    case, workload = cw
    _run(case, workload, W.PREEMPT, W.PREFIX, W.BLOCKS)


def test_a_preempted_request_waits_behind_a_higher_priority_one() -> None:
    """Scripted, priority policy: A and C (priority 2) run; B (priority 0) arrives and
    waits, its prompt needing more blocks than are free; A and C outgrow the cache, so
    C (the newest) is preempted. C then waits behind B, as (priority, submission)
    orders them, not at the front as an fcfs preemption would put it (mutmut's
    `add_preempted__mutmut_2` and `_3`, tests/property/MUTATION.md)."""
    cfg = make_config(
        num_gpu_blocks=6, max_num_batched_tokens=64, prefill_watermark=1.0, policy="priority"
    )
    a = ReqSpec("a", 0, (1, 2, 3, 4), max_tokens=16, priority=2)
    c = ReqSpec("c", 0, (5, 6, 7, 8), max_tokens=16, priority=2)
    b = ReqSpec("b", 2, tuple(range(10, 30)), max_tokens=2, priority=0)  # needs 5 blocks
    d = Driver(EngineCase(cfg, 0.7), (a, c, b), [])
    mirror = KVMirror.for_driver(d)
    d.checkers = [mirror, W.WorkConservation(mirror, (W.QUEUE,))]
    d.run()
    assert d.reqs["c"].num_preemptions >= 1 and d.reqs["a"].num_preemptions == 0
    assert all(r.status.value == "finished" for r in d.reqs.values())
