"""A decode run's batches (`DecodeRun.batches`, deepinfer/decode_run.py) against the run
restated step by step from its docstring: request i is in the run's steps s < limits[i],
at context contexts[i] + s, and the run has `horizon` steps (docs/design.md,
"Fast-forward": past each finish the batch is one smaller).

The simulator's fast-forward test compares whole simulations, which read only the
sizes and sums the cost models price; this one also pins where each batch starts, and
that a new batch begins exactly where a request leaves. Runs are drawn as the scheduler
makes them: every limit at least 1, the horizon at least 1 and at most the longest limit
(a run through finishes goes to the last one), limits equal to each other and to the
horizon included.
"""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from deepinfer.decode_run import Batch, DecodeRun
from tests.property.strategies import at_least


@st.composite
def runs(draw: st.DrawFn) -> DecodeRun:
    n = draw(st.integers(1, 6))
    contexts = draw(st.lists(st.integers(0, 50), min_size=n, max_size=n))
    limits = draw(st.lists(st.integers(1, 12), min_size=n, max_size=n))
    horizon = draw(st.integers(1, max(limits)))
    return DecodeRun(
        requests=(),  # batches() reads only the contexts, limits and horizon
        contexts=tuple(contexts),
        limits=tuple(limits),
        horizon=horizon,
        first_step_id=1,
        in_flight_step=None,
        dropped_req_ids=frozenset(),
        num_preempted_before=0,
    )


def _steps(run: DecodeRun) -> list[tuple[int, int, int]]:
    """(requests, longest context, contexts' sum) of each of the run's steps, from the
    docstring's rule alone."""
    out = []
    for s in range(run.horizon):
        ctx = [c + s for c, h in zip(run.contexts, run.limits) if s < h]
        out.append((len(ctx), max(ctx), sum(ctx)))
    return out


def _expanded(batches: list[Batch]) -> list[tuple[int, int, int]]:
    """The steps the batches describe, in order (step first + s of a batch: longest
    context ctx_max + s, sum ctx_sum + num_reqs * s)."""
    out = []
    for b in batches:
        for s in range(b.num_steps):
            out.append((b.num_reqs, b.ctx_max + s, b.ctx_sum + b.num_reqs * s))
    return out


@at_least(300)
@given(runs())
def test_a_runs_batches_are_its_steps_cut_where_a_request_leaves(run: DecodeRun) -> None:
    batches = list(run.batches())
    assert _expanded(batches) == _steps(run)
    start = 0
    for b in batches:
        assert b.first == start, f"{batches}: a batch starts where the last one ended"
        assert b.num_steps >= 1, batches
        start += b.num_steps
    assert start == run.horizon
    # A batch ends only where a request leaves, and always there (below the horizon).
    leaves = {h for h in run.limits if h < run.horizon}
    assert {b.first + b.num_steps for b in batches[:-1]} == leaves, (batches, run.limits)


def test_a_run_that_outlives_two_of_its_requests_has_three_batches() -> None:
    """Pinned: limits 2 and 5 below a horizon of 7, a third request to the end."""
    run = DecodeRun((), (10, 3, 20), (5, 2, 7), 7, 1, None, frozenset(), 0)
    assert list(run.batches()) == [
        Batch(0, 2, 3, 20, 33),
        Batch(2, 3, 2, 22, 34),  # request 1 left: contexts 12 and 22
        Batch(5, 2, 1, 25, 25),  # request 0 left: context 25
    ]
