"""The engine loop itself (`EngineCore.step_events`, which `step()` and the simulator
drive): its events, the step durations it measures, and what it does when the executor
fails a step at launch or when its result is collected.

The rest of the suite calls `schedule()` / `process()` by hand; here the loop runs as the
simulator runs it, on a clock that only the driver moves: host time at each `SCHEDULED`
event, a step's device time when its result is collected.
"""

from __future__ import annotations

from collections.abc import Collection
from dataclasses import dataclass

from hypothesis import example, given
from hypothesis import strategies as st

from deepinfer.config import EngineConfig
from deepinfer.engine import EngineCore, StepEventKind
from deepinfer.errors import RequestFailed, SchedulerStalled
from deepinfer.executor import Executor, StepHandle
from deepinfer.outputs import ModelRunnerOutput, SchedulerOutput
from deepinfer.request import Request, RequestStatus
from sim.sim_executor import SimExecutor
from tests.property.harness import (
    CORE_CHECKS,
    admissible,
    expected_end,
    make_request,
    note,
    step_bound,
)
from tests.property.strategies import (
    EngineCase,
    ReqSpec,
    Workload,
    any_case_and_workload,
    scaled,
    sim_token,
)

S = RequestStatus
HOST = 0.125  # host time of a SCHEDULED event (binary fractions: sums are exact)
NAMED_REASON = "token id 10**9 is out of the vocabulary"


def device_time(step_id: int) -> float:
    """A step's device time: longer than HOST, so async overlap hides the host's time."""
    return 0.25 * (1 + step_id % 4)


def _reasons(f: Failure) -> dict[str, str]:
    """The requests a failure aborts: those it names, else all of its step's."""
    if isinstance(f.error, RequestFailed):
        return f.error.reasons
    text = f"{type(f.error).__name__}: {f.error}"
    return {sr.req_id: text for sr in f.out.scheduled}


class LoopClock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


@dataclass(frozen=True)
class Fault:
    at_launch: bool  # else when the result is collected
    named: bool  # a RequestFailed naming one request of the step, else a plain error
    victim: int  # index into the step's scheduled requests


@dataclass
class Failure:
    out: SchedulerOutput
    at_launch: bool
    error: Exception
    live: set[str]  # requests live when the executor raised


class _Handle(StepHandle):
    def __init__(self, ex: FaultySim, out: SchedulerOutput, res: ModelRunnerOutput) -> None:
        self.ex, self.out, self.res = ex, out, res
        # The device runs one step at a time: one launched while another runs (async
        # scheduling) starts when that one ends.
        self.launched_at = ex.clock.now
        self.ready_at = max(ex.clock.now, ex.device_free) + device_time(out.step_id)
        self.before = ex.last  # the step the device ran before this one
        self.read = False
        ex.device_free, ex.last = self.ready_at, self

    def duration(self) -> float:
        """The duration the loop should record: its device time, counted from when the
        step before it ended. When the engine never read that step (it failed along
        with the step before it), the loop cannot know when the device was free: from
        this step's launch."""
        if self.before is not None and not self.before.read:
            return self.ready_at - self.launched_at
        return device_time(self.out.step_id)

    def result(self, timeout: float | None = None) -> ModelRunnerOutput:
        # The device ran while the host went on (async): the result is there when the
        # device finished it, or now if the host took longer.
        self.read = True
        clock = self.ex.clock
        clock.now = max(clock.now, self.ready_at)
        fault = self.ex.faults.get(self.out.step_id)
        if fault is not None and not fault.at_launch:
            self.ex.fail(self.out, fault)
        return self.res


