"""Where the simulator's time goes per event: decode runs and the single steps between
them (issue 49: the cost of an arrival, and what a run through arrivals would save).

    python -m benchmarks.investigations.sim_event_costs TRACE [--model moonlight-16b-a3b]
        [--until SECONDS]

Pin it to one core (`taskset -c 0 ...`). One `simulate()` of the trace (its requests
arriving before --until), with timers around the engine's own methods:
- each decode run applied (`EngineCore.advance_decode`), with its requests and steps:
  a least-squares fit of its seconds as fixed + per request + per step + per
  request-step, which says how much of a run is paid once per run per request;
- finding runs (`EngineCore.decode_run`) and timing them (`sim.engine_loop._time_run`);
- each single step (`EngineCore._pipelined_step` or `_sync_step`: the engine's work of
  scheduling, launching and applying, the driver's pricing between its events left
  out), by what it scheduled: a prompt chunk (beside decodes or not), drafts to verify,
  decodes only, a step after preemptions, or nothing.
The timers add their own overhead (about a microsecond a call): read the shares and the
fit, not the absolute wall.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import time
import warnings
from collections import Counter, defaultdict
from collections.abc import Generator, Iterator
from pathlib import Path
from typing import Any

import numpy as np

import sim.engine_loop as engine_loop
from deepinfer.config import EngineConfig
from deepinfer.engine import EngineCore, StepEventKind
from deepinfer.outputs import SchedulerOutput
from sim import load_trace, simulate


def step_kind(out: SchedulerOutput) -> str:
    """What a single step scheduled: 'decodes+prompt' (a prompt chunk, beside decodes or
    not), 'verify' (drafts verified, no prompt chunk), 'decodes' (one token each),
    'preempting' (requests preempted since the step before), or 'empty'."""
    if not out.scheduled:
        return "empty"
    if out.preempted_req_ids:
        return "preempting"
    if any(r.is_prompt and r.num_tokens > 1 for r in out.scheduled):
        return "decodes+prompt"
    if any(r.num_tokens > 1 for r in out.scheduled):
        return "verify"
    return "decodes"


class EventTimers:
    """Seconds spent in the engine's run and single-step methods while installed."""

    def __init__(self) -> None:
        self.runs: list[tuple[int, int, float]] = []  # (requests, steps, seconds) a run
        self.seconds: defaultdict[str, float] = defaultdict(float)
        self.counts: Counter[str] = Counter()
        self.decodes: Counter[str] = Counter()  # single steps' decodes, by kind

    @contextlib.contextmanager
    def installed(self) -> Iterator[None]:
        """The timers around the methods for the duration (serve_engine calls the module's
        `_time_run` global: it is replaced there)."""
        targets: list[tuple[Any, str]] = [
            (EngineCore, "advance_decode"), (EngineCore, "decode_run"),
            (EngineCore, "_pipelined_step"), (EngineCore, "_sync_step"),
            (engine_loop, "_time_run"),
        ]  # fmt: skip
        saved = {name: getattr(owner, name) for owner, name in targets}
        advance, find, time_run = saved["advance_decode"], saved["decode_run"], saved["_time_run"]
        timers = self

        def timed_advance(core: EngineCore, run: Any, launched: Any, applied: Any) -> None:
            t0 = time.perf_counter()
            advance(core, run, launched, applied)
            timers.runs.append((run.num_reqs, len(applied), time.perf_counter() - t0))

        def timed_find(core: EngineCore, *args: Any) -> Any:
            t0 = time.perf_counter()
            found = find(core, *args)
            timers.seconds["decode_run"] += time.perf_counter() - t0
            timers.counts["decode_run"] += 1
            return found

        def timed_time_run(*args: Any) -> Any:
            t0 = time.perf_counter()
            timed = time_run(*args)
            timers.seconds["_time_run"] += time.perf_counter() - t0
            return timed

        wrapped = {
            "advance_decode": timed_advance,
            "decode_run": timed_find,
            "_pipelined_step": self._timed_step(saved["_pipelined_step"]),
            "_sync_step": self._timed_step(saved["_sync_step"]),
            "_time_run": timed_time_run,
        }
        for owner, name in targets:
            setattr(owner, name, wrapped[name])
        try:
            yield
        finally:
            for owner, name in targets:
                setattr(owner, name, saved[name])

    def _timed_step(self, step: Any) -> Any:
        """`step` (a single step's coroutine) timed without the driver's time between its
        events, and filed under the kind of what it scheduled."""
        timers = self

        def timed(core: EngineCore) -> Generator[Any, None, Any]:
            spent, kind, decodes = 0.0, "no schedule", 0
            events = step(core)
            t0 = time.perf_counter()
            try:
                event = next(events)
                while True:
                    if kind == "no schedule" and event[0] is StepEventKind.SCHEDULED:
                        kind = step_kind(event[1])
                        decodes = sum(
                            not r.is_prompt and r.num_tokens == 1 for r in event[1].scheduled
                        )
                    spent += time.perf_counter() - t0
                    sent = yield event
                    t0 = time.perf_counter()
                    event = events.send(sent)
            except StopIteration as done:
                spent += time.perf_counter() - t0
                timers.seconds[kind] += spent
                timers.counts[kind] += 1
                timers.decodes[kind] += decodes
                return done.value

        return timed

    def report(self, wall: float) -> list[str]:
        lines = []
        if self.runs:
            a = np.array(self.runs)
            n, k, s = a[:, 0], a[:, 1], a[:, 2]
            fit, *_ = np.linalg.lstsq(np.stack([np.ones_like(n), n, k, n * k], 1), s, rcond=None)
            lines.append(
                f"decode runs applied: {len(a)}, {n.mean():.1f} requests and {k.mean():.1f} steps "
                f"on average, {s.sum():.2f} s ({100 * s.sum() / wall:.0f}%)"
            )
            lines.append(
                f"  a run's seconds fitted: {1e6 * fit[0]:.1f} us fixed + {1e6 * fit[1]:.2f} us a "
                f"request + {1e6 * fit[2]:.2f} us a step + {1e6 * fit[3]:.3f} us a request-step"
            )
        calls = self.counts["decode_run"]
        if calls:
            found = self.seconds["decode_run"]
            lines.append(
                f"finding runs: {calls} calls, {1e6 * found / calls:.1f} us a call, {found:.2f} s"
            )
        lines.append(f"timing runs: {self.seconds['_time_run']:.2f} s")
        for kind in ("decodes+prompt", "verify", "decodes", "preempting", "empty", "no schedule"):
            count = self.counts[kind]
            if count:
                spent = self.seconds[kind]
                lines.append(
                    f"single steps, {kind}: {count}, {self.decodes[kind] / count:.1f} decodes "
                    f"each, {1e6 * spent / count:.1f} us a step, {spent:.2f} s "
                    f"({100 * spent / wall:.0f}%)"
                )
        return lines


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("trace", type=Path)
    ap.add_argument("--model", default="moonlight-16b-a3b")
    ap.add_argument("--until", type=float, default=None, help="only requests arriving before (s)")
    args = ap.parse_args(argv)
    trace = load_trace(args.trace)
    if args.until is not None:
        kept = [r for r in trace.requests if r.arrival < args.until]
        trace = dataclasses.replace(trace, requests=kept)
    timers = EventTimers()
    with timers.installed(), warnings.catch_warnings():
        warnings.simplefilter("ignore")  # (extrapolation warnings: not what this reads)
        t0 = time.perf_counter()
        result = simulate(trace, model=args.model, engine=EngineConfig())
        wall = time.perf_counter() - t0
    steps = result.meta["num_steps"]
    print(f"{args.trace.name}: {len(trace)} requests, {steps} steps, {wall:.2f} s of simulate()")
    for line in timers.report(wall):
        print("  " + line)


if __name__ == "__main__":
    main()
