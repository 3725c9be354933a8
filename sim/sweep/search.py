"""Per config, which rates to simulate: fixed rates, or a bisection on the rate.

A search is a small state machine: `next_rates()` says what to run now, `record()`
takes a point's row. Its path depends only on its own rows, never on the order in
which points come back, so a sweep gives the same points whatever runs them.
"""

from __future__ import annotations

import math
from typing import Any

from sim.sweep.grid import RateSpec

# Statuses that do not depend on the rate (a request the engine can never serve, a
# config that cannot be built, a bug): probing other rates would learn nothing.
FATAL = ("rejected", "invalid", "error")


def round_rate(rate: float) -> float:
    """4 significant digits: readable, and a rate computed twice is the same float."""
    return float(f"{rate:.4g}")


class RateSearch:
    """Fixed rates (all at once) or: double/halve from `start` until the SLO is crossed,
    then bisect geometrically (rates span decades) until within `rel_tol`."""

    def __init__(self, spec: RateSpec, default_start: float) -> None:
        self.spec = spec
        self.rows: dict[float, dict[str, Any]] = {}
        self.lo: float | None = None  # highest rate that met the SLO
        self.hi: float | None = None  # lowest rate that did not
        self.done = False
        self.note = ""
        self._asked: set[float] = set()
        if spec.rates:
            self._queue = list(spec.rates)
        else:
            # The trace's own rate to 2 digits, so the doublings are round numbers.
            start = spec.start if spec.start is not None else float(f"{default_start:.2g}")
            self._queue = [round_rate(min(max(start, spec.min), spec.max))]

    def next_rates(self) -> list[float]:
        out, self._queue = self._queue, []
        self._asked.update(out)
        return out

    def record(self, rate: float, row: dict[str, Any]) -> None:
        self.rows[rate] = row
        if row.get("meets_slo"):
            self.lo = rate if self.lo is None else max(self.lo, rate)
        else:
            self.hi = rate if self.hi is None else min(self.hi, rate)
        if row.get("status") in FATAL:
            self.done, self.note = True, f"{row['status']}: {row.get('reason', '')}"
            return
        if self.spec.rates:
            self.done = len(self.rows) == len(self.spec.rates)
        else:
            self._step()

    def _step(self) -> None:
        s, lo, hi = self.spec, self.lo, self.hi
        if hi is None:  # met the SLO everywhere so far: go up
            assert lo is not None
            nxt = min(lo * 2, s.max)
            if lo >= s.max:
                self.note = f"meets the SLO up to rate.max={s.max:g}"
        elif lo is None:  # missed it everywhere so far: go down
            nxt = max(hi / 2, s.min)
            if hi <= s.min:
                self.note = f"misses the SLO down to rate.min={s.min:g}"
        else:
            nxt = math.sqrt(lo * hi)
            if hi / lo <= 1 + s.rel_tol:
                self.note = "converged"
        nxt = round_rate(nxt)
        if self.note or nxt in self._asked or len(self.rows) >= s.max_points:
            self.done = True
            self.note = self.note or f"stopped after rate.max_points={s.max_points}"
            return
        self._queue = [nxt]

    @property
    def max_rate(self) -> float | None:
        """The highest rate simulated that met the SLO (None: none did)."""
        return self.lo

    def remaining_estimate(self) -> int:
        """Points this search will still run, roughly: for the progress bar's total."""
        if self.done:
            return 0
        if self.spec.rates:
            return len(self.spec.rates) - len(self.rows)
        tol = math.log1p(self.spec.rel_tol)
        if self.lo is not None and self.hi is not None:
            span = math.log(self.hi / self.lo)
            return max(1, math.ceil(math.log2(max(span / tol, 1.0))))
        return 2 + math.ceil(math.log2(math.log(2) / tol))  # one more doubling, then bisect
