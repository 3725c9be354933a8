"""What instances tell a router (deepinfer/routing/instance_report.py), over real engines,
as a hypothesis state machine (docs/design.md, "Clusters": a report holds the waiting and
running counts, the KV usage, the prefix blocks cached or evicted since the last report,
and the requests that ended).

Requests of shared prefixes are routed over 1-3 engines of different cache sizes and
stepped one engine at a time; after each step the engine's report is taken in
(`report_of`, `take_report`), as the cluster and the disaggregated engine do. The oracle
is the instance the report describes, read by other means than the report's code: its
queues' lengths, the blocks its requests hold (distinct blocks over the pool's), the
hashes its prefix index holds, and the driver's own log of what it placed where and saw
end. So the view must then equal the engine, and the router's outstanding count the
log's; a view made at any moment (`view_of`) starts from the engine's load then.
"""

from __future__ import annotations

import math

from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, rule

from deepinfer.engine import EngineCore
from deepinfer.routing import ROUTERS, InstanceLoad, make_router
from deepinfer.routing.instance_report import report_of, take_report, view_of
from tests.factories import make_engine, make_request
from tests.property.harness import note
from tests.property.strategies import scaled

BS = 4


def _load(engine: EngineCore) -> InstanceLoad:
    """The engine's load, from its queues and the blocks its requests hold."""
    s = engine.scheduler
    held = {b.block_id for blocks in s.kv.req_blocks.values() for b in blocks}
    return InstanceLoad(len(s.waiting), len(s.running), len(held) / s.kv.num_blocks)


def _same_load(got: InstanceLoad, want: InstanceLoad) -> bool:
    return (
        (got.num_waiting, got.num_running) == (want.num_waiting, want.num_running)
        and isinstance(got.kv_usage, float)
        and math.isclose(got.kv_usage, want.kv_usage, abs_tol=1e-9)
    )


class ReportMachine(RuleBasedStateMachine):
    @initialize(
        blocks=st.lists(st.integers(4, 12), min_size=1, max_size=3),
        policy=st.sampled_from(sorted(ROUTERS)),
    )
    def setup(self, blocks: list[int], policy: str) -> None:
        self.engines = [
            make_engine(num_gpu_blocks=b, block_size=BS, max_num_seqs=3, seed=i)
            for i, b in enumerate(blocks)
        ]
        self.router = make_router(policy, len(blocks))
        self.views = [view_of(i, e) for i, e in enumerate(self.engines)]
        self.live: list[set[str]] = [set() for _ in blocks]  # placed, not yet reported ended
        self.ended: list[list[str]] = [[] for _ in blocks]  # ended since the last report
        self.count = 0

    @rule(chunks=st.lists(st.integers(0, 2), max_size=3), tail=st.integers(0, 5))
    def arrive(self, chunks: list[int], tail: int) -> None:
        prompt = [100 * (c + 1) + j for c in chunks for j in range(BS)]
        prompt += [10_000 + 10 * self.count + j for j in range(tail)] or [1]
        rid = f"r{self.count}"
        self.count += 1
        req = make_request(rid, prompt, max_tokens=3)
        i = self.router.route(req, self.views)
        self.live[i].add(rid)
        if self.engines[i].add_request(req) is not None:
            note("a request the engine rejected, reported ended")
            self.ended[i].append(rid)

    @rule(pick=st.integers(0, 2))
    def step(self, pick: int) -> None:
        i = pick % len(self.engines)
        engine = self.engines[i]
        if engine.has_unfinished():
            for req in engine.step():
                if req.is_finished and req.request_id not in self.ended[i]:
                    self.ended[i].append(req.request_id)
        finished = tuple(self.ended[i])
        report = report_of(i, engine, finished)
        assert report.index == i and report.finished == finished, report
        take_report(self.router, self.views, report)
        self.live[i] -= set(finished)
        self.ended[i] = []
        if finished:
            note("a report with ended requests")
        view = self.views[i]
        assert _same_load(report.load, _load(engine)), (report.load, _load(engine))
        assert view.load == report.load
        cached = set(engine.scheduler.kv.pool._cached)
        assert view.cached == cached, (i, sorted(view.cached ^ cached))

    @rule(pick=st.integers(0, 2))
    def fresh_view(self, pick: int) -> None:
        """A view made now: the engine's index, geometry, admission limit and load now."""
        i = pick % len(self.engines)
        engine = self.engines[i]
        view = view_of(i, engine)
        assert (view.index, view.block_size) == (i, BS)
        assert view.max_prompt_tokens == engine.scheduler.max_prompt_tokens
        assert _same_load(view.load, _load(engine)), (view.load, _load(engine))
        if view.load != InstanceLoad():
            note("a view of a busy engine")

    @invariant()
    def outstanding_is_the_log(self) -> None:
        if hasattr(self, "router"):
            assert self.router.outstanding == [len(s) for s in self.live]


ReportMachine.TestCase.settings = settings(
    scaled(0.1, floor=30), stateful_step_count=30, deadline=None
)
test_reports_carry_the_engines_state = ReportMachine.TestCase
