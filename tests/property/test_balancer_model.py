"""The data-parallel front-end's router (least-load) against a reference model of its rule (docs/design.md,
"Data parallelism"), as hypothesis state machines.

The model is the rule restated, never the balancer's bookkeeping: it keeps a log of
every placement and of each rank's last applied report, and at each placement computes
from them the ranks the rule allows (minimal reported queue plus placements since that
report, then KV usage, then running requests) and the one it must choose among them
(the lowest index). `BalancerMachine` drives `LeastLoadRouter` with arbitrary
reports; `FrontEndMachine` drives `DataParallelEngine` over real ranks (EngineCore on
a scripted executor) with arrivals, steps and front-end finishes, so the reports are
what ranks really say after placements, preemptions and finishes.
"""

from __future__ import annotations

import pickle
from typing import Any

from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from deepinfer.data_parallel.front_end import DataParallelEngine
from deepinfer.data_parallel.protocol import StepCommand, StepReply, Stop
from deepinfer.data_parallel.rank_loop import run_command
from deepinfer.data_parallel.request_sync import DeltaTracker
from deepinfer.engine import EngineCore
from deepinfer.request import FinishReason
from deepinfer.routing import InstanceLoad, InstanceView
from deepinfer.routing.policies import LeastLoadRouter
from tests.factories import make_engine, make_request, rank_info
from tests.property.harness import note
from tests.property.strategies import scaled


class RuleModel:
    """The balancer's rule over a log: placements (rank per placement, in order) and,
    per rank, its last applied report and how many placements the log held then."""

    def __init__(self, num_ranks: int) -> None:
        self.placements: list[int] = []
        self.reports = [InstanceLoad() for _ in range(num_ranks)]
        self.log_len_at_report = [0] * num_ranks

    def queue(self, rank: int) -> int:
        since = self.placements[self.log_len_at_report[rank] :]
        return self.reports[rank].num_waiting + since.count(rank)

    def allowed(self) -> list[int]:
        """The ranks the rule allows before its last tie-break (the index)."""

        def load(r: int) -> tuple[int, float, int]:
            return (self.queue(r), self.reports[r].kv_usage, self.reports[r].num_running)

        best = min(load(r) for r in range(len(self.reports)))
        return [r for r in range(len(self.reports)) if load(r) == best]

    def check_choice(self, chosen: int) -> None:
        """`chosen` is allowed, and it is the lowest allowed rank (ties go low); then
        the placement joins the log."""
        allowed = self.allowed()
        state = [
            (r, self.queue(r), self.reports[r].kv_usage, self.reports[r].num_running)
            for r in range(len(self.reports))
        ]
        assert chosen in allowed, f"placed on rank {chosen}; the rule allows {allowed}: {state}"
        assert chosen == allowed[0], f"placed on rank {chosen}, not lowest of {allowed}: {state}"
        note(f"placement among {min(len(allowed), 3)}{'+' if len(allowed) > 2 else ''} tied")
        self.placements.append(chosen)

    def report(self, rank: int, load: InstanceLoad) -> None:
        self.reports[rank] = load
        self.log_len_at_report[rank] = len(self.placements)


_USAGE = st.sampled_from([0.0, 0.25, 0.5, 1.0]) | st.floats(0.0, 1.0)


class BalancerMachine(RuleBasedStateMachine):
    """Arbitrary reports (ties in every field are common) and bursts of placements."""

    @initialize(n=st.integers(1, 5))
    def setup(self, n: int) -> None:
        self.lb = LeastLoadRouter(n)
        self.views = [InstanceView(r, 16, 1 << 20) for r in range(n)]  # every prompt fits
        self.count = 0
        self.model = RuleModel(n)

    def pick(self) -> int:
        self.count += 1
        return self.lb.route(make_request(f"r{self.count}", 4), self.views)

    @rule(burst=st.integers(1, 6))
    def place(self, burst: int) -> None:
        for _ in range(burst):
            self.model.check_choice(self.pick())

    @rule(
        pick=st.integers(0, 4),
        waiting=st.integers(0, 4),
        running=st.integers(0, 4),
        usage=_USAGE,
    )
    def report(self, pick: int, waiting: int, running: int, usage: float) -> None:
        rank = pick % self.lb.num_instances
        load = InstanceLoad(waiting, running, usage)
        self.lb.on_report(rank, load)
        self.model.report(rank, load)

    @rule()
    def everything_finished(self) -> None:
        """Every rank reports idle: the counts start over, a burst goes round-robin."""
        for r in range(self.lb.num_instances):
            self.lb.on_report(r, InstanceLoad())
            self.model.report(r, InstanceLoad())
        n = self.lb.num_instances
        assert [self.pick() for _ in range(2 * n)] == list(range(n)) * 2, "a count drifted"
        self.model.placements += list(range(n)) * 2


