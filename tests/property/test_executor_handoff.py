"""What the scheduler hands the executor: every field of each ScheduledRequest
(checkers_handoff.ExecutorHandoff), for an executor that needs token ids (a real
model) and one that does not (the simulator), with some requests asking for prompt
logprobs or constrained by a grammar.
"""

from __future__ import annotations

from hypothesis import example, given
from hypothesis import strategies as st

from tests.property.checkers_handoff import ExecutorHandoff
from tests.property.examples import (
    NO_WORK_AT_MAX_MODEL_LEN_BEFORE_ANOTHER,
    PROMPT_LOGPROBS_OVER_A_CACHED_PROMPT,
    RESTART_FILLS_WHOLE_BLOCKS,
)
from tests.property.harness import Driver, Flavours
from tests.property.strategies import EngineCase, Workload, any_case_and_workload, scaled


def _run(case: EngineCase, workload: Workload, emit: bool, flavours: bool) -> Driver:
    d = Driver(case, workload, [], needs_token_ids=emit)
    d.checkers = ([Flavours()] if flavours else []) + [ExecutorHandoff()]
    return d.run()


@scaled(0.5)
@example(NO_WORK_AT_MAX_MODEL_LEN_BEFORE_ANOTHER, True, True)
@example(PROMPT_LOGPROBS_OVER_A_CACHED_PROMPT, True, True)
@example(RESTART_FILLS_WHOLE_BLOCKS, True, False)
@given(any_case_and_workload(), st.booleans(), st.booleans())
def test_each_scheduled_request_carries_what_the_executor_needs(
    cw: tuple[EngineCase, Workload], emit: bool, flavours: bool
) -> None:
    """A request that starts (new or resumed) is sent its whole block table, sampling
    params, the token ids before its first chunk and (prompt logprobs asked) its
    prompt; one that continues is sent none of these. `num_prior_blocks` is its table's
    length before the step, `is_prompt` marks the waiting phase's steps, the drafts are
    exactly the positions past its known tokens, `token_ids` the known ids of the
    step's positions plus real drafts (None for an executor that needs no ids), and
    `will_sample` whether the step reaches its last known token. A request asking for
    prompt logprobs takes no prefix hit; `num_cached_tokens` is its first start's hit.
    """
    case, workload = cw
    _run(case, workload, emit, flavours)
