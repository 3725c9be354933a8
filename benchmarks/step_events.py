"""CUDA events around each step an executor launches: where a served step's time goes
without a profiler's overhead.

    with StepEvents(executor) as ev:
        ... engine.step() ...
    print(ev.summary(step_ids))

Each launch (`execute_async`) is bracketed by two events on the current stream: one
queued before the step's device work, one after it. The device stamps them when it
reaches them, so for step N:
- span: end(N) - start(N), the device's time from N's first work to its last, kernels
  and any wait inside the launch for the host to queue more;
- gap: start(N) - end(N - 1), the device idle before N because N was queued after N - 1
  had finished (0 when N was launched while N - 1 ran, as async scheduling intends).
A step whose launch ran no device work (an empty step) is skipped.

`SyncWatch` counts the calls that made the host wait for the device while it was
entered, by the Python line that made them: under async scheduling a launch that waits
for the step in flight leaves the device idle after it.
"""

from __future__ import annotations

import statistics
import warnings
from collections import Counter
from pathlib import Path
from typing import Any

import torch


class StepEvents:
    def __init__(self, executor: Any) -> None:
        self.executor = executor
        self.events: dict[int, tuple[torch.cuda.Event, torch.cuda.Event]] = {}
        self._inner = None

    def __enter__(self) -> StepEvents:
        self._inner = inner = self.executor.execute_async

        def timed(out: Any) -> Any:
            start = torch.cuda.Event(enable_timing=True)
            end = torch.cuda.Event(enable_timing=True)
            start.record()
            handle = inner(out)
            end.record()
            self.events[out.step_id] = (start, end)
            return handle

        self.executor.execute_async = timed
        return self

    def __exit__(self, *exc: object) -> None:
        del self.executor.execute_async  # the class's method again
        torch.cuda.synchronize()

    def step(self, step_id: int) -> tuple[float, float | None] | None:
        """(span, gap before) of one launched step in seconds (gap None for the first
        step timed); None if `step_id` was not launched while timing. After `__exit__`."""
        if step_id not in self.events:
            return None
        start, end = self.events[step_id]
        prev = self.events.get(step_id - 1)
        gap = None if prev is None else max(prev[1].elapsed_time(start), 0.0) / 1e3
        return start.elapsed_time(end) / 1e3, gap

    def summary(self, step_ids: list[int]) -> dict[str, float]:
        """Medians over `step_ids` (the steps to judge, e.g. decode steps) in ms: span,
        gap before, and their sum per step; plus the mean gap (a few long stalls)."""
        spans, gaps = [], []
        for sid in step_ids:
            if sid not in self.events:
                continue
            start, end = self.events[sid]
            spans.append(start.elapsed_time(end))
            if sid - 1 in self.events:
                gaps.append(max(self.events[sid - 1][1].elapsed_time(start), 0.0))
        if not spans:
            return {}
        return {
            "steps": len(spans),
            "span_ms": statistics.median(spans),
            "gap_ms": statistics.median(gaps) if gaps else 0.0,
            "mean_gap_ms": statistics.fmean(gaps) if gaps else 0.0,
            "mean_span_ms": statistics.fmean(spans),
        }

    def line(self, step_ids: list[int]) -> str:
        s = self.summary(step_ids)
        if not s:
            return "no device events"
        return (  # (no ", " inside: benchmarks' lines are split at it)
            f"device span {s['span_ms']:.2f} ms (mean {s['mean_span_ms']:.2f}); "
            f"idle before {s['gap_ms']:.2f} ms (mean {s['mean_gap_ms']:.2f}) a step"
        )


class SyncWatch:
    """Synchronising CUDA calls (PyTorch's sync debug mode: blocking copies, `.item()`,
    `.tolist()` of device tensors, `nonzero`) made while entered, by file and line. An
    event's `synchronize()` (a step's result read back) is not one of them."""

    def __init__(self) -> None:
        self.counts: Counter[tuple[str, int]] = Counter()
        self._catch: Any = None
        self._seen: list[warnings.WarningMessage] = []

    def __enter__(self) -> SyncWatch:
        self._catch = warnings.catch_warnings(record=True)
        self._seen = self._catch.__enter__()
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        return self

    def __exit__(self, *exc: object) -> None:
        torch.cuda.set_sync_debug_mode("default")
        self._catch.__exit__(*exc)
        for w in self._seen:
            if "synchroniz" in str(w.message):
                self.counts[(Path(w.filename).name, w.lineno)] += 1

    def line(self, steps: int, top: int = 6) -> str:
        """The most frequent places, with their count per step."""
        if not self.counts:
            return "no synchronising calls"
        where = ", ".join(
            f"{f}:{n} x{c / max(steps, 1):.2f}" for (f, n), c in self.counts.most_common(top)
        )
        return f"synchronising calls a step: {where}"
