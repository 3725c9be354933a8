"""Drive one engine case through a workload, calling property checkers after each event.

The driver runs the real `EngineCore` over `SimExecutor`, calling `schedule()` /
`process()` directly so that checkers can look between the halves of a step, and
runs the core's own `check_output` / `check_invariants` after its checkers (so a
failure names the property's rule first), unless PROPERTY_CORE_CHECKS=0; with async scheduling it overlaps them
exactly as `EngineCore.step_events` does. Arrivals and aborts happen at driver
step numbers; steps with no work are skipped (they are not engine steps).
"""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass
from typing import NamedTuple

from hypothesis import event
from hypothesis.control import currently_in_test_context

from deepinfer.config import EngineRole
from deepinfer.engine import EngineCore
from deepinfer.outputs import ModelRunnerOutput, SchedulerOutput
from deepinfer.request import Request, RequestStatus
from deepinfer.scheduler_checks import check_invariants, check_output, diagnose_stall
from sim.sim_executor import SimExecutor
from tests.property.coverage import TRANSITIONS
from tests.property.oracle import (  # noqa: F401  (re-exported: the checkers import them here)
    admissible,
    expected_end,
    expected_outputs,
    make_request,
    max_model_len,
    preemption_bound,
    progress_window,
    step_bound,
)
from tests.property.sim_text import TextStops
from tests.property.strategies import EngineCase, ReqSpec, Workload


def note(label: str) -> None:
    """Count `label` in hypothesis statistics (a no-op outside a hypothesis test)."""
    if currently_in_test_context():
        event(label)


# The core's own per-step checks (scheduler_checks.check_output / check_invariants) run by
# default; PROPERTY_CORE_CHECKS=0 turns them off to see what this suite's checkers
# catch on their own (as when judging a mutation of the core).
CORE_CHECKS = os.environ.get("PROPERTY_CORE_CHECKS", "1") != "0"


class Checker:
    """Hooks a property checker may override; each raises AssertionError on a violation."""

    def on_add(self, d: Driver, spec: ReqSpec, req: Request, reason: str | None) -> None: ...
    def on_abort(self, d: Driver, req_id: str) -> None: ...
    def on_schedule(self, d: Driver, out: SchedulerOutput, in_flight: bool) -> None: ...
    def on_process(self, d: Driver, out: SchedulerOutput, res: ModelRunnerOutput) -> None: ...
    def on_step_end(self, d: Driver) -> None: ...
    def on_end(self, d: Driver) -> None: ...


class DriverClock:
    """The engine's clock: the driver advances it by one before each add, abort and half
    step, so every timestamp the engine records names the call that took it."""

    def __init__(self) -> None:
        self.now = 0.0

    def tick(self) -> float:
        self.now += 1.0
        return self.now

    def __call__(self) -> float:
        return self.now


class ReqState(NamedTuple):
    """What the scheduling rules read of one live request."""

    num_tokens: int
    computed: int  # num_computed_tokens
    placeholders: int  # num_output_placeholders (async: sampled tokens not known yet)
    drafts: list[int]  # spec_token_ids proposed for its next step
    pending_drafts: int  # drafts of steps in flight (assumed accepted until verified)
    confidences: list[float]  # spec_confidences (varlen: they set the next draft length)
    chance_means: list[float]  # spec_chance_means (varlen, async: for the unseen drafts)


@dataclass
class Snapshot:
    """Scheduler state just before a `schedule()` call: what a checker compares with its
    own account (the mirrors), and what traces and coverage record; never the source of
    an expectation."""

    tables: dict[str, list[int]]  # req_id -> block ids it holds
    running: list[str]
    waiting: list[str]
    in_progress: list[str]  # waiting requests that hold blocks (chunked prefill between chunks)
    status: dict[str, RequestStatus]
    state: dict[str, ReqState]