BalancerMachine.TestCase.settings = scaled(0.5)
test_the_balancer_places_as_its_rule_says = BalancerMachine.TestCase


class ObservedRank:
    """An in-process rank behind a pickling boundary (as over a pipe) that keeps the
    reply it last sent: the model reads each rank's report there, as the front-end
    receives it."""

    def __init__(self, rank: int, engine: EngineCore) -> None:
        self.rank, self.engine = rank, engine
        self.tracker = DeltaTracker()
        self.reply: StepReply | None = None

    def send(self, obj: Any) -> None:
        if isinstance(obj, Stop):
            return
        cmd: StepCommand = pickle.loads(pickle.dumps(obj))
        self.reply = run_command(self.rank, self.engine, cmd, self.tracker)

    def recv(self) -> Any:
        return pickle.loads(pickle.dumps(self.reply))


class FrontEndMachine(RuleBasedStateMachine):
    """Arrivals, steps and front-end finishes over 1-3 real ranks with small caches
    (queues, preemptions and uneven KV usage are common)."""

    @initialize(n=st.integers(1, 3), blocks=st.integers(3, 12), seqs=st.integers(1, 3))
    def setup(self, n: int, blocks: int, seqs: int) -> None:
        self.ranks = [
            ObservedRank(r, make_engine(num_gpu_blocks=blocks, max_num_seqs=seqs)) for r in range(n)
        ]
        infos = [rank_info(r.rank, r.engine) for r in self.ranks]
        self.dp = DataParallelEngine(self.ranks, infos)
        self.model = RuleModel(n)
        self.live: dict[str, int] = {}  # request -> the rank it was placed on (model's own)
        self.count = 0

    @rule(prompt=st.integers(1, 14), max_tokens=st.integers(1, 8), burst=st.integers(1, 3))
    def arrive(self, prompt: int, max_tokens: int, burst: int) -> None:
        for _ in range(burst):
            rid = f"r{self.count}"
            self.count += 1
            self.dp.add_request(make_request(rid, prompt, max_tokens=max_tokens))
            chosen = self.dp.rank_of[rid]
            self.model.check_choice(chosen)
            self.live[rid] = chosen

    @precondition(lambda self: self.dp.has_unfinished())
    @rule()
    def step(self) -> None:
        changed = self.dp.step()
        for r, rank in enumerate(self.ranks):  # every rank answered this step
            assert rank.reply is not None
            self.model.report(r, rank.reply.load)
            if rank.reply.load.num_waiting:
                note("a rank reported a queue")
        for req in changed:
            if req.is_finished:
                self.live.pop(req.request_id, None)

    @precondition(lambda self: self.live)
    @rule(pick=st.integers(0, 50), abort=st.booleans())
    def finish(self, pick: int, abort: bool) -> None:
        """The client ends a live request (sent to its rank or not yet)."""
        rid = sorted(self.live)[pick % len(self.live)]
        reason = FinishReason.ABORT if abort else FinishReason.STOP
        assert self.dp.finish(rid, reason) is not None
        del self.live[rid]

    @invariant()
    def reports_count_what_each_rank_holds(self) -> None:
        """Right after a step, each rank's report counts exactly the live requests
        placed there (what the balancer is told never drifts from what the rank holds)."""
        if not hasattr(self, "dp") or self._unsent():
            return
        for r, rank in enumerate(self.ranks):
            if rank.reply is None:
                continue
            load = rank.reply.load
            mine = sorted(rid for rid, at in self.live.items() if at == r)
            assert load.num_waiting + load.num_running == len(mine), (
                f"rank {r} reports {load} holding {mine}"
            )

    def _unsent(self) -> bool:
        """Some placement or finish is queued for the next step (reports lag it)."""
        return any(c.adds or c.finishes for c in self.dp._commands)

    def teardown(self) -> None:
        if not hasattr(self, "dp"):
            return
        steps = 0
        while self.dp.has_unfinished():
            self.step()
            steps += 1
            assert steps < 500, "the ranks never drained"
        assert not self.live, f"never finished: {sorted(self.live)}"


FrontEndMachine.TestCase.settings = settings(scaled(0.3), stateful_step_count=30, deadline=None)
test_the_front_end_places_as_the_balancers_rule_says = FrontEndMachine.TestCase
