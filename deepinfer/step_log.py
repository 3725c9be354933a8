"""The engine's step log: its StepRecords, held as columns.

An hour of a simulated cluster is millions of steps. A record object per step costs
its allocation, and every live record is one more object for the garbage collector to
count and pass over, which triggers its passes over the whole heap: held as one list
per field, the log adds no container per step, and a decode run
(deepinfer/decode_run.py) appends its steps' fields in bulk (`extend`, a list's
extend per field). A reader sees the same StepRecords, built when read (indexing,
iterating), or reads a field's column whole (`column`).
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Sequence
from dataclasses import fields
from itertools import chain
from operator import attrgetter
from typing import Any, overload

from deepinfer.records import StepRecord

FIELDS = tuple(f.name for f in fields(StepRecord))
_fields_of = attrgetter(*FIELDS)  # a record -> its fields' values, in FIELDS' order


class StepLog(Sequence[StepRecord]):
    """StepRecords in order of appending, one column per field of StepRecord (FIELDS).
    A record read from it is built from the columns: changing it changes nothing here."""

    __slots__ = ("_columns",)

    def __init__(self, records: Iterable[StepRecord] = ()) -> None:
        self._columns: tuple[list[Any], ...] = tuple([] for _ in FIELDS)
        for rec in records:
            self.append(rec)

    def append(self, rec: StepRecord) -> None:
        for column, value in zip(self._columns, _fields_of(rec)):
            column.append(value)

    def extend(self, columns: Sequence[Iterable[Any]]) -> None:
        """Append records given as their fields' values, one iterable a field in FIELDS'
        order, each as long as the others."""
        if len(columns) != len(FIELDS):
            raise ValueError(f"StepLog.extend: {len(columns)} columns for {len(FIELDS)} fields")
        size = len(self)
        for column, values in zip(self._columns, columns):
            column.extend(values)
        if len(set(map(len, self._columns))) != 1:
            for column in self._columns:
                del column[size:]
            raise ValueError("StepLog.extend: columns of different lengths")

    def column(self, name: str) -> Sequence[Any]:
        """Every record's `name` field, in order (the log's own column: read, not change)."""
        return self._columns[FIELDS.index(name)]

    def __len__(self) -> int:
        return len(self._columns[0])

    @overload
    def __getitem__(self, index: int) -> StepRecord: ...

    @overload
    def __getitem__(self, index: slice) -> list[StepRecord]: ...

    def __getitem__(self, index: int | slice) -> StepRecord | list[StepRecord]:
        if isinstance(index, slice):
            return list(map(StepRecord, *(column[index] for column in self._columns)))
        return StepRecord(*(column[index] for column in self._columns))

    def __iter__(self) -> Iterator[StepRecord]:
        return map(StepRecord, *self._columns)

    def __eq__(self, other: object) -> bool:
        if isinstance(other, StepLog):
            return all(a == b for a, b in zip(self._columns, other._columns))
        if isinstance(other, list):
            return list(self) == other
        return NotImplemented

    __hash__ = None  # type: ignore[assignment]

    def __repr__(self) -> str:
        return f"StepLog({len(self)} steps)"


class MergedSteps(Sequence[StepRecord]):
    """Several step logs' records in order of time, those of equal times in the order
    given (what a stable sort of their concatenation by time gives): a cluster's steps.
    A field's column is put in that order when first read (a summary reads a few of
    them; the records, built when read, all)."""

    __slots__ = ("_parts", "_order", "_columns")

    def __init__(self, logs: Iterable[Sequence[StepRecord]]) -> None:
        import numpy as np

        self._parts = [log if isinstance(log, StepLog) else StepLog(log) for log in logs]
        times = np.array(self._concatenated("time"), dtype=np.float64)
        self._order = np.argsort(times, kind="stable")
        self._columns: dict[str, list[Any]] = {}

    def _concatenated(self, name: str) -> list[Any]:
        return list(chain.from_iterable(log.column(name) for log in self._parts))

    def column(self, name: str) -> Sequence[Any]:
        """Every record's `name` field, in order of time."""
        ordered = self._columns.get(name)
        if ordered is None:
            import numpy as np

            values = np.empty(len(self._order), dtype=object)  # the values themselves
            values[:] = self._concatenated(name)
            ordered = self._columns[name] = values[self._order].tolist()
        return ordered

    def __len__(self) -> int:
        return len(self._order)

    @overload
    def __getitem__(self, index: int) -> StepRecord: ...

    @overload
    def __getitem__(self, index: slice) -> list[StepRecord]: ...

    def __getitem__(self, index: int | slice) -> StepRecord | list[StepRecord]:
        columns = [self.column(name) for name in FIELDS]
        if isinstance(index, slice):
            return list(map(StepRecord, *(column[index] for column in columns)))
        return StepRecord(*(column[index] for column in columns))

    def __iter__(self) -> Iterator[StepRecord]:
        return map(StepRecord, *(self.column(name) for name in FIELDS))

    def __repr__(self) -> str:
        return f"MergedSteps({len(self)} steps of {len(self._parts)} logs)"


def column(steps: Sequence[StepRecord], name: str) -> Sequence[Any]:
    """Every step's `name` field, in order: a StepLog's column, else read off each record."""
    if isinstance(steps, (StepLog, MergedSteps)):
        return steps.column(name)
    return [getattr(s, name) for s in steps]
