"""Stop conditions (docs/design.md) over generated workloads: stop token ids and EOS
emitted at known positions (inside accepted draft runs too), EOS with ignore_eos on and
off, min_tokens, max_tokens, max_model_len and the PREFILL role's single token.

Each property was first seen to fail on a deliberately broken copy of the core, named
in its docstring.
"""

from __future__ import annotations

from hypothesis import given

from tests.property.checkers_stop import EndedAreAnnounced, StopConditions
from tests.property.harness import run_case
from tests.property.strategies import EngineCase, Workload, any_case_and_workload, scaled


@scaled(1.0)
@given(any_case_and_workload())
def test_a_request_ends_in_the_update_that_produces_its_first_stop_condition(
    cw: tuple[EngineCase, Workload],
) -> None:
    """A request ends in the update that produces its first output token at a count
    >= min_tokens that is a stop token id or EOS (unless ignore_eos), or that reaches
    max_tokens or max_model_len (one token in the PREFILL role); later tokens of that
    step (accepted drafts) are dropped, the finish reason is that condition's, and the
    request holds no block when the update returns. Before that update it goes on.

    Caught: `n >= sp.min_tokens` as `n > sp.min_tokens` in check_stop; the `break`
    after a stop removed from update_from_output (accepted drafts kept); EOS checked
    without `not sp.ignore_eos`."""
    case, workload = cw
    run_case(case, workload, StopConditions())


@scaled(0.3)
@given(any_case_and_workload())
def test_the_executor_hears_of_every_ended_request_at_the_next_step(
    cw: tuple[EngineCase, Workload],
) -> None:
    """The step after a request finishes or is aborted lists it in finished_req_ids,
    and lists nothing else, so the executor drops exactly the state of ended requests.

    Caught: `_finished_since_last` not reset in schedule() (every ended request is
    announced again at each later step)."""
    case, workload = cw
    run_case(case, workload, EndedAreAnnounced())
