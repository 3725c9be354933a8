"""benchmarks/investigations/served_launches.py's reading of a step log: each timed
launch beside its profile price and the step before's device span, the launches as long
as a wait for that step, and the table by kind."""

from __future__ import annotations

from pathlib import Path

from benchmarks.investigations.served_launches import Launch, launches, summary, waits
from deepinfer.records import StepRecord
from deepinfer.step_log_file import LoggedStep, StepLogFile

DECODE = [[2, 1, 100, False]]
MIXED = [[2, 1, 100, False], [1, 64, 0, True]]


class _Fit:
    """A launch fit: 1 ms a decode step, 10 ms a step with prompt tokens."""

    def launch_seconds(self, out) -> float:  # type: ignore[no-untyped-def]
        return 0.010 if any(r.is_prompt for r in out.scheduled) else 0.001


def _step(n: int, groups: list, device: float | None, launch: float | None) -> LoggedStep:
    record = StepRecord(n, float(n), 0.01, 2, 0, 3, 0, 2, 0.1, 0)
    return LoggedStep(n + 1, record, groups, 0.0, 0.0, True, device, launch)


def test_each_launch_is_read_beside_its_price_and_the_step_before() -> None:
    steps = [
        _step(0, DECODE, 0.004, 0.001),
        _step(1, MIXED, 0.100, 0.020),  # its own work: no wait (the step before was short)
        _step(2, MIXED, 0.030, 0.095),  # as long as the 100 ms step before: a wait
        _step(3, DECODE, 0.004, None),  # untimed launch: left out
        _step(4, MIXED, 0.030, 0.012),  # after a short step
    ]
    log = StepLogFile(Path("x.jsonl"), {}, steps)
    rows = launches(log, _Fit())
    assert [(r.kind, r.served, r.priced, r.before) for r in rows] == [
        ("decode", 0.001, 0.001, None),
        ("mixed", 0.020, 0.010, 0.004),
        ("mixed", 0.095, 0.010, 0.100),
        ("mixed", 0.012, 0.010, 0.004),
    ]
    assert waits(rows) == [rows[2]]
    table = summary(rows)
    assert table["mixed"]["steps"] == 3 and table["mixed"]["p50"] == 0.020
    assert table["mixed"]["ratio_p50"] == 2.0 and table["decode"]["ratio_p50"] == 1.0


def test_a_long_launch_after_a_step_no_longer_than_its_price_is_no_wait() -> None:
    rows = [Launch("mixed", 0.025, 0.010, 0.025)]  # the step before under 3x the price
    assert waits(rows) == []
