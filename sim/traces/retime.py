"""The same requests at new arrival times: all at once, or as a seeded Poisson process.

Capacity planning (`deepinfer sweep`) and the fidelity benchmark both keep a trace's
sizes and replace its timing, so they share this one implementation.
"""

from __future__ import annotations

import random
from dataclasses import replace

from sim.traces.model import Trace


def retimed(trace: Trace, arrivals: list[float], name: str) -> Trace:
    """The same requests, in order, arriving at `arrivals` (one per request)."""
    if len(arrivals) != len(trace.requests):
        raise ValueError(f"{len(arrivals)} arrival times for {len(trace.requests)} requests")
    reqs = [replace(r, arrival=a) for r, a in zip(trace.requests, arrivals, strict=True)]
    return Trace(name, trace.source, reqs)


def offline(trace: Trace) -> Trace:
    """Every request arriving at time 0 (an offline batch)."""
    return retimed(trace, [0.0] * len(trace), f"{trace.name} offline")


def poisson(trace: Trace, rate: float, seed: int = 0) -> Trace:
    """The trace's requests, in order, arriving as a Poisson process of `rate` per second.

    The first request arrives at 0. The gaps are `-ln(1-u)/rate` of one seeded stream
    of u, so the same seed at two rates gives the same arrival pattern scaled by their
    ratio (common random numbers): latency against rate is then smooth enough for a
    bisection on the rate.
    """
    if not rate > 0 or rate == float("inf"):
        raise ValueError(f"rate={rate!r}: must be a positive finite number of requests/s")
    rng = random.Random(seed)
    t, arrivals = 0.0, []
    for _ in trace.requests:
        arrivals.append(t)
        t += rng.expovariate(rate)
    return retimed(trace, arrivals, f"{trace.name} at {rate:.4g} req/s")
