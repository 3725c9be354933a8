"""Checkers of what the scheduler reports, each recounted from the steps' outputs alone:
step numbers (the simulator's `num_steps`, step records), requests by how they ended,
draft acceptance in all and by position (`deepinfer generate`, `measure-acceptance`),
and each request's next draft proposal (what the next step verifies).
"""

from __future__ import annotations

from collections import Counter

from deepinfer.outputs import ModelRunnerOutput, SchedulerOutput
from deepinfer.request import Request, RequestStatus
from deepinfer.spec_policy import smooth_chances
from tests.property.harness import Checker, Driver, note
from tests.property.strategies import ReqSpec

S = RequestStatus


class StepNumbers(Checker):
    """Steps are numbered 1, 2, 3, ... by schedule() call: each output's step_id and
    Scheduler.step_id equal the number of schedule() calls so far."""

    def __init__(self) -> None:
        self.calls = 0

    def on_schedule(self, d: Driver, out: SchedulerOutput, in_flight: bool) -> None:
        self.calls += 1
        assert out.step_id == self.calls and d.sched.step_id == self.calls, (
            f"rule 'steps are numbered from 1': schedule() call #{self.calls} output "
            f"step_id={out.step_id}, Scheduler.step_id={d.sched.step_id}"
        )


class EndCounts(Checker):
    """Scheduler.num_submitted, num_finished, num_aborted and num_rejected equal the
    requests submitted and those now FINISHED, ABORTED and REJECTED."""

    def _check(self, d: Driver, where: str) -> None:
        by = Counter(r.status for r in d.reqs.values())
        s = d.sched
        got = (s.num_submitted, s.num_finished, s.num_aborted, s.num_rejected)
        want = (len(d.reqs), by[S.FINISHED], by[S.ABORTED], by[S.REJECTED])
        assert got == want, (
            f"rule 'requests are counted by how they ended': {where}: the scheduler counts "
            f"(submitted, finished, aborted, rejected) = {got}, the requests' statuses {want}"
        )

    def on_add(self, d: Driver, spec: ReqSpec, req: Request, reason: str | None) -> None:
        self._check(d, f"add {spec.req_id}")

    def on_abort(self, d: Driver, req_id: str) -> None:
        self._check(d, f"abort {req_id}")

    def on_process(self, d: Driver, out: SchedulerOutput, res: ModelRunnerOutput) -> None:
        self._check(d, f"step {out.step_id} processed")


class DraftAcceptance(Checker):
    """Scheduler.num_draft_tokens, num_accepted_drafts and draft_position_stats equal a
    recount of the steps applied: a live request's sampling step verifies the drafts it
    was scheduled with and accepts all but one of the tokens returned; draft position j
    (from 0) is reached when the j drafts before it were accepted, and then accepted
    when the tokens returned number more than j + 1."""

    def __init__(self) -> None:
        self.drafts = self.accepted = 0
        self.by_position: list[list[int]] = []  # [reached, accepted] per position

    def on_process(self, d: Driver, out: SchedulerOutput, res: ModelRunnerOutput) -> None:
        for sr in out.scheduled:
            if not sr.will_sample or sr.req_id not in d.live_before_process:
                continue
            n, a = len(sr.draft_token_ids), len(res.sampled_token_ids[sr.req_id]) - 1
            self.drafts, self.accepted = self.drafts + n, self.accepted + a
            for j in range(n):
                if len(self.by_position) == j:
                    self.by_position.append([0, 0])
                if j <= a:  # every draft before position j was accepted
                    self.by_position[j][0] += 1
                    self.by_position[j][1] += int(j < a)
            if 0 < a < n:
                note("some drafts of a step accepted, some rejected")
        s = d.sched
        got = (s.num_draft_tokens, s.num_accepted_drafts, s.draft_position_stats)
        want = (self.drafts, self.accepted, self.by_position)
        assert got == want, (
            f"rule 'draft acceptance is counted as verified': step {out.step_id}: the "
            f"scheduler reports (drafts, accepted, [reached, accepted] by position) = "
            f"{got}, the steps applied give {want}"
        )


class NextDrafts(Checker):
    """After a sampling step a request that goes on running proposes exactly the
    executor's next drafts, at most num_speculative_tokens of them, with their
    confidences (none without speculation), and its running mean chances move toward
    theirs (spec_policy.smooth_chances, replayed here from every such step), as do the
    engine's over all requests, request by request in the step's order."""

    def __init__(self) -> None:
        self.chances: dict[str, list[float]] = {}  # req_id -> the replayed mean chances
        self.prior: list[float] = []  # the engine's, replayed

    def on_process(self, d: Driver, out: SchedulerOutput, res: ModelRunnerOutput) -> None:
        k = d.case.config.num_speculative_tokens
        for sr in out.scheduled:
            req = d.reqs[sr.req_id]
            if not sr.will_sample or sr.req_id not in d.live_before_process:
                continue
            # A stop string ended it after the update, which went on with it.
            went_on = sr.req_id in d.text_finished
            if req.status is not S.RUNNING and not went_on:
                continue  # ended, or preempted while its step flew
            want = list(res.draft_token_ids.get(sr.req_id, ()))[:k]
            conf = list(res.draft_confidences.get(sr.req_id, ()))[:k]
            assert went_on or (req.spec_token_ids, req.spec_confidences) == (want, conf), (
                f"rule 'a request proposes the executor's drafts': step {out.step_id}, "
                f"{sr.req_id} proposes {req.spec_token_ids} (confidences "
                f"{req.spec_confidences}), the executor's are {want} ({conf}), k={k}"
            )
            if k:
                chances = smooth_chances(self.chances.get(sr.req_id, []), conf)
                self.chances[sr.req_id] = chances
                assert went_on or req.spec_chance_means == chances, (
                    f"rule 'mean chances follow each proposal': step {out.step_id}, "
                    f"{sr.req_id} holds {req.spec_chance_means}, its proposals give {chances}"
                )
                if conf:
                    self.prior = smooth_chances(self.prior, conf)
        assert d.sched.prior_chances == self.prior, (
            f"rule 'the engine's mean chances follow every proposal': step {out.step_id}, "
            f"it holds {d.sched.prior_chances}, the proposals give {self.prior}"
        )
