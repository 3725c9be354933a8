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

import math
from collections.abc import Callable, Generator
from dataclasses import dataclass, field
from typing import Any

import simpy

from deepinfer.config import EngineConfig
from deepinfer.engine import EngineCore, StepEvent, StepEventKind
from deepinfer.model_config import ModelConfig
from deepinfer.records import RequestRecord, StepRecord
from deepinfer.request import Request
from deepinfer.routing import InstanceLoad, InstanceView, make_router
from deepinfer.routing.instance_report import InstanceReport, report_of, take_report, view_of
from sim.acceptance import AcceptanceModel
from sim.analytic_cost_model import AnalyticCostModel
from sim.cost_coefficients import load_cost_coefficients
from sim.cost_model import CostModel
from sim.engine_loop import Arrivals, Clock
from sim.expert_parallel_cost import ExpertParallelCost, draft_pass_rows
from sim.hardware import HardwareSpec
from sim.sim_executor import SimExecutor


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


def rank_group(
    env: simpy.Environment,
    spec: ModelConfig,
    hw: HardwareSpec,
    engine: EngineConfig,
    cost: CostModel,
    cost_meta: dict[str, Any],
    num_blocks: int,
    acceptance: float | AcceptanceModel,
    check_invariants: bool,
) -> tuple[RankGroup, ExpertParallelCost]:
    """`engine.data_parallel_size` ranks (num_blocks each) on `env`'s clock, and the price
    of their rounds. Refuses what the ranks cannot run in lock-step rounds."""
    n = engine.data_parallel_size
    if engine.async_scheduling:
        raise ValueError(
            f"async_scheduling=True with data_parallel_size={n}: the simulator runs the ranks "
            "in lock-step rounds and does not model async overlap; set it to False"
        )
    analytic = cost if isinstance(cost, AnalyticCostModel) else None
    if analytic is None and cost_meta.get("cost_model") == "profiled":
        analytic = AnalyticCostModel(spec, hw, load_cost_coefficients())
    rounds = ExpertParallelCost(
        spec, hw, n, expert_parallel=engine.enable_expert_parallel, analytic=analytic,
        seed=engine.seed, activation_bytes=2,
    )  # fmt: skip
    cores = [
        EngineCore(
            engine,
            SimExecutor(engine, num_blocks, acceptance_rate=acceptance),
            clock=lambda: env.now,
            model_max_len=spec.max_position_embeddings,
            check_invariants=check_invariants,
        )  # fmt: skip
        for _ in range(n)
    ]
    return RankGroup(cores), rounds


class RankGroup:
    """N ranks in lock-step behind their router (the engine's `data_parallel_router`):
    what `simulate()` serves with data_parallel_size > 1, and one instance of a cluster
    pool of such instances. It takes requests as one engine does (`add_request`), keeps
    every rank's records in the order they ended and one step record per round, and
    reports to a cluster's router as one instance: queues and running summed over the
    ranks, KV usage their mean, a prefix cached where any rank caches it."""

    def __init__(self, cores: list[EngineCore]) -> None:
        config = cores[0].config
        self.cores = cores
        self.config = config
        self.router = make_router(config.data_parallel_router, len(cores), seed=config.seed)
        self.views = [view_of(r, core) for r, core in enumerate(cores)]
        self.num_records = [0] * len(cores)  # each rank's records the router has heard of
        self.records: list[RequestRecord] = []
        self.steps: list[StepRecord] = []
        self.requests_per_rank = [0] * len(cores)
        self._changes: dict[int, bool] = {}  # the group's cached prefixes since its report
        self._rank_of: dict[str, int] = {}  # requests awaiting their KV -> their rank

    @property
    def block_size(self) -> int:
        return self.config.block_size

    @property
    def max_prompt_tokens(self) -> int:
        return min(c.scheduler.max_prompt_tokens for c in self.cores)

    def add_request(self, req: Request) -> str | None:
        rank = self.router.route(req, self.views)
        self.requests_per_rank[rank] += 1
        core = self.cores[rank]
        reason = core.add_request(req)
        if reason is None and req.awaiting_kv:
            self._rank_of[req.request_id] = rank
        if reason is not None:  # rejected at once: it ended there
            self.records += core.records[self.num_records[rank] :]
            self.num_records[rank] = len(core.records)
            self.router.on_finished(req.request_id, rank)
        return reason

    def has_unfinished(self) -> bool:
        return any(c.has_unfinished() for c in self.cores)

    # ---- a cluster's handovers (EngineCore's calls of the same names) -----------------

    def take_started(self) -> list[tuple[str, float]]:
        return [s for c in self.cores for s in c.take_started()]

    def take_kv_reserved(self) -> list[tuple[str, float]]:
        return [r for c in self.cores for r in c.take_kv_reserved()]

    def kv_arrived(self, req_id: str) -> None:
        self.cores[self._rank_of.pop(req_id)].kv_arrived(req_id)

    def abort(self, req_id: str) -> None:
        """End a request on whichever rank holds it."""
        self._rank_of.pop(req_id, None)
        for rank, c in enumerate(self.cores):
            if c.abort(req_id) is not None:
                self._hear(rank)  # its record is the group's now
                return

    def after_round(self) -> None:
        """Every rank reports to the group's router after a round."""
        for r in range(len(self.cores)):
            self._hear(r)

    def _hear(self, rank: int) -> None:
        core = self.cores[rank]
        ended = core.records[self.num_records[rank] :]
        self.num_records[rank] = len(core.records)
        self.records += ended
        report = report_of(rank, core, [rec.req_id for rec in ended])
        take_report(self.router, self.views, report)
        for h, now in report.cache_changes.items():
            self._changes[h] = now or any(h in v.cached for v in self.views)

    def load(self) -> InstanceLoad:
        s = [c.scheduler for c in self.cores]
        usage = sum(x.kv.usage for x in s) / len(s)
        return InstanceLoad(sum(x.num_waiting for x in s), sum(x.num_running for x in s), usage)

    def report(self, index: int, ended: list[str]) -> InstanceReport:
        """The group's report as one instance `index` of a cluster pool."""
        changes, self._changes = self._changes, {}
        return InstanceReport(index, self.load(), changes, tuple(ended))

    def view(self, index: int) -> InstanceView:
        return InstanceView(index, self.block_size, self.max_prompt_tokens, self.load())


