"""Simulated attention data parallelism (and expert parallelism): N ranks in lock-step.

Each rank is the real EngineCore over its own SimExecutor (its own scheduler and KV
cache); arrivals are placed by the real front-end's router (deepinfer.routing, the
engine's `data_parallel_router`, fed each rank's report after every round, as the real
front-end is). A round is one engine step on every rank with work; it lasts
as long as the slowest rank plus the all-to-all of the MoE layers
(sim/expert_parallel_cost.py), which is also how the real ranks step (deepinfer/
data_parallel/front_end.py). With speculation every rank runs as many MTP passes as
the rank that drafts furthest; a rank's own passes are in its step's price, the
padding and each pass's all-to-all in the round's.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Generator
from dataclasses import dataclass, field
from typing import Any

import simpy

from deepinfer.engine import EngineCore, StepEvent, StepEventKind
from deepinfer.records import StepRecord
from deepinfer.request import Request
from deepinfer.routing import make_router
from deepinfer.routing.instance_report import report_of, take_report, view_of
from sim.cost_model import CostModel
from sim.expert_parallel_cost import ExpertParallelCost, draft_pass_rows


@dataclass
class DataParallelStats:
    """What the report says of the layout, summed over the rounds."""

    num_rounds: int = 0
    all_to_all_seconds: float = 0.0
    straggler_seconds: float = 0.0  # sum over rounds of (slowest rank - mean rank)
    requests_per_rank: list[int] = field(default_factory=list)
    steps_per_rank: list[int] = field(default_factory=list)
    max_over_mean_pairs: list[float] = field(default_factory=list)  # expert load, per round
    draft_passes: int = 0  # MTP passes of the rounds (each run on every rank, in lock-step)
    padded_draft_passes: int = 0  # of those, summed over the ranks: passes a rank padded

    def to_meta(self) -> dict[str, Any]:
        imb = self.max_over_mean_pairs
        return {
            "dp_rounds": self.num_rounds,
            "dp_requests_per_rank": self.requests_per_rank,
            "dp_steps_per_rank": self.steps_per_rank,
            "all_to_all_seconds": self.all_to_all_seconds,
            "straggler_seconds": self.straggler_seconds,
            "expert_load_max_over_mean": sum(imb) / len(imb) if imb else None,
            "dp_draft_passes": self.draft_passes,
            "dp_padded_draft_passes": self.padded_draft_passes,
        }


def serve_data_parallel(
    env: simpy.Environment,
    cores: list[EngineCore],
    pending: deque[Request],
    cost: CostModel,
    rounds: ExpertParallelCost,
    stats: DataParallelStats,
    steps: list[StepRecord],
    on_progress: Callable[[int], None] | None = None,
) -> Generator[simpy.events.Event, Any, None]:
    """The simpy process: admit arrivals through the router, run lock-step rounds. A
    rank's step costs its host time plus its device time (no structured requests here:
    the engine does not serve them over several ranks, and simulate() refuses them)."""
    config = cores[0].config
    router = make_router(config.data_parallel_router, len(cores), seed=config.seed)
    views = [view_of(r, core) for r, core in enumerate(cores)]
    num_records = [0] * len(cores)  # each rank's records the router has heard of
    stats.requests_per_rank = [0] * len(cores)
    stats.steps_per_rank = [0] * len(cores)
    reported = 0
    while pending or any(c.has_unfinished() for c in cores):
        while pending and pending[0].arrival_time <= env.now:
            req = pending.popleft()
            rank = router.route(req, views)
            stats.requests_per_rank[rank] += 1
            if cores[rank].add_request(req) is not None:  # rejected at once
                num_records[rank] += 1
                router.on_finished(req.request_id, rank)
        if not any(c.has_unfinished() for c in cores):
            if pending:
                yield env.timeout(pending[0].arrival_time - env.now)
            continue
        started = [len(c.steps) for c in cores]
        waiting: list[Generator[StepEvent, None, list[Request]]] = []
        tokens, seconds = [0] * len(cores), [0.0] * len(cores)
        draft_rows: list[list[int]] = [[] for _ in cores]  # rows of each rank's MTP passes
        for r, core in enumerate(cores):
            if not core.has_unfinished():
                continue
            events = core.step_events()
            for kind, out in events:  # up to the step's AWAIT (no async: refused)
                if kind is StepEventKind.SCHEDULED:
                    seconds[r] += cost.cpu_time(out)
                elif kind is StepEventKind.LAUNCHED:
                    seconds[r] += cost.step_time(out)
                    tokens[r] += out.num_batched_tokens
                    draft_rows[r] = draft_pass_rows(out, core.config.num_speculative_tokens)
                else:
                    waiting.append(events)
                    stats.steps_per_rank[r] += 1
                    break
        rc = rounds.round(tokens, seconds, draft_rows)
        if rc.pairs_received and sum(rc.pairs_received):
            mean = sum(rc.pairs_received) / len(rc.pairs_received)
            stats.max_over_mean_pairs.append(max(rc.pairs_received) / mean)
        busy = [s for s, t in zip(rc.rank_seconds, tokens) if t] or [0.0]
        stats.straggler_seconds += max(busy) - sum(busy) / len(busy)
        stats.all_to_all_seconds += rc.all_to_all_seconds
        stats.draft_passes += rc.draft_passes
        if rc.draft_passes:  # (expert parallelism: the passes run in lock-step)
            stats.padded_draft_passes += sum(rc.draft_passes - len(r) for r in draft_rows)
        stats.num_rounds += 1
        if rc.seconds > 0:
            yield env.timeout(rc.seconds)
        for events in waiting:
            for _ in events:  # the rest of the step: its results are applied now
                pass
        for r, core in enumerate(cores):
            ended = [rec.req_id for rec in core.records[num_records[r] :]]
            num_records[r] = len(core.records)
            take_report(router, views, report_of(r, core, ended))
        if any(len(c.steps) > n for c, n in zip(cores, started)):
            steps.append(_round_record(cores, started, stats.num_rounds, env.now, rc.seconds))
        done = sum(len(c.records) for c in cores)
        if on_progress is not None and done != reported:
            on_progress(done - reported)
            reported = done


def _round_record(
    cores: list[EngineCore], started: list[int], round_id: int, now: float, duration: float
) -> StepRecord:
    """One record per round: counts summed over the ranks, KV usage their mean."""
    new = [s for c, n in zip(cores, started) for s in c.steps[n:]]
    return StepRecord(
        step_id=round_id,
        time=now,
        duration=duration,
        num_running=sum(c.scheduler.num_running for c in cores),
        num_waiting=sum(c.scheduler.num_waiting for c in cores),
        num_batched_tokens=sum(s.num_batched_tokens for s in new),
        num_prompt_tokens=sum(s.num_prompt_tokens for s in new),
        num_scheduled_reqs=sum(s.num_scheduled_reqs for s in new),
        kv_usage=sum(c.scheduler.kv.usage for c in cores) / len(cores),
        num_preempted=sum(s.num_preempted for s in new),
    )
