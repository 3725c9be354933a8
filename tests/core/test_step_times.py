"""What varlen's steps cost, as measured (deepinfer/step_times.py)."""

from __future__ import annotations

import pytest

from deepinfer.spec_policy import PROBE_EVERY, proposals
from deepinfer.step_times import MAX_ATTEMPTS, RETRY_AFTER, SETTLED, WINDOW, StepTimes


def test_a_price_is_the_lower_quartile_of_the_latest_window_steps() -> None:
    """One slow step, or a burst of them, does not set a price; the oldest step leaves
    the window as a new one comes."""
    times = StepTimes()
    unit = times.units(32, 2)
    ms = [30.0, 11.0, 45.0, 12.0, 13.0, 50.0, 55.0, 14.0]  # 8 = WINDOW steps
    assert len(ms) == WINDOW
    for t in ms:
        times.observe(32, 2, t / 1e3)
    assert times.prices(32)[2] * unit == pytest.approx(13.0e-3)  # the 3rd cheapest of 8
    times.observe(32, 2, 60e-3)  # 30 ms leaves; 11 / 12 / 13 / 14 stay
    assert times.prices(32)[2] * unit == pytest.approx(13.0e-3)
    times.observe(32, 2, 70e-3)  # 11 leaves
    assert times.prices(32)[2] * unit == pytest.approx(14.0e-3)
    fresh = StepTimes()
    for t in (40.0, 12.0, 41.0):  # up to three steps: the cheapest
        fresh.observe(32, 2, t / 1e3)
    assert fresh.prices(32)[2] * unit == pytest.approx(12.0e-3)


def test_a_length_timed_once_is_due_again_after_retry_after_steps_of_its_bucket() -> None:
    """Due exactly RETRY_AFTER steps of its bucket after its one step, not before; a
    length with SETTLED steps never; a batch priced from a neighbouring bucket reads
    that bucket's due lengths."""
    times = StepTimes()
    times.observe(32, 3, 0.030)
    for _ in range(SETTLED):
        times.observe(32, 1, 0.012)
    for _ in range(RETRY_AFTER - SETTLED - 1):
        times.observe(32, 2, 0.020)
    assert times.due(32) == set()  # 3 measured RETRY_AFTER - 1 steps of the bucket ago
    times.observe(32, 2, 0.020)
    assert times.due(32) == {3}
    assert times.pricing_bucket(20) == StepTimes.bucket(32)  # 16-31: nothing measured
    assert times.due(20) == {3} and times.prices(20) == times.prices(32)
    times.observe(32, 3, 0.030)
    assert times.due(32) == set()


def test_a_length_due_but_given_up_asks_the_drafter_for_no_extra_pass() -> None:
    """A length timed once and then chosen MAX_ATTEMPTS times without a uniform step
    (prompts arriving) is given up: it is not tried first, so asking the drafter for it
    every step would only add a chained pass each step (the review's scenario)."""
    times = StepTimes()
    times.observe(32, 3, 0.040)
    for _ in range(RETRY_AFTER):
        times.observe(32, 2, 0.020)
    for _ in range(MAX_ATTEMPTS):
        times.note_choice(32, 3)
    assert times.due(32) == {3} and times.given_up(32) == {3}
    steps = [s for s in range(1, 2 * PROBE_EVERY) if s % PROBE_EVERY]
    assert all(proposals(2, 3, 32, times, step_id=s) == 2 for s in steps)
    assert proposals(2, 3, 32, times, step_id=PROBE_EVERY) == 3  # a probe still asks


def test_extra_proposals_are_taken_out_of_a_steps_price() -> None:
    """A step whose drafter proposed P > max(1, L) drafts is priced as if it proposed its
    own L: its units count the extra chained passes; at the steady state nothing."""
    times = StepTimes()
    assert times.units(1, 3) == times.units(1, 3, proposals=3) == times.units(1, 3, 2)
    assert times.units(1, 0, proposals=1) == times.units(1, 0)
    assert times.units(1, 3, proposals=5) > times.units(1, 3)
    times.observe(1, 3, 0.0085, proposals=5)
    assert times.prices(1)[3] * times.units(1, 3) < 0.0085
