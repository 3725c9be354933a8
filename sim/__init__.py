"""The simulator: traces, cost models, the simpy process, reports.

The names below are imported on first use, so that importing one submodule
(`sim.traces`, `sim.hardware`) does not load the simulator, the engine and simpy.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from sim.simulator import SimResult, simulate
    from sim.traces import Trace, TraceError, TraceRequest, load_trace

__all__ = ["SimResult", "Trace", "TraceError", "TraceRequest", "load_trace", "simulate"]


def __getattr__(name: str) -> Any:
    if name in ("SimResult", "simulate"):
        from sim import simulator

        value = getattr(simulator, name)
    elif name in ("Trace", "TraceError", "TraceRequest", "load_trace"):
        from sim import traces

        value = getattr(traces, name)
    else:
        raise AttributeError(f"module 'sim' has no attribute {name!r}")
    globals()[name] = value  # later lookups find it without this hook
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
