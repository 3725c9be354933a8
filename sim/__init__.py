"""The simulator: traces, cost models, the simpy process, reports."""

from __future__ import annotations

from sim.simulator import SimResult, simulate
from sim.traces import Trace, TraceError, TraceRequest, load_trace

__all__ = ["SimResult", "Trace", "TraceError", "TraceRequest", "load_trace", "simulate"]
