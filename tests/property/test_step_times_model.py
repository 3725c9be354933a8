"""Varlen's measured step times (deepinfer/step_times.py) against `ReferenceStepTimes`
(varlen_reference.py), which keeps the whole history of choices and timed steps and
answers each query from it by the documented rule.

Generated runs mix choices and timed steps over batches of several buckets (a step
filed under the bucket its length was chosen in, a drafter that proposed more than the
step verified, steps with no request or no time that teach nothing), bursts of one
length long enough to push a step out of the window or past `stale_after` (the
default 256 included), and small `retry_after` / `stale_after` so that due, stale and
neighbouring-bucket prices all happen. After each, every query agrees for every batch
size of the buckets used.
"""

from __future__ import annotations

import math
from typing import Any

from hypothesis import given
from hypothesis import strategies as st

from deepinfer.step_times import StepTimes
from tests.property.strategies import at_least
from tests.property.varlen_reference import ReferenceStepTimes, bucket_of, model_units

BATCHES = [0, 1, 3, 4, 7, 12, 17]  # buckets 0 to 5
LENGTHS = st.integers(0, 4)


def _same_prices(got: dict[int, float], want: dict[int, float], what: str) -> None:
    assert got.keys() == want.keys(), f"{what}: lengths {sorted(got)}, want {sorted(want)}"
    for length, price in want.items():
        assert math.isclose(got[length], price, rel_tol=1e-12), f"{what}[{length}]"


def agree(times: StepTimes, ref: ReferenceStepTimes, step: int) -> None:
    for n in BATCHES:
        at = f"after op {step}, batch {n}"
        assert StepTimes.bucket(n) == bucket_of(n), at
        assert times.num_measured(n) == ref.num_measured(n), at
        assert times.pricing_bucket(n) == ref.pricing_bucket(n), at
        _same_prices(times.prices(n), ref.prices(n), f"prices {at}")
        _same_prices(times.per_unit(n), ref.per_unit(n), f"per_unit {at}")
        assert times.given_up(n) == ref.given_up(n), f"given_up {at}"
        assert times.due(n) == ref.due(n), f"due {at}"
        assert times.settled(n) == ref.settled(n), f"settled {at}"


@st.composite
def operations(draw: st.DrawFn) -> list[tuple[Any, ...]]:
    """Choices and timed steps over a few batch sizes and lengths per run, so that a
    length is chosen, timed, chosen again and given up within one run."""
    batches = st.sampled_from(draw(st.lists(st.sampled_from(BATCHES), min_size=1, max_size=3)))
    lengths = st.integers(0, draw(st.integers(0, 4)))
    out: list[tuple[Any, ...]] = []
    for _ in range(draw(st.integers(1, 20))):
        kind = draw(st.integers(0, 9))
        n, length = draw(batches), draw(lengths)
        if kind <= 2:
            out.append(("choice", n, length))
            continue
        seconds = draw(st.sampled_from([0.01, 0.02, 0.03, 0.05, 0.0, -0.01]))
        at_choice = draw(st.none() | batches)
        proposed = draw(st.none() | st.integers(0, 6))
        count = 1 if kind <= 8 else draw(st.sampled_from([3, 9, 3, 9, 257]))
        out.append(("observe", n, length, seconds, at_choice, proposed, count))
    return out


@at_least(200)
@given(
    ops=operations(),
    fixed=st.none() | st.sampled_from([0.0, 10.0, 200.0]),
    stale_after=st.none() | st.integers(1, 12),
    retry_after=st.none() | st.integers(1, 6),
)
def test_step_times_answer_as_the_history_says(
    ops: list[tuple[Any, ...]],
    fixed: float | None,
    stale_after: int | None,
    retry_after: int | None,
) -> None:
    kwargs: dict[str, Any] = {}
    if fixed is not None:
        kwargs["fixed_cost_tokens"] = fixed
    if stale_after is not None:
        kwargs["stale_after"] = stale_after
    if retry_after is not None:
        kwargs["retry_after"] = retry_after
    times, ref = StepTimes(**kwargs), ReferenceStepTimes(**kwargs)
    agree(times, ref, 0)
    for i, op in enumerate(ops, 1):
        if op[0] == "choice":
            times.note_choice(op[1], op[2])
            ref.note_choice(op[1], op[2])
        else:
            _, n, length, seconds, at_choice, proposed, count = op
            for j in range(count):
                secs = seconds * (1 + j % 3)  # a burst's steps differ, cheapest first
                obs: dict[str, Any] = {}
                if at_choice is not None:
                    obs["num_reqs_at_choice"] = at_choice
                if proposed is not None:
                    obs["proposals"] = proposed
                times.observe(n, length, secs, **obs)
                ref.observe(n, length, secs, **obs)
        agree(times, ref, i)


@at_least(100)
@given(
    n=st.integers(0, 300),
    length=st.integers(0, 6),
    proposed=st.none() | st.integers(0, 9),
    fixed=st.none() | st.sampled_from([0.0, 10.0, 200.0]),
)
def test_a_steps_units_are_its_tokens_plus_the_fixed_cost_and_extra_passes(
    n: int, length: int, proposed: int | None, fixed: float | None
) -> None:
    times = StepTimes() if fixed is None else StepTimes(fixed_cost_tokens=fixed)
    want = model_units(n, length, proposed, 200.0 if fixed is None else fixed)
    got = times.units(n, length) if proposed is None else times.units(n, length, proposed)
    assert math.isclose(got, want, rel_tol=1e-12), f"units {got}, want {want}"
