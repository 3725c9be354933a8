"""Checkers of liveness, livelock freedom and conservation of requests and tokens."""

from __future__ import annotations

from collections import Counter

from deepinfer.outputs import ModelRunnerOutput, SchedulerOutput
from deepinfer.request import FinishReason, Request, RequestStatus
from deepinfer.scheduler_checks import diagnose_stall
from tests.property.harness import (
    Checker,
    Driver,
    admissible,
    expected_end,
    note,
    preemption_bound,
    progress_window,
)
from tests.property.strategies import ReqSpec, sim_token

S = RequestStatus
LEGAL: dict[S | None, set[S]] = {  # status -> statuses it may have at the next observation
    None: {S.WAITING, S.REJECTED},
    S.WAITING: {S.WAITING, S.PREFILLING, S.RUNNING, S.FINISHED, S.ABORTED},
    S.PREFILLING: {S.PREFILLING, S.RUNNING, S.FINISHED, S.ABORTED},
    S.RUNNING: {S.RUNNING, S.PREEMPTED, S.FINISHED, S.ABORTED},
    S.PREEMPTED: {S.PREEMPTED, S.PREFILLING, S.RUNNING, S.FINISHED, S.ABORTED},
    S.FINISHED: {S.FINISHED},
    S.ABORTED: {S.ABORTED},
    S.REJECTED: {S.REJECTED},
}


class Rejection(Checker):
    """A request that can never be served is rejected at add_request, naming both sizes."""

    def on_add(self, d: Driver, spec: ReqSpec, req: Request, reason: str | None) -> None:
        if admissible(d.case, spec):
            assert reason is None, f"{spec} fits but was rejected: {reason}"
            return
        assert reason is not None, f"{spec} can never be served but was queued"
        assert req.status is S.REJECTED and spec.req_id not in d.sched.requests
        assert req.finish_reason is FinishReason.REJECTED, f"{spec}: {req.finish_reason}"
        assert all(r is not req for r in d.sched.waiting), f"rejected {spec} is waiting"
        rec = d.engine.records[-1]
        assert (rec.req_id, rec.status, rec.finish_reason, rec.reason) == (
            spec.req_id,
            "rejected",
            "rejected",
            reason,
        ), f"{spec}: its record {rec}"
        n = len(spec.prompt)
        if n + 1 > d.case.capacity:  # the reason names both sizes
            assert f"{n} tokens" in reason and f"{d.case.config.num_gpu_blocks} blocks" in reason


class NoIdleStep(Checker):
    """While requests are unfinished and nothing is in flight, a step schedules a token."""

    def on_schedule(self, d: Driver, out: SchedulerOutput, in_flight: bool) -> None:
        if in_flight or not out.is_empty or not d.sched.has_unfinished():
            return
        raise AssertionError(
            f"step {out.step_id}: unfinished requests, nothing in flight, "
            f"nothing scheduled\n{diagnose_stall(d.sched)}"
        )


class Completion(Checker):
    """Every admissible request ends finished with all its tokens and the finish reason
    of its first stop condition (harness.expected_end), unless aborted."""

    def on_end(self, d: Driver) -> None:
        for spec in d.workload:
            req = d.reqs[spec.req_id]
            if not admissible(d.case, spec):
                continue
            assert req.status in (S.FINISHED, S.ABORTED), f"{spec} ended as {req!r}"
            if req.status is S.ABORTED:
                assert spec.abort_step is not None, f"{spec} aborted though nobody asked"
                continue
            want, reason = expected_end(d.case, spec, text=d.text)
            assert req.num_output_tokens == want, f"{spec}: {req.num_output_tokens} != {want}"
            got = req.finish_reason.value if req.finish_reason is not None else None
            assert got == reason, f"{spec}: finish reason {got}, its first stop is {reason}"


class NeverPreemptedAlone(Checker):
    """A request that is the only one holding blocks is never preempted: if a step
    preempts, some request that held blocks before the step still holds them."""

    def on_schedule(self, d: Driver, out: SchedulerOutput, in_flight: bool) -> None:
        gone = out.preempted_req_ids
        if gone:
            assert d.snap is not None
            survivors = set(d.snap.tables) - gone
            assert survivors, (
                f"step {out.step_id}: preempted {sorted(gone)}, the last of "
                f"which held blocks alone (it fits in the cache by itself)"
            )
            note("preemption")


class BoundedPreemptions(Checker):
    """Preemptions, as the outputs announce them, stay within preemption_bound; the
    counts the engine reports (Scheduler.num_preemptions, each request's
    num_preemptions: the simulator's preemption metrics) equal them."""

    def __init__(self) -> None:
        self.preemptions = 0
        self.per_request: Counter[str] = Counter()

    def on_schedule(self, d: Driver, out: SchedulerOutput, in_flight: bool) -> None:
        self.preemptions += len(out.preempted_req_ids)
        self.per_request.update(out.preempted_req_ids)
        bound = preemption_bound(d.case, d.workload)
        assert self.preemptions <= bound, f"{self.preemptions} preemptions > bound {bound}"
        where = f"step {out.step_id}"
        assert d.sched.num_preemptions == self.preemptions, (
            f"{where}: Scheduler.num_preemptions={d.sched.num_preemptions}, the outputs "
            f"announced {self.preemptions} preemptions"
        )
        for rid, req in d.reqs.items():
            assert req.num_preemptions == self.per_request[rid], (
                f"{where}: {rid}.num_preemptions={req.num_preemptions}, the outputs "
                f"announced {self.per_request[rid]}"
            )


