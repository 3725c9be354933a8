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
- gap: start(N) - end(M), M the step launched before N: the device idle before N because
  N was queued after M had finished (0 when N was launched while M ran, as async
  scheduling intends);
- launch: the host's seconds inside N's launch (`launch_seconds`), what a profile point's
  `launch_s` measures: where it outlasts the span, the device waited on the host.
An empty step (never launched) has no events.

`SyncWatch` counts the calls that made the host wait for the device while it was
entered, by the Python line that made them: under async scheduling a launch that waits
for the step in flight leaves the device idle after it.
"""

from __future__ import annotations

import statistics
import time
import warnings
from collections import Counter
from pathlib import Path
from typing import Any

import torch


class StepEvents:
    def __init__(self, executor: Any) -> None:
        self.executor = executor
        # step id -> (start, end, the step launched before it: None for the first)
        self.events: dict[int, tuple[torch.cuda.Event, torch.cuda.Event, int | None]] = {}
        self.launch_seconds: dict[int, float] = {}  # step id -> the host's seconds in its launch
        self._own: Any = None  # an instance attribute execute_async shadowed on entry
        self._device = torch.device(getattr(executor, "device", "cuda"))

    def __enter__(self) -> StepEvents:
        executor = self.executor
        self._own = vars(executor).get("execute_async")
        inner = executor.execute_async
        last: list[int | None] = [None]

        def timed(out: Any) -> Any:
            with torch.cuda.device(self._device):
                start = torch.cuda.Event(enable_timing=True)
                end = torch.cuda.Event(enable_timing=True)
                start.record()
                t0 = time.perf_counter()
                handle = inner(out)
                self.launch_seconds[out.step_id] = time.perf_counter() - t0
                end.record()
            self.events[out.step_id] = (start, end, last[0])
            last[0] = out.step_id
            return handle

        executor.execute_async = timed
        return self

    def __exit__(self, *exc: object) -> None:
        if self._own is not None:
            self.executor.execute_async = self._own
        else:
            del self.executor.execute_async  # the class's method again
        if exc[0] is None:  # (after a failure, the body's error is the one to see)
            torch.cuda.synchronize(self._device)

    def step(self, step_id: int) -> tuple[float, float | None] | None:
        """(span, gap before) of one launched step in seconds (gap None for the first
        step timed); None if `step_id` was not launched while timing. After `__exit__`."""
        if step_id not in self.events:
            return None
        start, end, prev = self.events[step_id]
        gap = None
        if prev is not None:
            gap = max(self.events[prev][1].elapsed_time(start), 0.0) / 1e3
        return start.elapsed_time(end) / 1e3, gap

    def summary(self, step_ids: list[int]) -> dict[str, float]:
        """Over `step_ids` (the steps to judge, e.g. decode steps), in ms: the median and
        mean span, and the median and mean gap before (a few long stalls show in the
        mean alone)."""
        spans, gaps = [], []
        for sid in step_ids:
            got = self.step(sid)
            if got is None:
                continue
            spans.append(1e3 * got[0])
            if got[1] is not None:
                gaps.append(1e3 * got[1])
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
    event's `synchronize()` (a step's result read back) is not one of them. Other
    warnings raised meanwhile are shown as usual."""

    def __init__(self) -> None:
        self.counts: Counter[tuple[str, int]] = Counter()
        self._mode: int | None = None

    def __enter__(self) -> SyncWatch:
        self._mode = torch.cuda.get_sync_debug_mode()
        self._catch = warnings.catch_warnings(record=True)
        self._seen = self._catch.__enter__()
        warnings.simplefilter("always")
        try:
            torch.cuda.set_sync_debug_mode("warn")
        except Exception:
            self._catch.__exit__(None, None, None)
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        torch.cuda.set_sync_debug_mode(self._mode or 0)
        self._catch.__exit__(*exc)
        for w in self._seen:
            if "synchroniz" in str(w.message):
                self.counts[(Path(w.filename).name, w.lineno)] += 1
            else:
                warnings.warn_explicit(w.message, w.category, w.filename, w.lineno)

    def line(self, steps: int, top: int = 6) -> str:
        """The most frequent places, with their count per step (no ", " inside: the
        benchmarks' lines are split at it)."""
        if not self.counts:
            return "no synchronising calls"
        where = "; ".join(
            f"{f}:{n} x{c / max(steps, 1):.2f}" for (f, n), c in self.counts.most_common(top)
        )
        return f"synchronising calls a step: {where}"
