"""Everything at once: one hypothesis state machine drives the real EngineCore over
SimExecutor through arrivals, client aborts at any point (waiting, mid-chunk, running,
with an async step's placeholders outstanding), steps and drains, on a generated engine
(any role, async scheduling, speculation with random acceptance, prefix caching,
chunked prefill, small caches where preemption is common).

Every checker of the suite watches every half step: the KVMirror (block tables rebuilt
from the outputs, the prefix dict), block safety, budgets and the watermark, work
conservation, stop conditions, token and request conservation, the announcement of
ended requests, the figures the scheduler reports (checkers_reported), the step
records; after every rule the core's invariants hold and the mirror agrees with the
core. A drain (also at the end) runs the engine until idle within harness.step_bound
and checks that every admissible request not aborted ended as its stop conditions say,
and that each request's record holds its life as the driver saw it.

Broken copies that fail it: `Scheduler._end` not freeing the blocks of a request
aborted mid-chunk (`if req.status is not RequestStatus.PREFILLING: self.kv.free(req)`:
the mirror sees the aborted request's table left in the core); `EngineCore.finish`
writing no record for an aborted request (request conservation: 0 records).
"""

from __future__ import annotations

from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from deepinfer.request import RequestStatus
from deepinfer.scheduler_checks import check_invariants, diagnose_stall
from tests.property.checkers_kv import (
    BlockSafety,
    Budgets,
    EndedHoldNothing,
    PrefixCache,
    WatermarkNewPrompts,
)
from tests.property.checkers_progress import (
    ComputedProgress,
    NeverPreemptedAlone,
    NoIdleStep,
    RequestConservation,
    TokenConservation,
)
from tests.property.checkers_records import Records
from tests.property.checkers_reported import DraftAcceptance, EndCounts, NextDrafts, StepNumbers
from tests.property.checkers_stop import EndedAreAnnounced, StopConditions
from tests.property.checkers_work import WorkConservation
from tests.property.harness import (
    Checker,
    Driver,
    admissible,
    expected_end,
    note,
    preemption_bound,
    step_bound,
)
from tests.property.mirror import KVMirror
from tests.property.strategies import EngineCase, either, engine_cases, request_specs

S = RequestStatus


@st.composite
def _cases(draw: st.DrawFn) -> EngineCase:
    """Two in three small caches, where chunking, preemption and eviction are common."""
    small = engine_cases(max_capacity=64)
    return either(draw, small, engine_cases(), small)  # type: ignore[return-value]