class FaultySim(Executor):
    """SimExecutor behind execute_async: each step takes device_time(out) on the clock,
    and chosen steps (by step id) fail at launch or when their result is collected."""

    needs_token_ids = False

    def __init__(
        self,
        inner: SimExecutor,
        clock: LoopClock,
        faults: dict[int, Fault],
        engine_ref: list,
        apart: Collection[int] = (),
    ) -> None:
        self.inner, self.clock, self.faults, self.engine_ref = inner, clock, faults, engine_ref
        self.apart = apart  # step ids that cannot run beside the step in flight
        self.launched: list[int] = []  # step ids, in launch order
        self.scheduled_events: set[int] = set()  # step ids the loop announced as SCHEDULED
        self.failures: list[Failure] = []
        self.unannounced: list[int] = []  # step ids launched with no SCHEDULED event first
        self.device_free = 0.0  # when the device ends the last step launched
        self.last: _Handle | None = None  # the last step launched
        self.handles: dict[int, _Handle] = {}  # step id -> its handle

    def num_kv_blocks(self) -> int:
        return self.inner.num_kv_blocks()

    def execute(self, out: SchedulerOutput) -> ModelRunnerOutput:
        return self.inner.execute(out)

    def can_overlap(self, out: SchedulerOutput) -> bool:
        return out.step_id not in self.apart

    def execute_async(self, out: SchedulerOutput) -> _Handle:
        engine = self.engine_ref[0]
        if out.step_id in self.apart and engine._in_flight is not None:
            raise AssertionError(f"step {out.step_id} launched beside the step in flight")
        if out.step_id not in self.scheduled_events:  # (raised here, the engine would catch it)
            self.unannounced.append(out.step_id)
        fault = self.faults.get(out.step_id)
        if fault is not None and fault.at_launch:
            self.fail(out, fault)
        self.launched.append(out.step_id)
        handle = self.handles[out.step_id] = _Handle(self, out, self.inner.execute(out))
        return handle

    def fail(self, out: SchedulerOutput, fault: Fault) -> None:
        live = set(self.engine_ref[0].scheduler.requests)
        error: Exception
        if fault.named and out.scheduled:
            victim = out.scheduled[fault.victim % len(out.scheduled)].req_id
            error = RequestFailed({victim: NAMED_REASON})
        else:
            error = IndexError("index out of range in self")
        self.failures.append(Failure(out, fault.at_launch, error, live))
        raise error

    def shutdown(self) -> None: ...


