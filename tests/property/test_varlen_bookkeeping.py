"""Varlen's bookkeeping in the scheduler (deepinfer/draft_plan.py, spec_policy.py).

With confidence-scheduled drafts the scheduler asks the drafter, in each step, for the
drafts the next step may verify, and learns what each draft length costs from the
steps it times. Three rules, checked on every step of generated workloads with varlen
forced on (random acceptance, preemption, async scheduling, chunking, the roles):
- a step asks for as many drafts as the longest length of the last PROBE_EVERY steps
  that chose one (at least one; a step scheduled with no request running, prompts
  alone, chooses none; with none, the step's own), or one more (capped at k) whenever
  that longer length's price does not stand in the bucket its lengths were chosen in
  (StepTimes.settled: none, or one due to be measured again), and every PROBE_EVERY
  steps (a probe);
- under async scheduling a step verifies no more placeholders than the step in flight
  was asked to propose;
- the times the policy learns from are those of exactly the uniform steps (no prompt
  tokens, every request verifying the same number of drafts), each filed under the
  bucket of the requests running when its length was chosen (the step's own requests
  when none were).
"""

from __future__ import annotations

from collections import Counter

from hypothesis import assume, given

from deepinfer.outputs import DRAFT_PLACEHOLDER, ModelRunnerOutput, SchedulerOutput
from deepinfer.spec_policy import PROBE_EVERY
from deepinfer.step_times import StepTimes
from tests.property.harness import Driver, run_case
from tests.property.queue_mirror import QueueChecker, QueueView
from tests.property.strategies import EngineCase, Workload, any_case_and_workload, scaled


class VarlenBookkeeping(QueueChecker):
    """Who ran when a length was chosen, and the step times that price the lengths, come
    from its own QueueMirror (kept from the outputs and the driver's clock), never from
    the scheduler's DraftPlan."""

    def __init__(self) -> None:
        super().__init__()
        self.in_flight_proposals: int | None = None
        self.recent: list[int] = []  # the longest length of the last steps that chose one
        self.pending: dict[int, int] = {}  # step_id -> bucket of a uniform step
        self.uniform: Counter[int] = Counter()  # bucket -> uniform steps processed
        self.processed = 0

    def check_schedule(
        self, d: Driver, out: SchedulerOutput, view: QueueView, in_flight: bool
    ) -> None:
        if not out.scheduled:
            return
        k = d.case.config.num_speculative_tokens
        lengths = {len(sr.draft_token_ids) for sr in out.scheduled}
        longest = max(lengths)
        num_reqs_at_choice = len(view.running) or len(out.scheduled)  # its length's bucket
        times = self.queues.step_times  # as plan_proposals reads its own: observed in process
        # settled prices: a due length is not, unless given up
        known = times.prices(num_reqs_at_choice).keys() - (
            times.due(num_reqs_at_choice) - times.given_up(num_reqs_at_choice)
        )
        if view.running:  # a length was chosen (for the requests running)
            self.recent = (self.recent + [longest])[-PROBE_EVERY:]
        base = max(self.recent, default=longest)
        grows = base + 1 not in known or out.step_id % PROBE_EVERY == 0
        want = min(k, base + 1) if grows else max(1, base)
        assert out.num_proposals == want, (
            f"step {out.step_id}: asks for {out.num_proposals} drafts after verifying up to "
            f"{longest}, {base} lately (k = {k}; {base + 1} settled: {base + 1 in known})"
        )
        for sr in out.scheduled:
            if sr.draft_token_ids[:1] == [DRAFT_PLACEHOLDER]:
                assert in_flight and self.in_flight_proposals is not None
                assert len(sr.draft_token_ids) <= self.in_flight_proposals, (
                    f"step {out.step_id}: {sr.req_id} verifies {len(sr.draft_token_ids)} "
                    f"placeholders; the step in flight proposes {self.in_flight_proposals}"
                )
        self.in_flight_proposals = out.num_proposals
        if len(lengths) == 1 and not any(sr.is_prompt for sr in out.scheduled):
            self.pending[out.step_id] = StepTimes.bucket(num_reqs_at_choice)

    def on_process(self, d: Driver, out: SchedulerOutput, res: ModelRunnerOutput) -> None:
        super().on_process(d, out, res)
        bucket = self.pending.pop(out.step_id, None)
        self.processed += 1
        if bucket is not None and self.processed > 1:  # the first step has no duration
            self.uniform[bucket] += 1
        assert d.sched.draft_plan is not None
        times = d.sched.draft_plan.step_times
        for b, n in self.uniform.items():
            got = times.num_measured(1 << (b - 1))
            assert got == n, (
                f"after step {out.step_id}: {got} steps measured for batches of "
                f"{1 << (b - 1)}-{(1 << b) - 1} running requests, {n} uniform ones ran"
            )


@scaled(0.5)
@given(any_case_and_workload())
def test_varlen_asks_for_verifiable_drafts_and_learns_from_uniform_steps(
    cw: tuple[EngineCase, Workload],
) -> None:
    """Caught mutants of `DraftPlan.plan_proposals` (no proposals asked for; uniform
    steps taken for two lengths) and `observe_step_time` (no time recorded; filed under
    the scheduled requests' bucket: a budget-cut step lands in the wrong one)."""
    case, workload = cw
    assume(case.config.num_speculative_tokens > 0)
    case = EngineCase(case.config.replace(enable_mtp_varlen=True), case.acceptance_rate)
    run_case(case, workload, VarlenBookkeeping())
