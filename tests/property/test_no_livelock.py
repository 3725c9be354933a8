"""No livelock: preemption never targets a request alone in the cache, is bounded,
and the engine keeps computing tokens it has not computed before."""

from __future__ import annotations

from hypothesis import given

from deepinfer.config import EngineRole
from tests.property.checkers_progress import (
    BoundedPreemptions,
    ComputedProgress,
    NeverPreemptedAlone,
)
from tests.property.harness import run_case
from tests.property.strategies import EngineCase, Workload, any_case_and_workload, scaled

# Preemption needs decode growth: the NORMAL and DECODE roles, small caches.
GROWING = any_case_and_workload(roles=(EngineRole.NORMAL, EngineRole.DECODE))


@scaled(1.0)
@given(GROWING)
def test_a_request_holding_blocks_alone_is_never_preempted(cw: tuple[EngineCase, Workload]) -> None:
    """A running request that is the only request holding blocks is never preempted:
    it fits in the cache by itself (max_model_len <= capacity). Observed as: a step
    that preempts leaves some request that held blocks before it still holding them."""
    case, workload = cw
    run_case(case, workload, NeverPreemptedAlone())


@scaled(1.0)
@given(GROWING)
def test_preemptions_are_bounded_and_counted_as_announced(cw: tuple[EngineCase, Workload]) -> None:
    """A run preempts at most harness.preemption_bound times: admitted requests times
    (their output tokens + 1), since some request gains a token or ends between two
    steps that preempt, and one step preempts each running request at most once. The
    preemption counts the engine reports (in all and per request) equal those the
    outputs announce (mutmut's surviving mutants `_preempt__mutmut_11` to `_16`,
    tests/property/MUTATION.md)."""
    case, workload = cw
    run_case(case, workload, BoundedPreemptions())


@scaled(1.0)
@given(GROWING)
def test_max_computed_tokens_never_falls_and_progress_keeps_rising(
    cw: tuple[EngineCase, Workload],
) -> None:
    """Each request's max_computed_tokens (the highest num_computed_tokens it reached,
    across preemptions) never decreases and is >= num_computed_tokens; and
    phi = sum(max_computed_tokens + output tokens + ended) rises at least once every
    ceil(max_model_len / max_num_batched_tokens) + 3 steps (2x + 2 under async
    scheduling): only a preempted request's recompute may pass without progress."""
    case, workload = cw
    run_case(case, workload, ComputedProgress())