class Driver:
    """Runs a workload; besides its checkers it fails a run that exceeds step_bound or
    preemption_bound, or stalls (an empty step that preempts nothing, with nothing in
    flight) with no arrival or abort left; a stall before such an event is skipped over,
    its steps counted."""

    def __init__(
        self,
        case: EngineCase,
        workload: Workload,
        checkers: list[Checker],
        text: bool = True,
        needs_token_ids: bool = False,
    ) -> None:
        cfg = case.config
        self.case, self.workload, self.checkers = case, workload, checkers
        # Whether stop strings end requests (the output processor over simulated text,
        # after each update and before the checkers see it), as in `LLM`.
        self.text = text
        self.text_stops = TextStops()
        self.executor = SimExecutor(cfg, cfg.num_gpu_blocks, acceptance_rate=case.acceptance_rate)
        # needs_token_ids: the executor declares, as a real model's does, that it reads the
        # token ids (the engine passes that on to the scheduler it builds).
        self.executor.needs_token_ids = needs_token_ids
        self.time = DriverClock()
        self.engine = EngineCore(cfg, self.executor, clock=self.time, check_invariants=False)
        self.sched = self.engine.scheduler
        self.specs = {s.req_id: s for s in workload}
        self.reqs: dict[str, Request] = {}  # every submitted request
        self.reasons: dict[str, str] = {}  # rejected ones
        self.snap: Snapshot | None = None
        self.live_before_process: set[str] = set()
        # (running, waiting, KV usage) as the latest update left them
        self.left_by_update: tuple[int, int, float] = (0, 0, 0.0)
        self.text_ended: set[str] = set()  # requests a stop string ended in that update
        self.text_finished: set[str] = set()  # of them, those the update itself left live
        self.in_flight: tuple[SchedulerOutput, ModelRunnerOutput] | None = None
        self.chunked = False  # whether some prompt was split across steps
        self.steps = 0  # engine steps taken
        self.clock = 0  # driver steps (arrivals and aborts are stamped with these)
        self.max_steps = step_bound(case, workload)
        self.max_preemptions = preemption_bound(case, workload)
        self.stalled = False  # the last step scheduled nothing and preempted nothing
        self.broken = False  # a step raised (a checker failed mid-step)

    def tokens(self, req_id: str) -> list[int]:
        req = self.reqs[req_id]
        return list(self.specs[req_id].prompt) + req.output_token_ids

    def imports_kv(self, req_id: str) -> bool:
        """Whether the request's (next or current) start counts all but its last token
        computed: a DECODE engine's request, the first time (its prompt's KV arrives
        with it); one the engine preempted lost that KV and is recomputed like any."""
        return self.case.config.role is EngineRole.DECODE and not self.reqs[req_id].num_preemptions

    def run(self) -> Driver:
        arrivals = sorted(self.workload, key=lambda s: s.arrival_step)
        aborts = sorted(
            (s for s in self.workload if s.abort_step is not None), key=lambda s: s.abort_step
        )  # type: ignore[arg-type,return-value]
        while True:
            while arrivals and arrivals[0].arrival_step <= self.clock:
                self.add(arrivals.pop(0))
            while aborts and aborts[0].abort_step <= self.clock:  # type: ignore[operator]
                self.abort(aborts.pop(0).req_id)
            if not self.sched.has_unfinished() and self.in_flight is None:
                if not arrivals:
                    break
                self.clock = arrivals[0].arrival_step  # idle until the next arrival
                continue
            if self.steps >= self.max_steps:
                raise AssertionError(
                    f"liveness: unfinished after {self.steps} steps (bound "
                    f"{self.max_steps})\n{diagnose_stall(self.sched)}"
                )
            self.advance()
            if self.stalled:  # nothing changes until an arrival or an abort: skip ahead
                events = [s.arrival_step for s in arrivals] + [s.abort_step for s in aborts]
                if not events:
                    raise AssertionError(
                        f"liveness: stalled at step {self.steps}, no event "
                        f"left to unblock it\n{diagnose_stall(self.sched)}"
                    )
                skip = max(0, min(events) - self.clock)  # type: ignore[type-var]
                self.steps, self.clock = self.steps + skip, self.clock + skip
            for c in self.checkers:
                c.on_step_end(self)
        for c in self.checkers:
            c.on_end(self)
        self._note_coverage()
        return self

    def _note_coverage(self) -> None:
        kv, cfg = self.sched.kv, self.case.config
        note(
            f"role={cfg.role.value} async={cfg.async_scheduling} "
            f"spec={bool(cfg.num_speculative_tokens)}"
        )
        for label, seen in [
            ("some request was preempted", self.sched.num_preemptions),
            ("a prefix-cache hit", kv.num_hit_tokens),
            ("a cached block was evicted", kv.pool.num_evictions),
            ("a request was rejected", self.reasons),
            (
                "a request was aborted",
                any(r.status is RequestStatus.ABORTED for r in self.reqs.values()),
            ),
            ("a prompt was chunked", self.chunked),
        ]:
            if seen:
                note(label)

    def advance(self) -> None:
        """One engine step (both halves, async overlap included), failing past the
        preemption bound; the caller then calls the checkers' on_step_end."""
        try:
            self._step()
        except BaseException:
            self.broken = True  # the step is half-applied: stepping on only adds noise
            raise
        self.steps += 1
        self.clock += 1
        if self.sched.num_preemptions > self.max_preemptions:
            raise AssertionError(
                f"livelock: {self.sched.num_preemptions} preemptions > "
                f"bound {self.max_preemptions}\n{diagnose_stall(self.sched)}"
            )

    def add(self, spec: ReqSpec) -> None:
        """Submit a request now (a spec not in the workload joins it: the state machine)."""
        if spec.req_id not in self.specs:
            self.workload += (spec,)
            self.specs[spec.req_id] = spec
        req = make_request(spec)
        self.reqs[spec.req_id] = req
        if self.text:
            self.text_stops.track(req)
        self.time.tick()
        reason = self.engine.add_request(req)
        if reason is not None:
            self.reasons[spec.req_id] = reason
        for c in self.checkers:
            c.on_add(self, spec, req, reason)

    def abort(self, req_id: str) -> None:
        self.time.tick()
        if self.engine.abort(req_id) is not None:
            for c in self.checkers:
                c.on_abort(self, req_id)

    def _schedule(self, in_flight: bool) -> SchedulerOutput:
        s = self.sched
        self.snap = Snapshot(
            tables={rid: s.kv.block_ids(rid) for rid in s.kv.req_blocks},
            running=[r.request_id for r in s.running],
            waiting=[r.request_id for r in s.waiting],
            in_progress=[r.request_id for r in s.waiting if s.kv.holds_blocks(r.request_id)],
            status={rid: r.status for rid, r in s.requests.items()},
            state={
                rid: ReqState(
                    r.num_tokens,
                    r.num_computed_tokens,
                    r.num_output_placeholders,
                    list(r.spec_token_ids),
                    r.num_pending_drafts,
                    list(r.spec_confidences),
                    list(r.spec_chance_means),
                )
                for rid, r in s.requests.items()
            },
        )
        self.time.tick()
        out = self.engine.schedule()
        self.chunked = self.chunked or any(
            sr.num_computed_tokens + sr.num_tokens < self.reqs[sr.req_id].num_tokens
            for sr in out.scheduled
        )
        TRANSITIONS.on_schedule(self, out)
        for c in self.checkers:
            c.on_schedule(self, out, in_flight)
        if CORE_CHECKS:
            check_output(self.sched, out)
            check_invariants(self.sched)
        return out

    def _process(self, out: SchedulerOutput, res: ModelRunnerOutput) -> None:
        self.live_before_process = set(self.sched.requests)
        TRANSITIONS.before_process(self, out)
        self.time.tick()
        changed = self.engine.apply_results(out, res)
        s = self.sched  # the step record describes this, before stop strings end requests
        self.left_by_update = (len(s.running), len(s.waiting), s.kv.usage)
        self.text_finished, restated = self.text_stops.after_update(self.engine, changed)
        self.text_ended = self.text_finished | restated
        TRANSITIONS.on_process(self, out, res)
        for c in self.checkers:
            c.on_process(self, out, res)
        if CORE_CHECKS:
            check_invariants(self.sched)

    def _step(self) -> None:
        self.stalled = False
        if not self.case.config.async_scheduling:
            out = self._schedule(False)
            if not out.is_empty:
                self._process(out, self.executor.execute(out))
            self.stalled = out.is_empty and not out.preempted_req_ids
            return
        if self.in_flight is None:  # as EngineCore.step_events: start a step first
            out = self._schedule(False)
            if out.is_empty:
                self.stalled = not out.preempted_req_ids
                return
            self.in_flight = (out, self.executor.execute(out))
        nxt = self._schedule(True)
        out, res = self.in_flight
        self.in_flight = None
        self._process(out, res)
        if not nxt.is_empty:
            self.in_flight = (nxt, self.executor.execute(nxt))


