"""The columnar step log reads back the StepRecords it was given."""

from __future__ import annotations

import pytest

from deepinfer.records import StepRecord
from deepinfer.step_log import FIELDS, MergedSteps, StepLog, column


def _records(n: int, offset: int = 0) -> list[StepRecord]:
    return [
        StepRecord(
            offset + i, float((i * 7) % 5), 0.01 * i, i % 3, i % 2, 8 + i, i % 4, 3, i / 10,
            i % 2, None if i % 3 else i,
        )
        for i in range(n)
    ]  # fmt: skip


def test_appended_and_extended_records_read_back_the_same() -> None:
    recs = _records(9)
    log = StepLog(recs[:4])
    log.extend([[getattr(r, name) for r in recs[4:]] for name in FIELDS])
    assert len(log) == 9
    assert list(log) == recs
    assert log == recs and log == StepLog(recs)
    assert log[-1] == recs[-1] and log[2:5] == recs[2:5]
    assert list(column(log, "kv_usage")) == [r.kv_usage for r in recs]
    assert column(recs, "num_proposals") == [r.num_proposals for r in recs]


def test_extend_refuses_columns_that_do_not_fit() -> None:
    log = StepLog(_records(2))
    with pytest.raises(ValueError, match="columns"):
        log.extend([[1]] * (len(FIELDS) - 1))
    with pytest.raises(ValueError, match="different lengths"):
        log.extend([[1, 2]] + [[1]] * (len(FIELDS) - 1))
    assert list(log) == _records(2)  # a refused extend leaves the log as it was


def test_merged_steps_are_a_stable_sort_by_time() -> None:
    a, b = _records(11), _records(7, offset=100)
    want = sorted(a + b, key=lambda s: s.time)
    merged = MergedSteps([StepLog(a), b])
    assert list(merged) == want
    assert merged[3] == want[3] and merged[2:9] == want[2:9] and len(merged) == len(want)
    assert column(merged, "kv_usage") == [s.kv_usage for s in want]
    assert list(MergedSteps([])) == []
