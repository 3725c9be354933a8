"""Varlen's plan across steps (deepinfer/draft_plan.py) against a reference that keeps
its own bookkeeping, restated from the module's docstrings and docs/design.md
("Variable-length drafts"):
- `choose`: a request's confidences are its latest drafts', or, while the step in
  flight proposes its next drafts (placeholders), the confidences its running mean
  chances imply (the engine's `prior_chances` before it has its own), cut to what that
  step proposes; the lengths of uniform steps not yet timed whose length was chosen in
  this batch's bucket or the one that prices it are pending; the choice is noted under
  the longest length chosen;
- `plan_proposals`: the drafter is asked for drafts from the longest length of the last
  PROBE_EVERY steps that chose a length (steps with no request running chose none),
  for the bucket of the requests running when the length was chosen (the step's own
  when none ran); a step with one draft length and no prompt is uniform, and its time,
  when it comes, prices that length in that bucket with what its drafter proposed;
- `observe_step_time` files only uniform steps, once; `forget_steps` drops the given
  steps (all in flight with None), and with them the drafts in flight.

The policy's functions (`spec_policy.draft_lengths`, `proposals`) and `StepTimes` are
the collaborators, each judged by its own model test; the reference feeds its own
`StepTimes` from its own records, so a step the plan files wrongly shows as a
different price, due length or given-up length.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from hypothesis import given
from hypothesis import strategies as st

from deepinfer.draft_plan import DraftPlan
from deepinfer.outputs import DRAFT_PLACEHOLDER, ScheduledRequest, SchedulerOutput
from deepinfer.spec_policy import draft_lengths
from deepinfer.step_times import StepTimes
from tests.property.strategies import at_least
from tests.property.varlen_reference import (
    PROBE_EVERY,
    bucket_of,
    reference_confidences,
    reference_proposals,
)

EIGHTHS = st.sampled_from([1.0, 0.0, 0.5]) | st.integers(0, 8).map(lambda k: k / 8)
BATCHES = [0, 1, 3, 5]

Shape = tuple[int, int, int, int | None]


@dataclass
class Running:
    """What `choose` reads of a running request."""

    request_id: str
    spec_confidences: list[float]
    num_output_placeholders: int = 0
    spec_chance_means: list[float] = field(default_factory=list)


@dataclass
class ReferencePlan:
    max_len: int
    times: StepTimes = field(default_factory=StepTimes)
    lengths: dict[str, int] = field(default_factory=dict)
    proposals_in_flight: int | None = None
    recent: list[int] = field(default_factory=list)
    uniform: dict[int, Shape] = field(default_factory=dict)  # step_id -> shape, oldest first

    def choose(self, running: list[Running], prior: list[float]) -> dict[str, int]:
        conf = {}
        for r in running:
            if r.num_output_placeholders:
                implied = reference_confidences(r.spec_chance_means or prior)
                cap = len(implied) if self.proposals_in_flight is None else self.proposals_in_flight
                conf[r.request_id] = implied[:cap]
            else:
                conf[r.request_id] = r.spec_confidences
        n = len(conf)
        buckets = {bucket_of(n), self.times.pricing_bucket(n)}
        pending = {s[1] for s in self.uniform.values() if bucket_of(s[2]) in buckets}
        self.lengths = draft_lengths(conf, self.max_len, times=self.times, pending=pending)
        self.times.note_choice(n, max(self.lengths.values(), default=0))
        return self.lengths

    def plan(self, step_id: int, scheduled: list[ScheduledRequest]) -> int:
        lengths = {len(sr.draft_token_ids) for sr in scheduled}
        longest = max(lengths)
        at_choice = len(self.lengths) or len(scheduled)
        if self.lengths:
            self.recent = (self.recent + [longest])[-PROBE_EVERY:]
        base = max(self.recent) if self.recent else longest
        num = reference_proposals(base, self.max_len, at_choice, self.times, step_id)
        self.proposals_in_flight = num
        if len(lengths) == 1 and not any(sr.is_prompt for sr in scheduled):
            self.uniform[step_id] = (len(scheduled), longest, at_choice, num)
        return num

    def timed(self, step_id: int, seconds: float) -> None:
        if step_id in self.uniform:
            num_reqs, length, at_choice, proposed = self.uniform.pop(step_id)
            self.times.observe(num_reqs, length, seconds, at_choice, proposed)

    def forget(self, step_ids: list[int] | None) -> None:
        for step_id in list(self.uniform) if step_ids is None else step_ids:
            self.uniform.pop(step_id, None)
        self.proposals_in_flight = None


def agree(plan: DraftPlan, ref: ReferencePlan, at: str) -> None:
    assert plan.lengths == ref.lengths, f"{at}: lengths {plan.lengths}, want {ref.lengths}"
    assert plan.proposals_in_flight == ref.proposals_in_flight, f"{at}: proposals in flight"
    assert plan.uniform_in_flight() == list(ref.uniform.values()), f"{at}: uniform steps"
    for n in BATCHES:
        got, want = plan.step_times, ref.times
        assert got.num_measured(n) == want.num_measured(n), f"{at}: steps timed, batch {n}"
        assert got.prices(n) == want.prices(n), f"{at}: prices, batch {n}"
        assert got.given_up(n) == want.given_up(n), f"{at}: given up, batch {n}"
        assert got.settled(n) == want.settled(n), f"{at}: settled, batch {n}"


def scheduled_request(req_id: str, drafts: int, placeholders: bool) -> ScheduledRequest:
    ids = [DRAFT_PLACEHOLDER if placeholders else 7] * drafts
    return ScheduledRequest(req_id, 1 + drafts, 10, False, True, [], draft_token_ids=ids)


@at_least(200)
@given(max_len=st.integers(1, 4), data=st.data())
def test_the_plan_keeps_its_steps_as_the_reference_does(max_len: int, data: st.DataObject) -> None:
    plan, ref = DraftPlan(max_len), ReferencePlan(max_len)
    agree(plan, ref, "new")
    step_id = 0
    for op in range(data.draw(st.integers(1, 16))):
        at = f"op {op} (step {step_id})"
        kind = data.draw(st.integers(0, 9))
        if kind <= 5:  # schedule a step
            num_running = data.draw(st.sampled_from(BATCHES))
            running = [
                Running(
                    f"r{i}",
                    data.draw(st.lists(EIGHTHS, max_size=max_len + 1)),
                    data.draw(st.sampled_from([0, 0, 1, 2])),
                    data.draw(st.lists(EIGHTHS, max_size=max_len + 1)),
                )
                for i in range(num_running)
            ]
            prior = data.draw(st.lists(EIGHTHS, max_size=max_len + 1))
            got = plan.choose(running, prior)  # type: ignore[arg-type]
            assert got == ref.choose(running, prior), f"{at}: chosen lengths"
            agree(plan, ref, at)
            # the token budget or a preemption may schedule fewer; prompts may join
            # (mostly every request verifies its length, as the scheduler's drafts allow)
            kept = running[: data.draw(st.integers(0, len(running)))]
            cut = data.draw(st.integers(0, 3)) == 0
            scheduled = [
                scheduled_request(
                    r.request_id,
                    data.draw(st.integers(0, got[r.request_id])) if cut else got[r.request_id],
                    bool(r.num_output_placeholders),
                )
                for r in kept
            ]
            for j in range(data.draw(st.sampled_from([0, 0, 0, 1, 2]))):
                scheduled.append(
                    ScheduledRequest(f"p{j}", 16, 0, True, data.draw(st.booleans()), [])
                )
            step_id += 1
            if scheduled:  # an empty step is not planned (Scheduler.schedule)
                out = SchedulerOutput(step_id, scheduled)
                want = ref.plan(step_id, scheduled)
                plan.plan_proposals(out)
                assert out.num_proposals == want, f"{at}: asks for {out.num_proposals}"
        elif kind <= 7:  # a step's time comes back (or one never planned, or twice)
            oldest = sorted(ref.uniform)[:1]
            which = data.draw(st.sampled_from(oldest * 4 + sorted(ref.uniform) + [step_id + 5]))
            seconds = data.draw(st.sampled_from([0.01, 0.02, 0.04]))
            plan.observe_step_time(which, seconds)
            ref.timed(which, seconds)
        elif kind == 8:
            steps = data.draw(st.lists(st.sampled_from(sorted(ref.uniform) + [step_id + 3])))
            plan.forget_steps(steps)
            ref.forget(steps)
        else:
            plan.forget_steps()
            ref.forget(None)
        agree(plan, ref, at)