class EngineMachine(RuleBasedStateMachine):
    d: Driver | None = None

    @initialize(case=_cases(), chunk_len=st.sampled_from([1, 2, 3, 4, 8]))
    def setup(self, case: EngineCase, chunk_len: int) -> None:
        d = Driver(case, (), [])
        self.mirror = mirror = KVMirror.for_driver(d)
        self.records = Records()
        checkers: list[Checker] = [
            mirror,
            BlockSafety(mirror),
            EndedHoldNothing(mirror),
            PrefixCache(mirror),
            WatermarkNewPrompts(mirror),
            WorkConservation(mirror),
            Budgets(),
            NoIdleStep(),
            NeverPreemptedAlone(),
            ComputedProgress(),
            RequestConservation(),
            TokenConservation(),
            StopConditions(),
            EndedAreAnnounced(),
            StepNumbers(),
            EndCounts(),
            DraftAcceptance(),
            NextDrafts(),
            self.records,
        ]
        d.checkers = checkers
        self.d, self.chunk_len = d, chunk_len
        self.aborted: set[str] = set()
        self.started = False  # some step ran (progress windows count from then)

    @rule(data=st.data(), burst=st.integers(1, 3))
    def arrive(self, data: st.DataObject, burst: int) -> None:
        """One to three requests arrive now (a burst makes them contend for blocks)."""
        d = self.d
        assert d is not None
        for _ in range(burst):
            i = len(d.workload)
            earlier = [s.prompt for s in d.workload]
            spec = data.draw(request_specs(d.case, i, d.clock, self.chunk_len, earlier))
            d.add(spec)
        d.max_preemptions = preemption_bound(d.case, d.workload)
        d.max_steps = step_bound(d.case, d.workload) + d.steps

    @precondition(lambda self: self.d is not None and self.d.sched.has_unfinished())
    @rule(data=st.data())
    def abort(self, data: st.DataObject) -> None:
        self._abort(data)

    def _abort(self, data: st.DataObject) -> None:
        """Abort a live request; each kind of moment (waiting, mid-chunk, running, each
        with or without its step in flight) is equally likely to be chosen."""
        d = self.d
        assert d is not None
        live = d.sched.requests
        flying = {sr.req_id for sr in d.in_flight[0].scheduled} if d.in_flight else set()
        groups: dict[str, list[str]] = {}
        for rid in sorted(live):
            kind = live[rid].status.value + (" with its step in flight" if rid in flying else "")
            groups.setdefault(kind, []).append(rid)
        kind = data.draw(st.sampled_from(sorted(groups)), label="abort kind")
        rid = data.draw(st.sampled_from(groups[kind]), label="abort")
        req = d.reqs[rid]
        note(f"aborted while {kind}".replace("prefilling", "mid-chunk"))
        d.abort(rid)
        assert req.status is S.ABORTED, f"abort of live {rid} left it {req.status}"
        self.aborted.add(rid)

    @rule(n=st.integers(1, 8), data=st.data())
    def step(self, n: int, data: st.DataObject | None = None) -> None:
        """Up to n engine steps; after each, maybe a client abort (the engine's loop
        takes aborts between steps, when an async step is in flight)."""
        d = self.d
        assert d is not None
        for _ in range(n):
            if not d.sched.has_unfinished() and d.in_flight is None:
                d.clock += 1  # idle: time passes, no engine step
                return
            d.advance()
            for c in d.checkers:
                c.on_step_end(d)
            if data is None or not d.sched.requests:
                continue
            # Mid-chunk is a short-lived moment: abort more often while one exists.
            mid_chunk = any(r.status is S.PREFILLING for r in d.sched.requests.values())
            if data.draw(st.integers(0, 1 if mid_chunk else 5)) == 0:
                self._abort(data)

    @rule()
    def drain(self) -> None:
        """Run until idle; every admissible request not aborted ended as predicted."""
        d = self.d
        assert d is not None
        while d.sched.has_unfinished() or d.in_flight is not None:
            assert d.steps < d.max_steps, (
                f"liveness: unfinished after {d.steps} steps (bound {d.max_steps})\n"
                f"{diagnose_stall(d.sched)}"
            )
            self.step(1)
        for spec in d.workload:
            req = d.reqs[spec.req_id]
            if not admissible(d.case, spec):
                assert req.status is S.REJECTED, f"{spec} can never be served: {req.status}"
                continue
            if spec.req_id in self.aborted:
                continue
            want, reason = expected_end(d.case, spec, text=d.text)
            got = req.finish_reason.value if req.finish_reason is not None else None
            assert (req.status, req.num_output_tokens, got) == (S.FINISHED, want, reason), (
                f"{spec} ended {req.status.value} with {req.num_output_tokens} tokens ({got}); "
                f"want finished with {want} ({reason})"
            )
        self.records.on_end(d)  # every request's record, aborts at any moment included
        pool = d.sched.kv.pool
        assert pool.num_free_blocks == pool.num_blocks, "idle, yet blocks are held"
        if d.workload:
            note("drained")

    @invariant()
    def core_agrees(self) -> None:
        d = self.d
        if d is None:
            return
        check_invariants(d.sched)
        self.mirror._check_tables(d, "between rules")

    def teardown(self) -> None:
        # Hypothesis tears down after a failure too: draining a half-applied step would
        # report follow-on failures of the first one as distinct examples.
        if self.d is not None and not self.d.broken:
            self.drain()
            self.d._note_coverage()


EngineMachine.TestCase.settings = settings(
    max_examples=max(5, settings.default.max_examples // 5),
    stateful_step_count=25,
    deadline=None,
)
test_arrivals_aborts_async_speculation_preemption_caching_chunking_and_roles_together = (
    EngineMachine.TestCase
)
