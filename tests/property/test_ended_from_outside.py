"""A request ended from outside the scheduler ends once, in the state it was ended in.

`Scheduler.abort` (a client's abort) and `Scheduler.reject` (a request whose grammar
failed to compile) end a live request between steps. The engine reaches them only
through paths the simulator rarely takes (its own abort goes through `finish_request`;
the simulator compiles no grammar), so here they are called directly, on a request
drawn from those live after a step, in every state a run passes through.

- abort ends any live request: ABORTED, finish reason abort, out of both queues,
  holding no blocks, counted once as aborted;
- reject ends only a request that has never been scheduled (waiting, nothing computed):
  REJECTED, finish reason rejected, with the reason given, counted once as rejected;
  any other is refused with a ValueError naming it, and nothing changes;
- both return None for a request that is not live, and change nothing.
"""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from deepinfer.request import FinishReason, RequestStatus
from deepinfer.scheduler import Scheduler
from tests.property.harness import Checker, Driver, run_case
from tests.property.strategies import EngineCase, Workload, any_case_and_workload, scaled


def _counts(s: Scheduler) -> tuple[int, int, int, int, int]:
    return (s.num_finished, s.num_aborted, s.num_rejected, len(s.waiting), len(s.running))


def _gone(s: Scheduler, rid: str) -> None:
    assert rid not in s.requests, f"{rid} ended but still live"
    assert all(r.request_id != rid for r in s.waiting), f"{rid} ended but waits"
    assert all(r.request_id != rid for r in s.running), f"{rid} ended but runs"
    assert not s.kv.holds_blocks(rid), f"{rid} ended but holds blocks"


class EndFromOutside(Checker):
    """After each step, maybe end a drawn live request by abort or reject, and check
    what that did."""

    def __init__(self, data: st.DataObject) -> None:
        self.data = data
        self.ended: set[str] = set()

    def on_step_end(self, d: Driver) -> None:
        s = d.sched
        for r in list(s.requests.values()):  # refusals change nothing: try them all
            if r.status is not RequestStatus.WAITING:
                self._refused(s, r.request_id)
        live = sorted(s.requests)
        candidates = live + sorted(self.ended)[:1]  # sometimes one no longer live
        if not candidates or not self.data.draw(st.booleans(), label="end one now"):
            return
        rid = self.data.draw(st.sampled_from(candidates), label="request")
        how = self.data.draw(st.sampled_from(["abort", "reject"]), label="how")
        req = s.requests.get(rid)
        before = _counts(s)
        if req is None:
            got = s.abort(rid) if how == "abort" else s.reject(rid, "no grammar")
            assert got is None and _counts(s) == before, f"{how} of ended {rid} did something"
            return
        status, computed = req.status, req.num_computed_tokens
        if how == "abort":
            assert s.abort(rid) is req, f"abort({rid}) did not return it"
            assert (req.status, req.finish_reason) == (RequestStatus.ABORTED, FinishReason.ABORT)
            want = (before[0], before[1] + 1, before[2])
        elif status is RequestStatus.WAITING and computed == 0:
            assert s.reject(rid, "no grammar") is req, f"reject({rid}) did not return it"
            assert (req.status, req.finish_reason) == (
                RequestStatus.REJECTED,
                FinishReason.REJECTED,
            ), f"rejected {rid}: {req.status}, {req.finish_reason}"
            assert req.reject_reason == "no grammar", f"rejected {rid}: {req.reject_reason!r}"
            want = (before[0], before[1], before[2] + 1)
        else:
            self._refused(s, rid)
            return
        _gone(s, rid)
        self.ended.add(rid)
        after = _counts(s)
        assert after[:3] == want and after[3] + after[4] == before[3] + before[4] - 1, (
            f"{how} of {rid}: counts {before} -> {after}"
        )

    @staticmethod
    def _refused(s: Scheduler, rid: str) -> None:
        """reject(rid) of a request ever scheduled raises, naming it, and changes nothing."""
        req, before = s.requests[rid], _counts(s)
        status, computed = req.status, req.num_computed_tokens
        try:
            s.reject(rid, "no grammar")
        except ValueError as e:
            assert repr(rid) in str(e), f"refused reject of {rid}: {e}"
        else:
            raise AssertionError(f"{rid} ({status.value}, {computed} computed) rejected")
        assert (req.status, req.num_computed_tokens) == (status, computed)
        assert _counts(s) == before, f"a refused reject of {rid} changed the counts"


@scaled(1.0)
@given(any_case_and_workload(), st.data())
def test_a_request_aborted_or_rejected_by_the_scheduler_ends_once_in_that_state(
    cw: tuple[EngineCase, Workload], data: st.DataObject
) -> None:
    """Between any two steps, `Scheduler.abort` ends a live request as aborted and
    `Scheduler.reject` one never scheduled as rejected (with the reason given): each
    leaves the queues and its blocks and is counted once; a reject of a request ever
    scheduled (running, a prefill in progress, preempted) is refused naming it, and
    changes nothing; both return None for a request no longer live.

    Caught: `reject__mutmut_4` (`and` for `or`: a preempted request, nothing computed,
    is rejected), `_6` (the refusal names nobody), `_10` (no finish reason);
    `abort__mutmut_1` .. `_4` (the wrong request, reason or arguments)."""
    case, workload = cw
    run_case(case, workload, EndFromOutside(data))
