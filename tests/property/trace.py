"""The trace of a run, for asserting that an explicit example reaches the state it was
written for (tests/property/test_examples_reach.py).

Each `schedule()` call is kept with the scheduler state just before it, what it
decided, and the KVMirror's own account of the cache: the blocks held after the call
and, per admitted request, the blocks held just before its allocation and the blocks
the reference prefix dict finds for it. Usage and hits are read from the mirror, not
from the KV manager, so a trace says what the example reached by the suite's own
bookkeeping.
"""

from __future__ import annotations

from dataclasses import dataclass

from deepinfer.outputs import ScheduledRequest, SchedulerOutput
from tests.property.harness import Checker, Driver, Snapshot
from tests.property.mirror import Admission, KVMirror
from tests.property.strategies import EngineCase, Workload


@dataclass
class TracedStep:
    step: int  # engine steps taken before it
    clock: int  # the driver step (arrivals are stamped with these)
    in_flight: bool  # async: scheduled while the previous step runs
    before: Snapshot
    out: SchedulerOutput
    held_after: int  # distinct blocks in some request's table after the call (mirror)
    admissions: dict[str, Admission]  # requests (re)admitted by this call (mirror)

    def scheduled(self, req_id: str) -> ScheduledRequest | None:
        return next((sr for sr in self.out.scheduled if sr.req_id == req_id), None)

    def order(self) -> list[str]:
        return [sr.req_id for sr in self.out.scheduled]


class Tracer(Checker):
    """Records every `schedule()` call of a run; runs after `mirror` among the checkers."""

    def __init__(self, mirror: KVMirror) -> None:
        self.mirror = mirror
        self.steps: list[TracedStep] = []

    def on_schedule(self, d: Driver, out: SchedulerOutput, in_flight: bool) -> None:
        assert d.snap is not None
        admitted = {a.req_id: a for a in self.mirror.admissions}
        held = len(self.mirror.held())
        self.steps.append(TracedStep(d.steps, d.clock, in_flight, d.snap, out, held, admitted))


def trace_case(
    case: EngineCase, workload: Workload, *flavours: Checker
) -> tuple[Driver, list[TracedStep]]:
    """Run `workload` with `flavours` first (checkers that shape requests as they are
    added), then the KVMirror and the tracer; returns the driver and the trace."""
    d = Driver(case, workload, [])
    mirror = KVMirror.for_driver(d)
    tracer = Tracer(mirror)
    d.checkers = [*flavours, mirror, tracer]
    d.run()
    return d, tracer.steps
