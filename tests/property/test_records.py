"""The records every reported figure comes from (`deepinfer.metrics` reads nothing else):
per request and per step, each field equal to what the driver saw happen.
"""

from __future__ import annotations

from hypothesis import example, given

from tests.property.checkers_records import Records
from tests.property.examples import PREFIX_HIT_OF_TWO_BLOCKS
from tests.property.harness import run_case
from tests.property.strategies import EngineCase, Workload, any_case_and_workload, scaled


@scaled(0.5)
@given(any_case_and_workload())
@example(PREFIX_HIT_OF_TWO_BLOCKS)
def test_each_record_holds_the_request_and_step_figures_the_driver_saw(
    cw: tuple[EngineCase, Workload],
) -> None:
    """A request's record has its arrival, prompt and output lengths, the time of the
    step that first scheduled it, of each step that gave it tokens (the first one is its
    first token), of its end (the processed step, or the abort; none when rejected at
    add_request), its prefix-cache hit at first schedule (0 if never scheduled), the
    preemptions announced for it, its status, finish reason and reason. Each processed
    step's record has its id, the time its results were applied, the time since the
    previous step's, the running and waiting counts and KV usage it left, its batched and
    prompt tokens, scheduled requests and preemptions.

    Caught: a recorded field set to None or dropped (`_record`, `_step_record`);
    `first_token` / `first_scheduled` stamped on every step rather than the first;
    `_last_step_end` never set (every duration 0); an aborted request's finish time
    left unset."""
    case, workload = cw
    run_case(case, workload, Records())
