"""Conservation of requests and of output tokens."""

from __future__ import annotations

from hypothesis import given

from tests.property.checkers_progress import RequestConservation, TokenConservation
from tests.property.harness import run_case
from tests.property.strategies import EngineCase, Workload, any_case_and_workload, scaled


@scaled(1.0)
@given(any_case_and_workload())
def test_every_submitted_request_is_in_exactly_one_place_and_changes_state_legally(
    cw: tuple[EngineCase, Workload],
) -> None:
    """After every add, abort and half step: submitted == finished + aborted +
    rejected + waiting + running; the waiting queue holds exactly the WAITING and
    PREEMPTED requests and `running` the RUNNING ones; each status change is legal
    (checkers_progress.LEGAL: e.g. never WAITING -> PREEMPTED, nothing leaves a
    terminal state); each ended request has exactly one record."""
    case, workload = cw
    run_case(case, workload, RequestConservation())


@scaled(1.0)
@given(any_case_and_workload())
def test_no_output_token_is_lost_or_repeated_across_preemption_and_recompute(
    cw: tuple[EngineCase, Workload],
) -> None:
    """A request's output tokens are exactly the tokens the executor returned for it,
    in order, cut only after the stop inside its last step; and the token at
    position p is SimExecutor's token for (request, p), so recompute after a
    preemption neither drops nor repeats a token, with or without drafts (bug B3); no
    request ever holds more than max_tokens outputs (accepted drafts past it dropped),
    with random acceptance, varlen drafts, preemption and async scheduling together."""
    case, workload = cw
    run_case(case, workload, TokenConservation())
