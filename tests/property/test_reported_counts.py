"""What the scheduler reports equals a recount from the steps' outputs: step numbers,
requests by how they ended, draft acceptance (in all and by position) and each
request's next drafts. The simulator's reports, `deepinfer generate` and
`measure-acceptance` print these figures; the other properties never read them.

Each property was first seen to fail on the deliberately broken copies named in its
docstring (mutmut's surviving mutants of the full run at 24b5901).
"""

from __future__ import annotations

from hypothesis import given

from tests.property.checkers_reported import DraftAcceptance, EndCounts, NextDrafts, StepNumbers
from tests.property.harness import run_case
from tests.property.strategies import EngineCase, Workload, any_case_and_workload, scaled


@scaled(0.3)
@given(any_case_and_workload())
def test_steps_are_numbered_from_one_and_requests_counted_by_how_they_ended(
    cw: tuple[EngineCase, Workload],
) -> None:
    """The n-th schedule() call is step n (its output's step_id and Scheduler.step_id);
    Scheduler.num_submitted/num_finished/num_aborted/num_rejected equal the requests
    submitted, FINISHED, ABORTED and REJECTED after every add, abort and step.

    Caught: `step_id` starting at 1, set to 1, decremented, stepped by 2, or left out of
    the output (`schedule__mutmut_13` .. `_17`, `__init____mutmut_25`); an aborted
    request counted as finished and the reverse (`_end__mutmut_9`); a rejection counted
    as 0, -1 or 2, or a finish counted as a rejection (`_end__mutmut_13` .. `_16`)."""
    case, workload = cw
    run_case(case, workload, StepNumbers(), EndCounts())


@scaled(0.5)
@given(any_case_and_workload())
def test_draft_acceptance_and_each_requests_next_drafts_are_as_the_executor_returned(
    cw: tuple[EngineCase, Workload],
) -> None:
    """num_draft_tokens, num_accepted_drafts and draft_position_stats equal a recount of
    the drafts each applied step verified and accepted (position j reached when the
    drafts before it were accepted); after each sampling step a request that goes on
    running proposes the executor's next drafts (at most k) and their confidences.

    Caught: every `_count_acceptance` mutant that survived the full run (a total or a
    position's count overwritten, negated, doubled, or one position too many); the
    accepted count off by one or two (`update_from_output__mutmut_40`, `_41`); no drafts
    kept (`k = None`, `_5`), drafts or confidences looked up under None (`_89`, `_95`),
    the preempted-meanwhile test inverted (`_86`); counts starting at 1
    (`__init____mutmut_38`, `_40`)."""
    case, workload = cw
    run_case(case, workload, DraftAcceptance(), NextDrafts())
