"""Liveness: admissible requests finish, pending work is scheduled, hopeless ones are rejected.

Every example runs a generated engine configuration and workload through the
real EngineCore over SimExecutor (see harness.py); the core's own invariant
checks run after every step as well.
"""

from __future__ import annotations

from hypothesis import given

from deepinfer.request import RequestStatus
from tests.property.checkers_progress import Completion, NoIdleStep, Rejection
from tests.property.harness import Checker, Driver, admissible, run_case
from tests.property.strategies import (
    EngineCase,
    Workload,
    any_case_and_workload,
    cases_and_workloads,
    scaled,
)


@scaled(1.0)
@given(any_case_and_workload())
def test_every_admissible_request_finishes_within_the_step_bound(
    cw: tuple[EngineCase, Workload],
) -> None:
    """Every request that can fit ends FINISHED with all its output tokens (or ABORTED,
    only when the workload aborts it) within harness.step_bound engine steps: the last
    arrival plus one step per token of work (each prompt, each output with its drafts,
    one max_model_len recompute per preemption) plus one step per preemption."""
    case, workload = cw
    run_case(case, workload, Completion())  # the driver fails past the bound


@scaled(1.0)
@given(any_case_and_workload())
def test_a_step_with_nothing_in_flight_schedules_at_least_one_token(
    cw: tuple[EngineCase, Workload],
) -> None:
    """While some request is unfinished and no step is in flight, schedule() gives at
    least one token to some request (otherwise the engine has stalled)."""
    case, workload = cw
    run_case(case, workload, NoIdleStep())


class _NeverQueued(Checker):
    """A rejected request never shows up in the scheduler afterwards."""

    def on_step_end(self, d: Driver) -> None:
        for rid in d.reasons:
            assert rid not in d.sched.requests
            assert d.reqs[rid].status is RequestStatus.REJECTED


@scaled(1.0)
@given(cases_and_workloads(max_capacity=256))
def test_a_request_that_can_never_fit_is_rejected_at_add_request(
    cw: tuple[EngineCase, Workload],
) -> None:
    """add_request rejects exactly the requests that can never be served (prompt + 1
    token beyond the cache or max_model_len, an empty prompt, or a prompt beyond the
    step budget without chunked prefill), with a reason naming the sizes, and such a
    request never enters the queues; every other request is accepted."""
    case, workload = cw
    d = run_case(case, workload, Rejection(), _NeverQueued())
    assert set(d.reasons) == {s.req_id for s in workload if not admissible(case, s)}
