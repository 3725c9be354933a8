"""Step budgets and the prefill watermark (docs/design.md, "Scheduling rules")."""

from __future__ import annotations

from hypothesis import example, given

from deepinfer.config import EngineRole
from tests.property.checkers_kv import Budgets, WatermarkExemption, WatermarkNewPrompts
from tests.property.examples import USAGE_ABOVE_THE_WATERMARK
from tests.property.harness import Checker, Driver, run_case
from tests.property.mirror import KVMirror
from tests.property.strategies import EngineCase, Workload, any_case_and_workload, scaled

NORMAL = any_case_and_workload(roles=(EngineRole.NORMAL,))


def _run_watermark(case: EngineCase, workload: Workload, make: type[Checker]) -> None:
    d = Driver(case, workload, [])
    mirror = KVMirror.for_driver(d)
    d.checkers = [mirror, make(mirror)]  # type: ignore[call-arg]
    d.run()


@scaled(1.5)
@given(any_case_and_workload())
def test_steps_respect_token_and_sequence_budgets_and_computed_never_exceeds_tokens(
    cw: tuple[EngineCase, Workload],
) -> None:
    """Each step schedules <= max_num_batched_tokens tokens and <= max_num_seqs
    requests (running plus in-progress prefills never exceed max_num_seqs either),
    never past max_model_len, at most num_speculative_tokens drafts a request; a
    request's num_computed_tokens never exceeds its tokens (plus, while a step is in
    flight, its placeholders and unverified drafts)."""
    case, workload = cw
    run_case(case, workload, Budgets())


@scaled(1.0)
@example(USAGE_ABOVE_THE_WATERMARK)
@given(NORMAL)
def test_a_new_prompt_starts_only_while_usage_is_at_most_the_watermark(
    cw: tuple[EngineCase, Workload],
) -> None:
    """In the NORMAL role a request starts (or restarts after preemption) its prompt
    only if the blocks held just before its allocation, over all blocks, are
    <= prefill_watermark; evictable cached blocks count as free."""
    case, workload = cw
    _run_watermark(case, workload, WatermarkNewPrompts)


@scaled(1.0)
@given(NORMAL)
def test_a_continuing_chunk_of_an_admitted_prompt_is_never_held_back_by_the_watermark(
    cw: tuple[EngineCase, Workload],
) -> None:
    """A chunked prefill between chunks is scheduled in every step whose running
    requests leave budget over, whatever the usage: it needs no new blocks, and
    holding it back deadlocks a prompt that needs more than the watermark (the
    37-token-prompt bug). This holds in a step that preempts, too (bug B1)."""
    case, workload = cw
    run_case(case, workload, WatermarkExemption())