class Loop:
    """Drives EngineCore.step_events as the simulator does, with arrivals and aborts at
    loop iterations, checking the events, the step records and each failure."""

    def __init__(
        self,
        case: EngineCase,
        workload: Workload,
        faults: dict[int, Fault],
        apart: Collection[int] = (),
    ) -> None:
        cfg = case.config
        self.case, self.workload = case, workload
        self.clock = LoopClock()
        ref: list[EngineCore] = []
        inner = SimExecutor(cfg, cfg.num_gpu_blocks, acceptance_rate=case.acceptance_rate)
        self.ex = FaultySim(inner, self.clock, faults, ref, apart)
        self.engine = EngineCore(cfg, self.ex, clock=self.clock, check_invariants=CORE_CHECKS)
        ref.append(self.engine)
        self.reqs: dict[str, Request] = {}
        self.failed: dict[str, str] = {}  # req_id -> reason, of those a failure aborted
        self.fail_times: dict[str, float] = {}

    def run(self) -> Loop:
        arrivals = sorted(self.workload, key=lambda s: s.arrival_step)
        aborts = sorted((s.abort_step, s.req_id) for s in self.workload if s.abort_step is not None)
        t = steps = 0
        bound = 2 * step_bound(self.case, self.workload)  # a failed step is done again
        while True:
            while arrivals and arrivals[0].arrival_step <= t:
                s = arrivals.pop(0)
                self.reqs[s.req_id] = make_request(s)
                self.engine.add_request(self.reqs[s.req_id])
            while aborts and aborts[0][0] <= t:
                self.engine.abort(aborts.pop(0)[1])
            if not self.engine.has_unfinished():
                if not arrivals:
                    return self
                t = arrivals[0].arrival_step
                continue
            try:
                self.iteration()
            except SchedulerStalled:
                events = [s.arrival_step for s in arrivals] + [step for step, _ in aborts]
                assert events, "liveness: stalled with no arrival or abort left"
                t = max(t, min(events) - 1)  # nothing changes before the next of them
            t, steps = t + 1, steps + 1
            assert steps <= bound, f"liveness: unfinished after {steps} loop iterations"

    def iteration(self) -> None:
        """One run of step_events, checking each event and what the run returned."""
        n_failures, n_steps = len(self.ex.failures), len(self.engine.steps)
        seen: list[tuple[StepEventKind, int]] = []
        scheduled: list[SchedulerOutput] = []
        gen = self.engine.step_events()
        while True:
            try:
                kind, out = next(gen)
            except StopIteration as done:
                returned: list[Request] = done.value
                break
            seen.append((kind, out.step_id))
            if kind is StepEventKind.SCHEDULED:
                assert not out.is_empty, f"events: empty step {out.step_id} announced ({seen})"
                assert out.step_id not in self.ex.scheduled_events, f"events: twice ({seen})"
                self.ex.scheduled_events.add(out.step_id)
                scheduled.append(out)
                self.clock.now += HOST  # the host's time for the step it scheduled
            elif kind is StepEventKind.LAUNCHED:
                assert self.ex.launched and self.ex.launched[-1] == out.step_id, (
                    f"events: LAUNCHED step {out.step_id} was not the last launched ({seen})"
                )
            else:
                assert out.step_id in self.ex.launched, f"events: AWAIT before launch ({seen})"
        assert not self.ex.unannounced, (
            f"events: steps {self.ex.unannounced} launched with no SCHEDULED event ({seen})"
        )
        for rec in self.engine.steps[n_steps:]:  # the step whose results came
            want = (self.clock.now, self.ex.handles[rec.step_id].duration())
            assert (rec.time, rec.duration) == want, (
                f"step {rec.step_id}: recorded (time, duration) {(rec.time, rec.duration)}; "
                f"its results came at {want[0]}, {want[1]} after the device began it"
            )
        fails = self.ex.failures[n_failures:]
        at_launch = [f for f in fails if f.at_launch]
        collected = [f for f in fails if not f.at_launch]
        if collected:
            # Failing when collected under async, the step launched meanwhile fails with
            # it; when its launch failed too, that error's reasons apply, after these.
            (g,) = collected
            undone = [g.out] + [o for o in scheduled if o is not g.out]
            if len(undone) > 1:
                note("a step failed with the next one launched")
            reasons = {**(_reasons(at_launch[0]) if at_launch else {}), **_reasons(g)}
            self.check_failure(g, undone, reasons, g.live, returned)
        elif at_launch:
            (f,) = at_launch
            # (async: launched before the step in flight was applied, which may have
            # finished some of its requests: those stay finished)
            live = f.live - {r.request_id for r in returned if r.status is S.FINISHED}
            self.check_failure(f, [f.out], _reasons(f), live, returned)

    def check_failure(
        self,
        f: Failure,
        undone: list[SchedulerOutput],
        reasons: dict[str, str],
        live: set[str],
        returned: list[Request],
    ) -> None:
        """The requests the errors name (all of the failed step's when one names none) end
        aborted with its reason, returned by the loop; every other request of the failed
        step, and of the step launched after it, is requeued holding no block."""
        note(
            f"a step failed ({'at launch' if f.at_launch else 'collected'}, {type(f.error).__name__})"
        )
        where = f"step {f.out.step_id} failed ({f.error!r})"
        for rid in {sr.req_id for o in undone for sr in o.scheduled} & live:
            req = self.reqs[rid]
            if rid in reasons:
                assert (req.status, req.reject_reason) == (S.ABORTED, reasons[rid]), (
                    f"{where}: {rid} is {req.status.value} ({req.reject_reason!r}), "
                    f"want aborted ({reasons[rid]!r})"
                )
                assert req in returned, f"{where}: aborted {rid} not returned by the loop"
                self.failed[rid] = reasons[rid]
                self.fail_times[rid] = self.clock.now
            else:
                held = self.engine.scheduler.kv.holds_blocks(rid)
                assert req.status is S.PREEMPTED and not held, (
                    f"{where}: {rid} is {req.status.value} (holding blocks: {held}), want requeued"
                )

    def check_end(self) -> None:
        by_id = {rec.req_id: rec for rec in self.engine.records}
        assert len(self.engine.records) == len(self.reqs), "a request has no (or two) records"
        for spec in self.workload:
            rid, req = spec.req_id, self.reqs[spec.req_id]
            rec = by_id[rid]
            if rid in self.failed:
                assert (rec.status, rec.reason, rec.finish_reason, rec.finish) == (
                    "aborted",
                    self.failed[rid],
                    "abort",
                    self.fail_times[rid],
                ), f"{rid}: record of a request a failed step aborted: {rec}"
                continue
            if spec.abort_step is not None or not admissible(self.case, spec):
                continue
            want, reason = expected_end(self.case, spec)
            n = len(spec.prompt)
            assert req.status is S.FINISHED and req.output_token_ids == [
                sim_token(rid, n + i) for i in range(want)
            ], f"{rid} ended {req.status.value} with {req.output_token_ids}, want {want} tokens"
        pool = self.engine.scheduler.kv.pool
        assert pool.num_free_blocks == pool.num_blocks, "idle, yet blocks are held"


