"""QueueMirror: the scheduler's queues and per-request counts as the outputs describe
them, kept by the test (the KVMirror's counterpart for everything but the blocks).

The checkers that replay the scheduling rules (work conservation, the executor handoff,
the watermark exemption, varlen's bookkeeping) need the state before each step: who is
running and in what order, what waits and in what order, each request's computed count,
output placeholders, drafts in flight and proposed drafts, and varlen's history (the
uniform steps in flight and the step times they price). Reading these off the scheduler
would copy its bugs into the expectation, so this mirror rebuilds them from what a
client of the scheduler sees, by the rules of docs/design.md:

- an admitted request (`add_request` gave no reason) joins the waiting queue: at the
  back under fcfs, by (priority, arrival, submission) under priority ("Order");
- a waiting request scheduled becomes running (appended: running keeps the order in
  which requests became running) when its step reaches its last known token, and
  otherwise a chunked prefill in progress at the very front ("Chunked prefill");
- a preempted request (`preempted_req_ids`) leaves running with nothing computed, no
  drafts and no placeholders, and re-enters waiting at the front behind the prefills
  in progress under fcfs, by its key under priority; victims of one step are taken
  newest first, so the oldest of them ends up first ("Preemption by recompute");
- a scheduled request's computed count moves to the step's end; a step that reaches
  its known tokens samples one placeholder token; its drafts count as accepted until
  the step's results come, which move the count back by the rejected ones and bring
  the next drafts and their confidences ("Speculative decoding", "Async scheduling");
- a request leaves the queues when it ends: its output says finished, or it is aborted.

Varlen (docs/design.md, "Speculative decoding"): each `schedule()` chooses the running
requests' draft lengths with `spec_policy.draft_lengths` (the pricing rule, a pure
function) fed from this mirror's own history: confidences and running mean chances from
the outputs, the uniform steps it saw scheduled and not yet timed, and a `StepTimes` it
fills itself with the durations the driver's clock gives each step.
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass, field, replace

from deepinfer.outputs import ModelRunnerOutput, SchedulerOutput
from deepinfer.request import Request
from deepinfer.spec_policy import confidences_from_chances, draft_lengths, smooth_chances
from deepinfer.step_times import StepTimes
from tests.property.harness import Checker, Driver, ReqSpec


@dataclass
class Counts:
    """One live request's counts, as the outputs describe them."""

    computed: int = 0  # tokens with KV (drafts in flight included until verified)
    placeholders: int = 0  # tokens sampled by steps in flight, not known yet
    pending_drafts: int = 0  # drafts of steps in flight, assumed accepted
    drafts: list[int] = field(default_factory=list)  # proposed for its next step
    confidences: list[float] = field(default_factory=list)
    chance_means: list[float] = field(default_factory=list)
    preempted: bool = False  # waiting after a preemption (status PREEMPTED)


@dataclass
class QueueView:
    """The queues just before a `schedule()` call."""

    running: list[str]  # in the order they became running
    waiting: list[str]  # prefills in progress first, then the policy's order
    in_progress: list[str]  # the chunked prefills in progress
    counts: dict[str, Counts]
    lengths: dict[str, int] | None  # varlen: each running request's draft length
    proposals_in_flight: int | None  # varlen: drafts the latest step asked for