def serve_data_parallel(
    env: simpy.Environment,
    group: RankGroup,
    arrivals: Arrivals,
    clock: Clock,
    cost: CostModel,
    rounds: ExpertParallelCost,
    stats: DataParallelStats,
    on_progress: Callable[[int], None] | None = None,
) -> Generator[simpy.events.Event, Any, None]:
    """The simpy process: admit arrivals (the group's router places them), run lock-step
    rounds. A rank's step costs its host time plus its device time (no structured
    requests here: the engine does not serve them over several ranks, and simulate()
    refuses them). A round's results are applied once the simpy clock reaches its end;
    `clock` reads that end from the round's start (what a cluster asks of an instance)."""
    cores = group.cores
    stats.requests_per_rank = group.requests_per_rank
    stats.steps_per_rank = [0] * len(cores)
    reported = 0
    while arrivals.more_may_come() or group.has_unfinished():
        clock.now = env.now
        arrivals.admit(env.now)
        if not group.has_unfinished():
            if arrivals.more_may_come():  # else the last arrivals were all rejected
                yield from _idle(env, clock, arrivals)
            continue
        started = [len(c.steps) for c in cores]
        stepped = False
        waiting: list[Generator[StepEvent, None, list[Request]]] = []
        tokens, seconds = [0] * len(cores), [0.0] * len(cores)
        draft_rows: list[list[int]] = [[] for _ in cores]  # rows of each rank's MTP passes
        for r, core in enumerate(cores):
            if not core.has_unfinished():
                continue
            events = core.step_events()
            for kind, out in events:  # up to the step's AWAIT (no async: refused)
                stepped = True
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
        arrivals.scheduled()  # before the round's time passes: a handover begins now
        if not stepped:  # nothing to run: every request left awaits its KV
            arrivals.stepped(env.now)
            yield from _idle(env, clock, arrivals)
            continue
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
            clock.now = env.now + rc.seconds
            yield env.timeout(rc.seconds)
        clock.now = env.now
        for events in waiting:
            for _ in events:  # the rest of the step: its results are applied now
                pass
        group.after_round()
        if any(len(c.steps) > n for c, n in zip(cores, started)):
            group.steps.append(_round_record(cores, started, stats.num_rounds, env.now, rc.seconds))
        arrivals.stepped(env.now)
        if on_progress is not None and len(group.records) != reported:
            on_progress(len(group.records) - reported)
            reported = len(group.records)


def _idle(
    env: simpy.Environment, clock: Clock, arrivals: Arrivals
) -> Generator[simpy.events.Event, Any, None]:
    """Wait, with nothing to run, until the next request is due or the arrivals' wake
    event fires (a round's clock is the simpy clock itself)."""
    due = arrivals.next_time()
    wake = arrivals.wake()
    if due < math.inf:
        timer = env.timeout(due - env.now)
        clock.now = due  # what a cluster reads as the soonest this instance can step
        yield timer if wake is None else timer | wake
    elif wake is not None:
        yield wake
    else:
        raise RuntimeError("idle ranks wait for requests that nothing will bring")
    clock.now = env.now


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
