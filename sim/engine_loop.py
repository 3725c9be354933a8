"""The simpy process that drives one EngineCore in simulated time (`serve_engine`).

`simulate()` runs one of these over the trace's arrivals; a cluster (sim/cluster/) runs
one per instance, each fed by the cluster's routers. What reaches the engine, and when,
is the `Arrivals` the loop is given; everything else (host and device time, async
overlap, the fast-forward) is the same for both.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Callable, Generator
from typing import Any, Protocol

import simpy

from deepinfer.decode_run import DecodeRun
from deepinfer.engine import EngineCore, StepEventKind
from deepinfer.request import Request
from sim.cost_model import CostModel, KVLoadPricing, RunCosts, mask_time


class Arrivals(Protocol):
    """What the engine loop asks of whatever feeds its engine."""

    def admit(self, now: float) -> None:
        """Hand the engine every request due at `now` (the loop calls it between steps)."""

    def more_may_come(self) -> bool:
        """Whether a request may still reach the engine (else an idle engine is done)."""

    def next_time(self) -> float:
        """When the next request is due, as far as is known now (inf: none known)."""

    def soonest(self) -> float:
        """The earliest a request may reach the engine, counting those not known yet (a
        decode run ends at the first step whose turn comes after it)."""

    def horizon(self) -> float:
        """The time a decode run must not pass: no step of the run may have its results
        applied after it (a decision that reads this engine's state may be due then)."""

    def wake(self) -> simpy.Event | None:
        """An event that fires when a request comes sooner than `next_time` said (None:
        none can)."""

    def scheduled(self) -> None:
        """Steps were scheduled (their requests' first schedules and the blocks reserved
        for KV on its way are stamped with their times): what waits on those may go."""

    def stepped(self, now: float) -> None:
        """A step (or a decode run) was applied at `now`."""

    def reads_steps(self) -> bool:
        """Whether something reads the engine after each step (`stepped`: a cluster
        instance's reports to its router): then a decode run ends where a request ends,
        to report it at its step's time."""


class Admits(Protocol):
    def add_request(self, req: Request) -> str | None: ...


class PendingArrivals:
    """A trace's requests, in arrival order, for one engine (`simulate()`), or for the
    ranks of a data-parallel group."""

    __slots__ = ("core", "pending")

    def __init__(self, core: Admits, pending: deque[Request]) -> None:
        self.core = core
        self.pending = pending

    def admit(self, now: float) -> None:
        pending = self.pending
        while pending and pending[0].arrival_time <= now:
            self.core.add_request(pending.popleft())

    def more_may_come(self) -> bool:
        return bool(self.pending)

    def next_time(self) -> float:
        return self.pending[0].arrival_time if self.pending else math.inf

    def soonest(self) -> float:
        return self.next_time()  # every arrival is known from the start

    def horizon(self) -> float:
        return math.inf  # nothing reads the engine's state between its steps

    def wake(self) -> simpy.Event | None:
        return None

    def scheduled(self) -> None:
        pass

    def stepped(self, now: float) -> None:
        pass

    def reads_steps(self) -> bool:
        return False


class Clock:
    """The engine's clock in a simulated run: `serve_engine` passes time on it at each time
    point of a step (a wait adds its delay, as a simpy timeout does) and advances the
    simpy environment to it once per step."""

    __slots__ = ("now",)

    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def serve_engine(
    env: simpy.Environment,
    clock: Clock,
    core: EngineCore,
    arrivals: Arrivals,
    cost: CostModel,
    mask_per_token_s: float,
    on_progress: Callable[[int], None] | None,
    on_host: bool = False,
    runs: FastForwardStats | None = None,
    kv_loads: KVLoadPricing | None = None,
) -> Generator[simpy.events.Event, Any, None]:
    """Admit arrivals and drive the engine's own loop (`EngineCore.step_events`) in
    simulated time: host time after each schedule, the cost model's device time from
    each launch; async scheduling overlaps the two exactly as the real loop does.
    Structured requests' token masks are host work from the launch on, beside the
    device's forward (the real runner fills them before it first synchronises): the
    step's results are back when both are done, and the host is busy meanwhile.

    The host's work is booked on the `Timeline`'s `host_free` (when the host is next
    idle); time passes to it after each schedule, so the engine's clock reads a launch's start as the real
    engine's does (its step records begin there), and an await waits for the result.
    Within a step nothing else happens (arrivals are admitted between steps), so time
    passes on `clock`, which the engine reads, and the environment follows it once a
    step: one simpy event per engine step.
    Under async scheduling a step is launched while the one before it runs: its device
    work starts when that one's ends (`device_free`), and no sooner than its host part
    (the second figure of the cost model's `launch_cost`, which a pipelined step hides
    behind the one before it) is done after its launch: a step launched on an idle
    device (the first after the engine idled, one that waited for the step before to be
    applied, or one whose host work outlasted the step before) pays what that step left
    unhidden. on_host (`HardwareSpec.runs_on_host`): the device is the host's CPU, whose
    launch runs the step before it returns, so the host's work and the step's follow
    each other, async or not.

    runs: fast-forward (counted there): where the engine offers a decode run
    (`EngineCore.decode_run`) and the cost model prices one, its steps are timed by
    `_time_run` and applied at once, until the next arrival or the run's horizon.

    kv_loads: a step that loads prefix blocks from the lower KV tiers waits for them on
    the device first (`KVLoadPricing`); None: the engine has no lower tier."""
    timeline = Timeline(clock, on_host)
    through_finishes = not arrivals.reads_steps()
    reported = 0
    while arrivals.more_may_come() or core.has_unfinished():
        now = clock.now
        arrivals.admit(now)
        if not core.has_unfinished():
            if arrivals.more_may_come():  # else the last arrivals were all rejected
                yield from _idle(env, clock, arrivals)
            continue
        run = None
        if runs is not None and runs.reason is None:
            run = core.decode_run(through_finishes)
        costs = cost.decode_run_costs(run) if run is not None else None
        launched: list[float] = []
        if run is not None and costs is not None:
            assert runs is not None
            launched, applied = _time_run(timeline, run, costs, arrivals)
            if launched:
                core.advance_decode(run, launched, applied)
                runs.add(len(applied))
        waits = False
        if not launched:
            waits = True  # until a step event says otherwise
            for kind, out in core.step_events():
                waits = False
                if kind is SCHEDULED:
                    timeline.scheduled(cost.cpu_time(out))
                elif kind is LAUNCHED:
                    masks = mask_time(out, mask_per_token_s) if mask_per_token_s else 0.0
                    loading = kv_loads.seconds(out) if kv_loads is not None else 0.0
                    if on_host:
                        priced = cost.step_time(out) + loading
                        timeline.launched(out.step_id, masks, priced, 0.0, 0.0)
                    else:
                        priced, idle = cost.launch_cost(out)
                        launch = cost.launch_seconds(out)
                        timeline.launched(out.step_id, masks, priced + loading, idle, launch)
                else:
                    timeline.awaited(out.step_id)
        arrivals.stepped(clock.now)
        if waits:  # nothing to run: every request left awaits its KV (Request.awaiting_kv)
            yield from _idle(env, clock, arrivals)
        elif clock.now > env.now:
            yield env.timeout(clock.now - env.now)
        if on_progress is not None and len(core.records) != reported:
            on_progress(len(core.records) - reported)
            reported = len(core.records)


def _idle(
    env: simpy.Environment, clock: Clock, arrivals: Arrivals
) -> Generator[simpy.events.Event, Any, None]:
    """Wait, with nothing to run, for the next request: until the time it is due, or
    until the arrivals' wake event says one came sooner (then the clock is the event's)."""
    now = clock.now
    due = arrivals.next_time()
    wake = arrivals.wake()
    if due < math.inf:
        clock.now += due - now
        timer = env.timeout(clock.now - env.now)
        if wake is None:
            yield timer
            return
        yield timer | wake
        if not timer.processed:
            clock.now = env.now
        return
    if wake is None:
        raise RuntimeError("an idle engine waits for requests that nothing will bring")
    yield wake
    clock.now = env.now


class Timeline:
    """When the host and the device are next free, and when each launched step's results
    are back: `serve_engine` passes time on the engine's clock at each time point of a step
    through these three calls, for single steps and decode runs alike."""

    __slots__ = ("clock", "on_host", "host_free", "device_free", "ready_at")

    def __init__(self, clock: Clock, on_host: bool) -> None:
        self.clock = clock
        self.on_host = on_host
        self.host_free = 0.0
        self.device_free = 0.0
        self.ready_at: dict[int, float] = {}  # step id -> simulated time its results are back

    def scheduled(self, cpu: float) -> None:
        """The host's work around a step just scheduled; the engine launches once it is
        done: the step's recorded duration starts there, as the real engine's does."""
        clock = self.clock
        now = clock.now
        host_free = self.host_free = (self.host_free if self.host_free > now else now) + cpu
        if host_free > now:
            clock.now += host_free - now

    def launched(
        self, step_id: int, masks: float, priced: float, idle: float, launch: float
    ) -> None:
        """A step launched, its device seconds `priced` (`idle` more on an idle device),
        the host busy `launch` seconds issuing it, then its grammar masks beside it. Its
        host part (what a pipelined step hides) runs from its launch: the device starts it
        once that is done and the step before has ended. With the launch priced apart,
        `priced` is the device's own work and `idle` the rest of the step's sequential
        time, so a step bound by its launch ends a sequential time after its launch began
        (its kernels come as the host issues them), and one bound by the device its work
        after the step before. On the host's CPU the launch runs the step (`priced`
        holds it all): the host is busy until it ends."""
        now = self.clock.now
        start = self.host_free if self.host_free > now else now
        if self.on_host:
            self.host_free = self.device_free = start + masks + priced
        else:
            self.host_free = start + launch + masks
            ready = start + idle
            self.device_free = (self.device_free if self.device_free > ready else ready) + priced
        self.ready_at[step_id] = max(self.device_free, self.host_free)

    def awaited(self, step_id: int) -> None:
        """The loop waits for a step's results (and for the host to be free)."""
        clock = self.clock
        now = clock.now
        done = self.ready_at.pop(step_id)
        host_free = self.host_free
        wait = (done if done > host_free else host_free) - now
        if wait > 0:
            clock.now += wait


class FastForwardStats:
    """How much of a run the fast-forward took: decode runs and the steps in them, or why
    it took none (`reason`: the configuration runs single steps only)."""

    __slots__ = ("runs", "steps", "reason")

    def __init__(self, reason: str | None = None) -> None:
        self.runs = 0
        self.steps = 0
        self.reason = reason

    def add(self, steps: int) -> None:
        self.runs += 1
        self.steps += steps

    def to_meta(self) -> dict[str, Any]:
        meta: dict[str, Any] = {"enabled": True, "runs": self.runs, "steps": self.steps}
        if self.reason is not None:
            meta["single_steps_only"] = self.reason
        return meta


def _time_run(
    timeline: Timeline, run: DecodeRun, costs: RunCosts, arrivals: Arrivals
) -> tuple[list[float], list[float]]:
    """Time a decode run's steps as `serve_engine` times single steps, until the run's
    horizon, the first step whose turn comes after the soonest arrival (the loop admits
    arrivals between steps, which ends the run), or the first step whose results would be
    applied after the arrivals' `horizon` (that step is not taken: the loop runs it on
    its own). Returns the clock at each step's launch and at the results applied in its
    turn (the step before it under async scheduling); empty where no step was taken.

    The body is `Timeline.scheduled`, `launched` (no grammar masks: a decode step has
    none) and `awaited`, inlined with the same float operations in the same order (a
    run's times must equal single steps' to the bit), on local copies of the timeline's
    state, written back at the end."""
    clock = timeline.clock
    launched: list[float] = []
    applied: list[float] = []
    launch_at, apply_at = launched.append, applied.append
    awaits_previous = run.in_flight_step is not None
    arrival = arrivals.soonest()
    horizon = arrivals.horizon()
    on_host = timeline.on_host
    now, hf, df = clock.now, timeline.host_free, timeline.device_free
    # Under async scheduling each step's turn awaits the step before it: its ready time.
    previous = timeline.ready_at.pop(run.first_step_id - 1) if awaits_previous else 0.0
    for cpu, priced, idle, issue in costs:
        if arrival <= now and launched:
            break
        # scheduled(cpu); the step's state goes to t, h, d until it is taken
        h = (hf if hf > now else now) + cpu
        t = now + (h - now) if h > now else now
        launch = t
        # launched(step_id, 0.0, priced, idle, issue)
        start = h if h > t else t
        if on_host:
            h = d = start + 0.0 + priced
        else:
            h = start + issue + 0.0
            ready = start + idle
            d = (df if df > ready else ready) + priced
        ready = h if h > d else d  # max(d, h)
        # awaited(the step before under async scheduling, else this one)
        done = previous if awaits_previous else ready
        wait = (done if done > h else h) - t
        if wait > 0:
            t += wait
        if t > horizon:
            break
        now, hf, df, previous = t, h, d, ready
        launch_at(launch)
        apply_at(now)
    clock.now, timeline.host_free, timeline.device_free = now, hf, df
    if awaits_previous:  # the last step taken: still in flight
        timeline.ready_at[run.first_step_id + len(applied) - 1] = previous
    return launched, applied


SCHEDULED, LAUNCHED = StepEventKind.SCHEDULED, StepEventKind.LAUNCHED