class QueueMirror(Checker):
    """Feed it every hook (a checker that owns one calls it first); `before` is the
    view of the latest `schedule()` call, valid during that call's checkers."""

    def __init__(self) -> None:
        self.running: list[str] = []
        self.in_progress: list[str] = []
        self.queued: list[str] = []  # waiting, not in progress, in policy order
        self.counts: dict[str, Counts] = {}
        self.keys: dict[str, tuple[int, int, int]] = {}  # (priority, arrival, submission)
        self.samples: dict[
            tuple[int, str], tuple[bool, int]
        ] = {}  # (step, req) -> (samples, drafts)
        self.before: QueueView | None = None
        # varlen history
        self.step_times = StepTimes()
        self.prior_chances: list[float] = []
        self.proposals_in_flight: int | None = None
        self.uniform: dict[int, tuple[int, int, int, int | None]] = {}  # step -> shape
        self.last_end: float | None = None  # the driver's clock when a step was applied

    @property
    def waiting(self) -> list[str]:
        return self.in_progress + self.queued

    def _queue(self, d: Driver, rid: str, front: bool) -> None:
        if d.case.config.policy == "priority":
            keys = [self.keys[r] for r in self.queued]
            self.queued.insert(bisect.bisect(keys, self.keys[rid]), rid)
        elif front:
            self.queued.insert(0, rid)
        else:
            self.queued.append(rid)

    def _drop(self, rid: str) -> None:
        for q in (self.running, self.in_progress, self.queued):
            if rid in q:
                q.remove(rid)
        self.counts.pop(rid, None)

    def on_add(self, d: Driver, spec: ReqSpec, req: Request, reason: str | None) -> None:
        if reason is not None:
            return
        self.keys[spec.req_id] = (spec.priority, spec.arrival_step, len(self.keys))
        self.counts[spec.req_id] = Counts()
        self._queue(d, spec.req_id, front=False)

    def on_abort(self, d: Driver, req_id: str) -> None:
        self._drop(req_id)

    # ---- a step scheduled ----------------------------------------------------------------

    def on_schedule(self, d: Driver, out: SchedulerOutput, in_flight: bool) -> None:
        cfg = d.case.config
        lengths = None
        if cfg.enable_mtp_varlen and cfg.num_speculative_tokens:
            lengths = self._choose(cfg.num_speculative_tokens)
        self.before = QueueView(
            list(self.running),
            self.waiting,
            list(self.in_progress),
            {rid: replace(c, drafts=list(c.drafts)) for rid, c in self.counts.items()},
            lengths,
            self.proposals_in_flight,
        )
        for rid in reversed([r for r in self.running if r in out.preempted_req_ids]):
            self.running.remove(rid)  # newest first, each to the front
            c = self.counts[rid]
            c.computed = c.placeholders = c.pending_drafts = 0
            c.drafts, c.confidences, c.preempted = [], [], True
            self._queue(d, rid, front=True)
        for sr in out.scheduled:
            rid, c = sr.req_id, self.counts[sr.req_id]
            end = sr.num_computed_tokens + sr.num_tokens
            samples = end >= len(d.tokens(rid)) + c.placeholders
            c.computed, c.drafts = end, []
            c.pending_drafts += len(sr.draft_token_ids)
            c.placeholders += samples
            self.samples[(out.step_id, rid)] = (samples, len(sr.draft_token_ids))
            if rid in self.running:
                continue
            for q in (self.in_progress, self.queued):
                if rid in q:
                    q.remove(rid)
            c.preempted = False
            if samples:
                self.running.append(rid)
            else:
                self.in_progress.insert(0, rid)
        if lengths is not None and out.scheduled:
            self._plan(out)

    def _choose(self, k: int) -> dict[str, int]:
        """Varlen's lengths for the running requests (docs/design.md, "Speculative
        decoding"): a request whose next drafts come from the step in flight is judged
        by its running mean chances (the engine's before it has any), as many as that
        step proposes; lengths of uniform steps in flight not yet timed, chosen in this
        batch's bucket or the one that prices it, are not tried again."""
        conf = {}
        for rid in self.running:
            c = self.counts[rid]
            if c.placeholders:
                chances = c.chance_means or self.prior_chances
                conf[rid] = confidences_from_chances(chances)[: self.proposals_in_flight]
            else:
                conf[rid] = c.confidences
        n = len(conf)
        buckets = {StepTimes.bucket(n), self.step_times.pricing_bucket(n)}
        pending = {
            length
            for _, length, at_choice, _ in self.uniform.values()
            if StepTimes.bucket(at_choice) in buckets
        }
        lengths = draft_lengths(conf, k, times=self.step_times, pending=pending)
        self.step_times.note_choice(n, max(lengths.values(), default=0))
        return lengths

    def _plan(self, out: SchedulerOutput) -> None:
        """The step's proposals (its output says them) and, for a uniform step (no prompt,
        one draft length everywhere), the shape its time will price: filed under the
        bucket of the requests running when its length was chosen."""
        assert self.before is not None
        self.proposals_in_flight = out.num_proposals
        lengths = {len(sr.draft_token_ids) for sr in out.scheduled}
        if len(lengths) == 1 and not any(sr.is_prompt for sr in out.scheduled):
            at_choice = len(self.before.running) or len(out.scheduled)
            shape = (len(out.scheduled), lengths.pop(), at_choice, out.num_proposals)
            self.uniform[out.step_id] = shape

    # ---- a step's results ----------------------------------------------------------------

    def on_process(self, d: Driver, out: SchedulerOutput, res: ModelRunnerOutput) -> None:
        k = d.case.config.num_speculative_tokens
        for sr in out.scheduled:
            rid = sr.req_id
            samples, ndrafts = self.samples.pop((out.step_id, rid), (False, 0))
            c = self.counts.get(rid)
            if c is None or not samples:
                continue  # ended while in flight, or a prompt chunk short of the end
            # A stop string ended it after the update, which went on with it (its drafts
            # and chances counted) as the output processor only then read its text.
            went_on = rid in d.text_finished
            if d.reqs[rid].is_finished and not went_on:
                self._drop(rid)
                continue
            if rid not in self.running:
                if went_on:
                    self._drop(rid)
                continue  # preempted while in flight: its counts started over
            tokens = res.sampled_token_ids[rid]
            c.placeholders -= 1
            c.computed -= ndrafts - (len(tokens) - 1)
            c.pending_drafts -= ndrafts
            if k:
                c.drafts = list(res.draft_token_ids.get(rid, ()))[:k]
                c.confidences = list(res.draft_confidences.get(rid, ()))[:k]
                c.chance_means = smooth_chances(c.chance_means, c.confidences)
                if c.confidences:
                    self.prior_chances = smooth_chances(self.prior_chances, c.confidences)
            if went_on:
                self._drop(rid)
        now = d.time.now  # the clock apply_results read
        shape = self.uniform.pop(out.step_id, None)
        if shape is not None:
            num_reqs, length, at_choice, proposed = shape
            seconds = now - (self.last_end if self.last_end is not None else now)
            self.step_times.observe(num_reqs, length, seconds, at_choice, proposed)
        self.last_end = now


class QueueChecker(Checker):
    """A checker that keeps its own QueueMirror: each hook feeds the mirror first, and
    `check_schedule` runs once the mirror holds the view before the step (`queues.before`).
    A subclass overriding another hook calls this class's first."""

    def __init__(self) -> None:
        self.queues = QueueMirror()

    def on_add(self, d: Driver, spec: ReqSpec, req: Request, reason: str | None) -> None:
        self.queues.on_add(d, spec, req, reason)

    def on_abort(self, d: Driver, req_id: str) -> None:
        self.queues.on_abort(d, req_id)

    def on_schedule(self, d: Driver, out: SchedulerOutput, in_flight: bool) -> None:
        self.queues.on_schedule(d, out, in_flight)
        assert self.queues.before is not None
        self.check_schedule(d, out, self.queues.before, in_flight)

    def on_process(self, d: Driver, out: SchedulerOutput, res: ModelRunnerOutput) -> None:
        self.queues.on_process(d, out, res)

    def check_schedule(
        self, d: Driver, out: SchedulerOutput, view: QueueView, in_flight: bool
    ) -> None: ...
