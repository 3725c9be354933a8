"""How often the property run reached each rare scheduler transition: a report printed
at the end of `pytest tests/property` (conftest.py), and a gate: a whole run of the
directory under the `ci` profile fails when a transition falls below its FLOOR.

Every `Driver` feeds `TRANSITIONS` from what it sees between the halves of each step:
the state before `schedule()` (the driver's Snapshot), the output, the executor's
results and the requests' output counts around `apply_results`. The labels are the
transitions a random workload rarely reaches (issue 48's list): a count of zero says the
generators never exercised it under the profile that ran.
"""

from __future__ import annotations

from collections import Counter
from typing import TYPE_CHECKING

from deepinfer.config import EngineRole
from deepinfer.outputs import ModelRunnerOutput, SchedulerOutput
from deepinfer.request import FinishReason

if TYPE_CHECKING:
    from tests.property.harness import Driver

# Every label the report lists, zero counts included, in this order.
LABELS = (
    "preemption",
    "recompute completed",
    "recompute chunk ends inside its outputs",
    "first chunk of a split prompt",
    "continuing chunk",
    "last chunk of a split prompt",
    "admission at usage exactly the watermark",
    "prefix hit of all blocks but the last",
    "finish in a step that preempted",
    "draft rejected at depth 1",
    "draft rejected at depth 2",
    "draft rejected at depth 3",
    "draft rejected at depth 4+",
    "stop inside accepted drafts",
    "length limit inside accepted drafts",
    "stop string ended a request",
    "stop string inside accepted drafts",
    "decode run of several steps",
    "decode run of several steps under async scheduling",
    "request ended inside a decode run",
    "request ended in the turn before an async run's last step",
    "decode run beside a request awaiting its KV",
)


# The fewest times a whole `ci` run must reach each transition: about a fifth of what the
# generators reach today, so a strategy or default that stops exercising one fails the
# run by name instead of passing without testing it.
FLOOR = {
    "preemption": 250,
    "recompute completed": 80,
    "recompute chunk ends inside its outputs": 30,
    "first chunk of a split prompt": 1000,
    "continuing chunk": 5000,
    "last chunk of a split prompt": 1000,
    "admission at usage exactly the watermark": 25,
    "prefix hit of all blocks but the last": 200,
    "finish in a step that preempted": 30,
    "draft rejected at depth 1": 5000,
    "draft rejected at depth 2": 1000,
    "draft rejected at depth 3": 400,
    "draft rejected at depth 4+": 90,
    "stop inside accepted drafts": 140,
    "length limit inside accepted drafts": 700,
    "stop string ended a request": 300,
    "stop string inside accepted drafts": 90,
    "decode run of several steps": 20,
    "decode run of several steps under async scheduling": 15,
    "request ended inside a decode run": 18,
    "request ended in the turn before an async run's last step": 1,
    "decode run beside a request awaiting its KV": 3,
}


class Transitions:
    """Session-wide counts of the transitions in LABELS."""

    def __init__(self) -> None:
        self.counts: Counter[str] = Counter()
        self._live_before: dict[str, int] = {}  # scheduled, not ended -> outputs before

    def on_schedule(self, d: Driver, out: SchedulerOutput) -> None:
        snap, cfg, c = d.snap, d.case.config, self.counts
        assert snap is not None
        bs = cfg.block_size
        if out.preempted_req_ids:
            c["preemption"] += len(out.preempted_req_ids)
        held = {b for rid, t in snap.tables.items() if rid not in out.preempted_req_ids for b in t}
        for sr in out.scheduled:
            req, state = d.reqs[sr.req_id], snap.state.get(sr.req_id)
            end = sr.num_computed_tokens + sr.num_tokens - len(sr.draft_token_ids)
            total = state.num_tokens if state is not None else req.num_tokens
            if sr.is_prompt:
                if sr.block_table is not None and end < total:
                    c["first chunk of a split prompt"] += 1
                elif sr.block_table is None and sr.req_id in snap.in_progress:
                    c["continuing chunk"] += 1
                    if end == total:
                        c["last chunk of a split prompt"] += 1
                if req.num_preemptions and end == total:
                    c["recompute completed"] += 1
                if req.num_preemptions and req.num_prompt_tokens < end < total:
                    c["recompute chunk ends inside its outputs"] += 1
            if sr.block_table is not None:  # (re)admitted this step
                if cfg.role is EngineRole.NORMAL and len(held) == cfg.prefill_watermark * (
                    cfg.num_gpu_blocks or 0
                ):
                    c["admission at usage exactly the watermark"] += 1
                hit = sr.num_computed_tokens // bs
                if cfg.role is not EngineRole.DECODE and hit and hit == -(-total // bs) - 1:
                    c["prefix hit of all blocks but the last"] += 1
                held.update(sr.block_table)
            else:
                held.update(sr.new_block_ids)

    def before_process(self, d: Driver, out: SchedulerOutput) -> None:
        self._live_before = {
            sr.req_id: d.reqs[sr.req_id].num_output_tokens
            for sr in out.scheduled
            if not d.reqs[sr.req_id].is_finished
        }

    def on_process(self, d: Driver, out: SchedulerOutput, res: ModelRunnerOutput) -> None:
        c = self.counts
        finished = [rid for rid in self._live_before if d.reqs[rid].is_finished]
        if finished and out.preempted_req_ids:
            c["finish in a step that preempted"] += 1
        for sr in out.scheduled:
            sampled = res.sampled_token_ids.get(sr.req_id, [])
            k, accepted = len(sr.draft_token_ids), len(sampled) - 1
            if k and 0 <= accepted < k:
                c[f"draft rejected at depth {min(accepted + 1, 4)}{'+' * (accepted >= 3)}"] += 1
            req, before = d.reqs[sr.req_id], self._live_before.get(sr.req_id)
            if sr.req_id in d.text_ended:
                c["stop string ended a request"] += 1
            if before is None or len(sampled) < 2 or not req.is_finished:
                continue
            if sr.req_id in d.text_ended and req.num_output_tokens - before < len(sampled):
                c["stop string inside accepted drafts"] += 1
            if req.num_output_tokens - before < len(sampled):  # it ended inside them
                if req.finish_reason is FinishReason.STOP:
                    c["stop inside accepted drafts"] += 1
                elif req.finish_reason is FinishReason.LENGTH:
                    c["length limit inside accepted drafts"] += 1

    def below_floor(self) -> list[str]:
        """The transitions reached fewer times than FLOOR says, with their counts."""
        return [
            f"{label}: {self.counts[label]} < {FLOOR[label]}"
            for label in LABELS
            if self.counts[label] < FLOOR[label]
        ]

    def report(self) -> str:
        width = max(map(len, LABELS))
        lines = [f"  {label:<{width}}  {self.counts[label]}" for label in LABELS]
        return "scheduler transitions reached (tests/property/coverage.py):\n" + "\n".join(lines)


TRANSITIONS = Transitions()
