"""Varlen's plan across steps (DEEPINFER_ENABLE_MTP_VARLEN=1): the draft lengths each
step's running requests may verify (spec_policy.draft_lengths), the drafts the drafter
proposes after the step (spec_policy.proposals), and the measured times of uniform steps
that price the lengths (step_times.StepTimes). The scheduler keeps one when varlen is
on; pure Python, so both executors run it."""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable, Sequence

from deepinfer.outputs import SchedulerOutput
from deepinfer.request import Request
from deepinfer.spec_policy import (
    PROBE_EVERY,
    confidences_from_chances,
    draft_lengths,
    proposals,
)
from deepinfer.step_times import StepTimes


class DraftPlan:
    def __init__(self, max_len: int) -> None:
        self.max_len = max_len  # num_speculative_tokens
        self.step_times = StepTimes()
        # this step's: req_id -> drafts it verifies at most, for every request running
        # when it was scheduled
        self.lengths: dict[str, int] = {}
        self.proposals_in_flight: int | None = None  # drafts the latest step proposes
        # the longest length verified in each of the last PROBE_EVERY steps that chose
        # one (steps of prompts alone choose none)
        self._recent_lengths: deque[int] = deque(maxlen=PROBE_EVERY)
        # step_id -> (requests, drafts each, requests running when the length was chosen,
        # drafts proposed after it) of uniform decode / verify steps not yet timed
        self._uniform_steps: dict[int, tuple[int, int, int, int | None]] = {}

    def choose(self, running: Sequence[Request], prior_chances: Sequence[float]) -> dict[str, int]:
        """Each running request's draft length for the step being scheduled (`lengths`),
        from its latest confidences; under async scheduling its next drafts come from the
        step in flight, unseen, and are judged by its running mean chances
        (spec_policy.smooth_chances), or the engine's (`prior_chances`) before it has any
        (its first drafts: those its prompt's last step proposes), as many as that step
        proposes."""
        conf = {
            r.request_id: (
                confidences_from_chances(r.spec_chance_means or prior_chances)[
                    : self.proposals_in_flight
                ]
                if r.num_output_placeholders
                else r.spec_confidences
            )
            for r in running
        }
        # Lengths of uniform steps in flight, not yet timed, chosen in this batch's
        # bucket or the one that prices it: not tried again meanwhile
        # (spec_policy.draft_lengths).
        n = len(conf)
        buckets = {StepTimes.bucket(n), self.step_times.pricing_bucket(n)}
        pending = {
            length
            for _, length, num_reqs_at_choice, _ in self._uniform_steps.values()
            if StepTimes.bucket(num_reqs_at_choice) in buckets
        }
        self.lengths = draft_lengths(conf, self.max_len, times=self.step_times, pending=pending)
        self.step_times.note_choice(n, max(self.lengths.values(), default=0))
        return self.lengths

    def plan_proposals(self, out: SchedulerOutput) -> None:
        """How many drafts the drafter proposes after `out`, a step with requests
        scheduled (spec_policy.proposals), and whether its time prices a draft length (a
        uniform step: no prompt tokens, the same drafts everywhere)."""
        lengths = {len(sr.draft_token_ids) for sr in out.scheduled}
        longest = max(lengths)
        # The bucket its length was chosen in (the token budget or a preemption may have
        # scheduled fewer than were running): the proposals and the timing read that one.
        num_reqs_at_choice = len(self.lengths) if self.lengths else len(out.scheduled)
        # From the longest length of the last few steps, not this one's alone: one step
        # of low confidences must not keep the next ones from their length (under async
        # the step after next is capped by this step's proposals). A step of prompts
        # alone chose no length: when four of them counted as 0, a request arriving
        # alone after a long prompt started at 1 draft and climbed back one length per
        # probe step.
        if self.lengths:
            self._recent_lengths.append(longest)
        out.num_proposals = proposals(
            max(self._recent_lengths, default=longest), self.max_len, num_reqs_at_choice,
            self.step_times, out.step_id,
        )  # fmt: skip
        self.proposals_in_flight = out.num_proposals
        if len(lengths) == 1 and not any(sr.is_prompt for sr in out.scheduled):
            self._uniform_steps[out.step_id] = (
                len(out.scheduled),
                longest,
                num_reqs_at_choice,
                out.num_proposals,
            )

    def observe_step_time(self, step_id: int, seconds: float) -> None:
        """A step's measured duration (wall time, or the simulator's): uniform steps
        price their draft length."""
        shape = self._uniform_steps.pop(step_id, None)
        if shape is not None:
            num_reqs, length, num_reqs_at_choice, proposed = shape
            self.step_times.observe(num_reqs, length, seconds, num_reqs_at_choice, proposed)

    def forget_steps(self, step_ids: Iterable[int] | None = None) -> None:
        """Steps whose results will never be applied (`step_ids`; None: every step in
        flight): their times measure no step, and no placeholder of theirs survives."""
        if step_ids is None:
            self._uniform_steps.clear()
        for step_id in step_ids or ():
            self._uniform_steps.pop(step_id, None)
        self.proposals_in_flight = None

    def uniform_in_flight(self) -> list[tuple[int, int, int, int | None]]:
        """(requests, drafts each, requests running when chosen, drafts proposed) of the
        uniform steps not yet timed, oldest first."""
        return list(self._uniform_steps.values())