class Flavours(Checker):
    """Before its first step, the 2nd, 5th, 8th... request submitted asks for prompt
    logprobs and the 3rd, 6th, 9th... is structured (the simulator prices its mask; no
    grammar is compiled)."""

    def on_add(self, d: Driver, spec: ReqSpec, req: Request, reason: str | None) -> None:
        kind = len(d.reqs) % 3
        if kind == 2:
            req.sampling_params = dataclasses.replace(req.sampling_params, prompt_logprobs=1)
        elif kind == 0:
            req.structured = True


def submit_due(
    engine: EngineCore,
    arrivals: list[ReqSpec],
    aborts: list[ReqSpec],
    clock: int,
    reqs: dict[str, Request],
) -> set[str]:
    """For loops that drive `EngineCore.step()` themselves: submit the arrivals, then the
    client aborts, due by driver step `clock` (both lists sorted by that step, consumed
    from the front; new requests go into `reqs`). Returns the requests the aborts ended."""
    while arrivals and arrivals[0].arrival_step <= clock:
        s = arrivals.pop(0)
        reqs[s.req_id] = make_request(s)
        engine.add_request(reqs[s.req_id])
    aborted = set()
    while aborts and aborts[0].abort_step <= clock:  # type: ignore[operator]
        rid = aborts.pop(0).req_id
        if engine.abort(rid) is not None:
            aborted.add(rid)
    return aborted


def run_case(case: EngineCase, workload: Workload, *checkers: Checker) -> Driver:
    return Driver(case, workload, list(checkers)).run()
