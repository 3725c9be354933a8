"""How many drafts varlen asks the drafter for (DraftPlan.plan_proposals): no step of
prompts alone lowers it."""

from __future__ import annotations

from tests.core.test_spec_policy import ConfidentExecutor, _shape, _varlen_engine
from tests.factories import make_request


def test_a_request_after_a_long_prompt_verifies_the_length_its_engine_settled_on() -> None:
    """3 drafts pay best (10 / 12 / 14 / 16 ms for 0-3). One request decodes until the
    engine verifies 3 a step; the next arrives alone with a prompt of five steps' tokens.
    Its first decode step verifies 3 drafts: steps of prompts alone choose no length,
    so the proposals still follow the last decode steps'. When each prompt step counted
    as a length of 0, the drafter proposed 1 draft and the request climbed back one
    length per probe step."""
    ms = {0: 10.0, 1: 12.0, 2: 14.0, 3: 16.0}
    ex = ConfidentExecutor(1024, 3, 0.9)
    engine = _varlen_engine(ex)
    engine.add_request(make_request("first", 4, max_tokens=120))
    verified: list[int] = []
    while engine.has_unfinished():
        out = engine.schedule()
        res = ex.execute(out)
        longest, uniform = _shape(out)
        if not any(sr.is_prompt for sr in out.scheduled) and "second" in engine.scheduler.requests:
            verified.append(longest)
        engine.apply_results(out, res, ms[longest] / 1e3 if uniform else 0.02)
        if not engine.has_unfinished() and not verified:
            engine.add_request(make_request("second", 5 * 256, max_tokens=40))
    assert verified[:3] == [3, 3, 3], verified


def test_steps_that_fail_or_are_discarded_leave_no_length_pending() -> None:
    """A uniform step in flight keeps its draft length from the hill climb until it is
    timed (DraftPlan.choose's pending lengths). A step that fails, or that an
    interrupted engine discards, is never timed: it must not keep its length back for
    good, nor cap the next step's drafts by its proposals. Failed here: a uniform
    step and, scheduled after it, one with a new prompt (not uniform)."""
    ex = ConfidentExecutor(1024, 3, 0.9)
    engine = _varlen_engine(ex)
    sched = engine.scheduler
    plan = sched.draft_plan
    assert plan is not None
    for i in range(8):
        engine.add_request(make_request(f"r{i}", 4, max_tokens=50))
    for _ in range(2):
        for _ in range(4):
            out = engine.schedule()
            engine.apply_results(out, ex.execute(out), 0.01)
        uniform = engine.schedule()
        assert len(plan.uniform_in_flight()) == 1, uniform
        if sched.step_id < 10:  # first round: the step fails with the one after it
            engine.add_request(make_request("late", 4, max_tokens=2))
            mixed = engine.schedule()
            sched.fail_step([uniform, mixed], {})
        else:  # second round: an interrupted engine discards it
            sched.forget_unapplied_steps()
        assert plan.uniform_in_flight() == [] and plan.proposals_in_flight is None
