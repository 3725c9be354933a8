"""Checkers of the records the engine writes: the figures every metric is computed from.

`deepinfer.metrics` (and so the simulator's reported TTFT, ITL, throughput, cache hit
rate, preemption counts, KV usage) reads only `EngineCore.records` and `.steps`; these
checkers rebuild each figure from what the driver saw (the clock it set for each call,
the outputs, the requests' outputs) and compare it field by field.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import asdict

from deepinfer.config import EngineRole
from deepinfer.outputs import ModelRunnerOutput, SchedulerOutput
from deepinfer.records import RequestRecord, StepRecord
from deepinfer.request import Request
from tests.property.harness import Checker, Driver
from tests.property.strategies import ReqSpec


class Records(Checker):
    """Each ended request has one record whose fields are its life as the driver saw it
    (arrival, first schedule, each step that gave it tokens, its end, its prefix-cache hit
    at first schedule, its preemptions, status, finish reason and reason); each processed
    step appends one step record describing that step and the state it left."""

    def __init__(self) -> None:
        self.first_scheduled: dict[str, float] = {}
        self.cached: dict[str, int] = {}  # prompt tokens already computed at first schedule
        self.token_times: dict[str, list[float]] = {}
        self.finish: dict[str, float] = {}
        self.preemptions: Counter[str] = Counter()
        self.num_outputs: dict[str, int] = {}
        self.last_process: float | None = None

    def on_add(self, d: Driver, spec: ReqSpec, req: Request, reason: str | None) -> None:
        self.token_times[spec.req_id] = []
        self.num_outputs[spec.req_id] = 0

    def on_abort(self, d: Driver, req_id: str) -> None:
        self.finish[req_id] = d.time.now

    def on_schedule(self, d: Driver, out: SchedulerOutput, in_flight: bool) -> None:
        now = d.time.now
        for sr in out.scheduled:
            if sr.req_id not in self.first_scheduled:
                self.first_scheduled[sr.req_id] = now
                self.cached[sr.req_id] = sr.num_computed_tokens
        self.preemptions.update(out.preempted_req_ids)

    def on_process(self, d: Driver, out: SchedulerOutput, res: ModelRunnerOutput) -> None:
        now = d.time.now
        for rid in d.live_before_process:
            req = d.reqs[rid]
            if req.num_output_tokens > self.num_outputs[rid]:  # it gained tokens this step
                self.token_times[rid].append(now)
                self.num_outputs[rid] = req.num_output_tokens
            if req.is_finished:
                self.finish[rid] = now
        self._check_step(d, out, now)
        self.last_process = now

    def _check_step(self, d: Driver, out: SchedulerOutput, now: float) -> None:
        running, waiting, usage = d.left_by_update  # before stop strings end requests
        want = StepRecord(
            step_id=out.step_id,
            time=now,
            # The driver passes no duration: the time since the previous step's results.
            duration=now - self.last_process if self.last_process is not None else 0.0,
            num_running=running,
            num_waiting=waiting,
            num_batched_tokens=sum(sr.num_tokens for sr in out.scheduled),
            num_prompt_tokens=sum(sr.num_tokens for sr in out.scheduled if sr.is_prompt),
            num_scheduled_reqs=len(out.scheduled),
            kv_usage=usage,
            num_preempted=len(out.preempted_req_ids),
            num_proposals=out.num_proposals,  # what the scheduler asked the drafter for
        )
        got = d.engine.steps[-1] if d.engine.steps else None
        assert got == want, f"step {out.step_id}: step record {got} != {want}"

    def expected(self, d: Driver, rid: str) -> RequestRecord:
        req, spec = d.reqs[rid], d.specs[rid]
        times = self.token_times[rid]
        cached = self.cached.get(rid, 0)
        if d.case.config.role is EngineRole.DECODE and rid in self.cached:
            # Its prompt's KV arrives with it: the prefix hit is not what it computes first.
            cached = max(req.num_cached_tokens, 0)
        return RequestRecord(
            req_id=rid,
            status=req.status.value,
            arrival=float(spec.arrival_step),
            num_prompt_tokens=len(spec.prompt),
            num_output_tokens=len(req.output_token_ids),
            first_scheduled=self.first_scheduled.get(rid),
            first_token=times[0] if times else None,
            finish=self.finish.get(rid),  # none for a request rejected at add_request
            token_times=times,
            num_cached_tokens=cached,
            num_preemptions=self.preemptions[rid],
            finish_reason=req.finish_reason.value if req.finish_reason is not None else None,
            reason=req.reject_reason,
        )

    def on_end(self, d: Driver) -> None:
        by_id = {rec.req_id: rec for rec in d.engine.records}
        for rid, req in d.reqs.items():
            assert req.is_finished, f"{rid} did not end ({req.status.value})"
            got, want = by_id.get(rid), self.expected(d, rid)
            assert got is not None, f"{rid} ended {req.status.value} with no record"
            diff = {k: (v, asdict(want)[k]) for k, v in asdict(got).items() if asdict(want)[k] != v}
            assert not diff, f"{rid}: record fields (recorded, expected) differ: {diff}"
