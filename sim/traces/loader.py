"""`load_trace`: any supported file -> a validated, windowed, scaled `Trace`."""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path

from sim.traces.azure import load_azure
from sim.traces.burstgpt import load_burstgpt
from sim.traces.detect import detect_format
from sim.traces.model import Trace, TraceError
from sim.traces.mooncake import load_mooncake
from sim.traces.native import load_native
from sim.traces.vidur import load_vidur

FORMATS: dict[str, Callable[[Path], Trace]] = {
    "native": load_native,
    "azure": load_azure,
    "mooncake": load_mooncake,
    "burstgpt": load_burstgpt,
    "vidur": load_vidur,
}


def load_trace(
    path: str | Path,
    format: str | None = None,
    *,
    time_scale: float = 1.0,
    max_requests: int | None = None,
    start: float | None = None,
    end: float | None = None,
) -> Trace:
    """Load a trace file, detecting its format unless `format` names one.

    In order: keep arrivals in [start, end) (seconds, as in the file) and
    subtract `start` from them; keep the first `max_requests` by arrival;
    multiply arrivals by `time_scale` (0.5 replays twice as fast). Every row
    is validated first, also rows the window drops, so a bad file fails the
    same way whatever window is asked for.
    """
    if not (math.isfinite(time_scale) and time_scale > 0):
        raise ValueError(f"time_scale must be a positive number, got {time_scale!r}")
    if max_requests is not None and max_requests < 0:
        raise ValueError(f"max_requests must be >= 0, got {max_requests!r}")
    if start is not None and end is not None and end <= start:
        raise ValueError(f"empty window: start={start!r} >= end={end!r}")
    path = Path(path)
    fmt = detect_format(path) if format is None else format.lower()
    if fmt not in FORMATS:
        raise TraceError(path, f"unknown trace format {format!r}; known: {', '.join(FORMATS)}")
    trace = FORMATS[fmt](path)
    return select(trace, time_scale=time_scale, max_requests=max_requests, start=start, end=end)


def select(
    trace: Trace,
    *,
    time_scale: float = 1.0,
    max_requests: int | None = None,
    start: float | None = None,
    end: float | None = None,
) -> Trace:
    """Window, truncate and rescale an already loaded trace (see `load_trace`)."""
    reqs = trace.requests
    if start is not None or end is not None:
        lo = -math.inf if start is None else start
        hi = math.inf if end is None else end
        reqs = [r for r in reqs if lo <= r.arrival < hi]
        if start is not None:
            reqs = [replace(r, arrival=r.arrival - start) for r in reqs]
    if max_requests is not None:
        reqs = reqs[:max_requests]
    if time_scale != 1.0:
        reqs = [replace(r, arrival=r.arrival * time_scale) for r in reqs]
    if reqs is trace.requests:
        return trace
    return Trace(trace.name, trace.source, reqs)