class ComputedProgress(Checker):
    """max_computed_tokens (the highest num_computed_tokens a request reached) never
    falls and never lags num_computed_tokens; and the progress measure
    phi = sum over requests of (max_computed_tokens + output tokens + 1 if ended)
    rises at least once every progress_window steps. Only a preempted request's
    recompute (up to max_model_len tokens, a full budget a step) passes without
    raising it: every other step samples a token or computes prompt tokens never
    computed before."""

    def __init__(self) -> None:
        self.max_seen: dict[str, int] = {}
        self.phi = -1
        self.last_rise = 0

    def on_schedule(self, d: Driver, out: SchedulerOutput, in_flight: bool) -> None:
        self._monotone(d, f"step {out.step_id} scheduled")

    def on_process(self, d: Driver, out: SchedulerOutput, res: ModelRunnerOutput) -> None:
        self._monotone(d, f"step {out.step_id} processed")

    def _monotone(self, d: Driver, where: str) -> None:
        for rid, req in d.reqs.items():
            m = req.max_computed_tokens
            assert m >= self.max_seen.get(rid, 0), f"{where}: {rid} max_computed_tokens fell"
            assert m >= req.num_computed_tokens, f"{where}: {req!r} max_computed_tokens={m}"
            self.max_seen[rid] = m

    def on_step_end(self, d: Driver) -> None:
        phi = sum(
            r.max_computed_tokens + r.num_output_tokens + r.is_finished for r in d.reqs.values()
        )
        if phi > self.phi:
            self.phi, self.last_rise = phi, d.steps
        window = progress_window(d.case)
        assert d.steps - self.last_rise <= window, (
            f"no progress in {window} steps (steps {self.last_rise}..{d.steps})\n"
            f"{diagnose_stall(d.sched)}"
        )


class RequestConservation(Checker):
    """submitted == finished + aborted + rejected + waiting + running, queues match
    statuses, every status change is legal, and each ended request has one record."""

    def __init__(self) -> None:
        self.status: dict[str, S] = {}

    def _check(self, d: Driver, where: str) -> None:
        s, by = d.sched, Counter(r.status for r in d.reqs.values())
        assert len(d.reqs) == (
            by[S.FINISHED] + by[S.ABORTED] + by[S.REJECTED] + len(s.waiting) + len(s.running)
        ), f"{where}: requests not conserved: {by}"
        assert {r.request_id for r in s.waiting} == {
            rid for rid, r in d.reqs.items() if r.status in (S.WAITING, S.PREEMPTED, S.PREFILLING)
        }
        assert {r.request_id for r in s.running} == {
            rid for rid, r in d.reqs.items() if r.status is S.RUNNING
        }
        records = Counter(rec.req_id for rec in d.engine.records)
        for rid, req in d.reqs.items():
            old = self.status.get(rid)
            assert req.status in LEGAL[old], f"{where}: {rid} went {old} -> {req.status}"
            self.status[rid] = req.status
            assert records[rid] == req.is_finished, f"{where}: {rid} has {records[rid]} records"

    def on_add(self, d: Driver, spec: ReqSpec, req: Request, reason: str | None) -> None:
        self._check(d, f"add {spec.req_id}")

    def on_abort(self, d: Driver, req_id: str) -> None:
        self._check(d, f"abort {req_id}")

    def on_schedule(self, d: Driver, out: SchedulerOutput, in_flight: bool) -> None:
        self._check(d, f"step {out.step_id} scheduled")

    def on_process(self, d: Driver, out: SchedulerOutput, res: ModelRunnerOutput) -> None:
        self._check(d, f"step {out.step_id} processed")

    def on_end(self, d: Driver) -> None:
        assert len(d.engine.records) == len(d.reqs), "a request has no (or two) records"


class TokenConservation(Checker):
    """A request's outputs are exactly the tokens the executor gave it, in order, each
    the SimExecutor token of its position: none lost or repeated across preemption."""

    def __init__(self) -> None:
        self.returned: dict[str, list[list[int]]] = {}  # req_id -> tokens of each sampling step

    def on_process(self, d: Driver, out: SchedulerOutput, res: ModelRunnerOutput) -> None:
        for sr in out.scheduled:
            if sr.will_sample and sr.req_id in d.live_before_process:
                self.returned.setdefault(sr.req_id, []).append(res.sampled_token_ids[sr.req_id])
        for rid, chunks in self.returned.items():
            self._outputs(d, rid, chunks, f"step {out.step_id}")

    def _outputs(self, d: Driver, rid: str, chunks: list[list[int]], where: str) -> None:
        req = d.reqs[rid]
        got = req.output_token_ids
        sent = [t for c in chunks for t in c]
        assert got == sent[: len(got)], f"{where}: {rid} outputs {got} != executor's {sent}"
        cut = len(sent) - len(got)  # tokens past a stop are dropped, in the last step only
        assert cut == 0 or (req.status is S.FINISHED and cut < len(chunks[-1])), (
            f"{where}: {rid} ({req.status.value}) lost {cut} of the tokens it was given"
        )
        limit = req.sampling_params.max_tokens
        assert limit is None or len(got) <= limit, (
            f"{where}: {rid} has {len(got)} output tokens, max_tokens={limit}"
        )
        n = len(d.specs[rid].prompt)
        for i, t in enumerate(got):
            assert t == sim_token(rid, n + i), (
                f"{where}: {rid} output {i} is {t}, not the token of position {n + i}"
            )

    def on_end(self, d: Driver) -> None:
        for req in d.reqs.values():
            if req.status is S.FINISHED and req.num_preemptions:
                note("a preempted request finished with all its tokens")