@st.composite
def _faults(draw: st.DrawFn) -> dict[int, Fault]:
    ids = draw(st.lists(st.integers(1, 8), min_size=1, max_size=3, unique=True))
    return {
        i: Fault(draw(st.booleans()), draw(st.booleans()), draw(st.integers(0, 7))) for i in ids
    }


def _small_workload(async_scheduling: bool) -> tuple[EngineCase, Workload]:
    cfg = EngineConfig(
        block_size=4,
        num_gpu_blocks=40,
        max_num_seqs=8,
        max_num_batched_tokens=16,
        async_scheduling=async_scheduling,
    )
    # r0..r2 start in step 1; r3 arrives before the third loop run, so (async) it starts
    # in step 4, scheduled while step 3 runs.
    specs = tuple(
        ReqSpec(f"r{i}", 0 if i < 3 else 2, tuple(range(10 * i + 1, 10 * i + 6)), 6)
        for i in range(4)
    )
    return EngineCase(cfg, 0.7), specs


@scaled(0.5)
@given(any_case_and_workload(), _faults(), st.sets(st.integers(1, 12), max_size=4))
# Explicit cases, run under every profile (mutmut's runs only a few examples): async,
# step 3 failing when collected with step 4 (r3's first) scheduled, or at its launch
# after step 2's results; sync, failing at the first launch and when a result is collected.
@example(_small_workload(True), {3: Fault(at_launch=False, named=False, victim=0)}, set())
@example(_small_workload(True), {3: Fault(at_launch=True, named=True, victim=1)}, set())
@example(_small_workload(False), {1: Fault(True, True, 2), 3: Fault(False, False, 0)}, set())
# async, step 4 launched only once step 3 is applied, which fails when collected
@example(_small_workload(True), {3: Fault(at_launch=False, named=True, victim=0)}, {4})
# async, step 4 (r3's first) failing at its launch, naming r3, and step 3 when collected:
# r3 ends aborted with step 4's reason
@example(_small_workload(True), {3: Fault(False, False, 0), 4: Fault(True, True, 3)}, set())
def test_the_engine_loop_announces_times_and_isolates_failed_steps(
    cw: tuple[EngineCase, Workload], faults: dict[int, Fault], apart: set[int]
) -> None:
    """Driven as the simulator drives it, step_events announces each non-empty step
    SCHEDULED before it is launched, LAUNCHED once launched and AWAIT before its result,
    never an empty step; a step's record has the clock when its result came and the
    device time from its launch to then. A step the executor fails, at launch or when its
    result is collected (sync, or async with the next step already scheduled): the
    requests the RequestFailed names, or all of the step's requests for another error,
    end aborted with that reason (and a record saying so, stamped then); the failed
    step's other requests, and those of the step scheduled after it, are requeued; every
    other request ends with exactly the tokens it would have had without the failure.

    Caught: `_fail` given None for the steps or the error, or no error (at launch, at
    result, at the next step's launch); only the failed step undone under async
    (`[out]` for `[out, next_out]`); SCHEDULED yielded for an empty next step instead of
    a non-empty one; the step's duration not passed to `process` (or `clock() + start`).
    `apart`: steps the executor cannot run beside the one in flight (`can_overlap`), which
    the loop launches once that one is applied."""
    case, workload = cw
    loop = Loop(case, workload, faults, apart).run()
    loop.check_end()
