"""Varlen's policy (deepinfer/spec_policy.py) against the rules restated in
varlen_reference.py.

The measured times are a stand-in that answers `prices`, `settled` and `given_up`
from drawn values (and records the batch it was asked about), so the policy is judged
apart from `StepTimes` (test_step_times_model.py judges that). Confidences and prices
are multiples of 1/8 and 1/16: every E(L) and cost(L) is exact in floating point, so
the reference's sums, taken in another order, give the very same rates and the same
ties.
"""

from __future__ import annotations

import math
from typing import Any

from hypothesis import given
from hypothesis import strategies as st

from deepinfer.spec_policy import (
    confidences_from_chances,
    draft_lengths,
    proposals,
    smooth_chances,
)
from tests.property.strategies import at_least
from tests.property.varlen_reference import (
    chances,
    reference_confidences,
    reference_draft_lengths,
    reference_proposals,
    reference_smooth,
)

# 1, 0 and 1/2 often: exact ties between lengths (the shorter wins) need them
EIGHTHS = st.sampled_from([1.0, 0.0, 0.5]) | st.integers(0, 8).map(lambda k: k / 8)
PRICES = st.sampled_from([1.0, 0.5]) | st.integers(1, 32).map(lambda k: k / 16)
LENGTHS = st.integers(0, 7)


class DrawnTimes:
    """Measured times reduced to what the policy reads, for one batch size."""

    def __init__(
        self, prices: dict[int, float], settled: set[int], given_up: set[int], fixed: float
    ) -> None:
        self._prices, self._settled, self._given_up = prices, settled, given_up
        self.fixed_cost_tokens = fixed
        self.asked: set[int] = set()  # the batch sizes the policy asked about

    def prices(self, num_reqs: int) -> dict[int, float]:
        self.asked.add(num_reqs)
        return dict(self._prices)

    def settled(self, num_reqs: int) -> set[int]:
        self.asked.add(num_reqs)
        return set(self._settled)

    def given_up(self, num_reqs: int) -> set[int]:
        self.asked.add(num_reqs)
        return set(self._given_up)


@st.composite
def drawn_times(draw: st.DrawFn) -> DrawnTimes:
    prices = draw(st.dictionaries(LENGTHS, PRICES, max_size=5))
    # settled and given-up lengths mostly among the priced ones, as StepTimes gives them
    settled = draw(st.sets(st.sampled_from(sorted(prices) or [0]) | LENGTHS, max_size=5))
    given_up = draw(st.sets(LENGTHS, max_size=3))
    fixed = draw(st.sampled_from([0.0, 200.0, 2.0, 24.0]))
    return DrawnTimes(prices, settled, given_up, fixed)


@st.composite
def batch_confidences(draw: st.DrawFn) -> dict[str, list[float]]:
    """Confidences of up to five requests; in some batches all 1, where with S = 0 and
    equal prices every length ties."""
    element = st.just(1.0) if draw(st.integers(0, 3)) == 0 else EIGHTHS
    return draw(
        st.dictionaries(st.sampled_from("abcde"), st.lists(element, max_size=6), max_size=5)
    )


@at_least(300)
@given(
    confidences=batch_confidences(),
    max_len=st.integers(0, 6),
    times=st.none() | drawn_times(),
    pending=st.sets(LENGTHS, max_size=3),
    num_other_tokens=st.none() | st.integers(0, 40),
    fixed_cost_tokens=st.none() | st.sampled_from([0.0, 3.0, 50.0, 200.0]),
)
def test_draft_lengths_maximise_the_expected_tokens_per_cost(
    confidences: dict[str, list[float]],
    max_len: int,
    times: DrawnTimes | None,
    pending: set[int],
    num_other_tokens: int | None,
    fixed_cost_tokens: float | None,
) -> None:
    """Every request verifies min(L, its drafts) for the one best L; omitted arguments
    take the documented defaults (S = 200, no other tokens, nothing pending)."""
    kwargs: dict[str, Any] = {}
    if num_other_tokens is not None:
        kwargs["num_other_tokens"] = num_other_tokens
    if fixed_cost_tokens is not None:
        kwargs["fixed_cost_tokens"] = fixed_cost_tokens
    if times is not None:
        kwargs["times"] = times
    if pending:
        kwargs["pending"] = pending
    got = draft_lengths(confidences, max_len, **kwargs)
    want = reference_draft_lengths(confidences, max_len, **kwargs)
    assert got == want, f"lengths {got}, want {want}"
    if times is not None and confidences:
        assert times.asked == {len(confidences)}, f"asked about batches {times.asked}"


@at_least(300)
@given(
    length=LENGTHS,
    max_len=st.integers(0, 7),
    num_reqs=st.none() | st.integers(1, 9),
    settled=st.none() | st.sets(st.integers(0, 8), max_size=5),
    step_id=st.none() | st.integers(0, 13),
)
def test_the_drafter_is_asked_for_one_more_draft_on_a_probe_or_an_unsettled_length(
    length: int,
    max_len: int,
    num_reqs: int | None,
    settled: set[int] | None,
    step_id: int | None,
) -> None:
    kwargs: dict[str, Any] = {}
    if num_reqs is not None:
        kwargs["num_reqs"] = num_reqs
    if step_id is not None:
        kwargs["step_id"] = step_id
    times = None if settled is None else DrawnTimes({}, settled, set(), 200.0)
    if times is not None:
        kwargs["times"] = times
    got = proposals(length, max_len, **kwargs)
    assert got == reference_proposals(length, max_len, **kwargs)
    if times is not None and times.asked:
        assert times.asked == {num_reqs if num_reqs is not None else 1}


@at_least(300)
@given(
    means=st.lists(EIGHTHS, max_size=6),
    confidences=st.lists(EIGHTHS, max_size=6),
    weight=st.none() | st.sampled_from([0.0, 0.5, 0.25, 1.0]),
)
def test_running_means_move_toward_the_latest_chances(
    means: list[float], confidences: list[float], weight: float | None
) -> None:
    kwargs = {} if weight is None else {"weight": weight}
    assert smooth_chances(means, confidences, **kwargs) == reference_smooth(
        means, confidences, **kwargs
    )


@at_least(300)
@given(st.lists(EIGHTHS, max_size=6))
def test_confidences_from_chances_invert_the_running_products(confidences: list[float]) -> None:
    """Where no chance is 0 the products give back the chances; past a 0, confidences
    are 0."""
    ch = chances(confidences)
    got = confidences_from_chances(ch)
    assert got == reference_confidences(ch)
    if all(ch):
        assert all(math.isclose(a, b) for a, b in zip(chances(got), ch, strict=True))
    assert confidences_from_chances(confidences) == reference_confidences(confidences)


def test_a_tie_between_measured_lengths_centres_the_climb_on_the_shorter() -> None:
    """With S = 0, every draft certain and one price, every length's rate is the same
    ((1 + L) / (1 + L)): the best measured length is the shorter of 0 and 3, so the
    climb tries 1 (next to 0), not 2 or 4 (next to 3)."""
    times = DrawnTimes({0: 1.0, 3: 1.0}, settled={0, 3}, given_up=set(), fixed=0.0)
    confidences = {"a": [1.0] * 4}
    want = reference_draft_lengths(confidences, 4, times=times)
    assert want == {"a": 1}
    assert draft_lengths(confidences, 4, times=times) == want
