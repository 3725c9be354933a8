"""One instance of a simulated cluster: an EngineCore, its clock, and what the
cluster's routers have sent it (the `Arrivals` its engine loop reads)."""

from __future__ import annotations

import heapq
import math
from typing import Protocol

import simpy

from deepinfer.engine import EngineCore
from deepinfer.records import RequestRecord
from deepinfer.request import Request
from deepinfer.routing import InstanceView
from deepinfer.routing.instance_report import InstanceReport, report_of, view_of
from sim.cluster.pool_routing import PoolRouting
from sim.data_parallel import RankGroup
from sim.engine_loop import Clock

# What an instance serves with: one engine, or data-parallel ranks in lock-step.
Served = EngineCore | RankGroup


def instance_view(index: int, core: Served) -> InstanceView:
    return core.view(index) if isinstance(core, RankGroup) else view_of(index, core)


def _report(index: int, core: Served, ended: list[str]) -> InstanceReport:
    return (
        core.report(index, ended) if isinstance(core, RankGroup) else report_of(index, core, ended)
    )


class ClusterSide(Protocol):
    """What an instance asks of its cluster (sim/cluster/cluster.py's `Cluster`)."""

    env: simpy.Environment
    decided_until: float  # every routing decision up to this time is made

    def route_until(self, now: float) -> None: ...

    def more_may_come(self, inst: Instance) -> bool: ...

    def next_decision(self, inst: Instance) -> float: ...

    def soonest(self, inst: Instance) -> float: ...

    def horizon(self, inst: Instance) -> float: ...

    def ended(self, inst: Instance, records: list[RequestRecord]) -> None: ...


class Instance:
    """Requests reach the engine from its inbox once they are due (an arrival at its
    arrival time, a handed-over request once its KV has arrived). After every step the
    instance reports to its router, and a prefill instance hands its finished requests
    over to the cluster."""

    def __init__(
        self,
        cluster: ClusterSide,
        name: str,
        role: str,
        index: int,
        core: Served,
        clock: Clock,
        routing: PoolRouting,
    ) -> None:
        self.cluster = cluster
        self.name = name
        self.role = role
        self.index = index  # within its router's instances
        self.core = core
        self.clock = clock
        self.routing = routing
        self.inbox: list[tuple[float, int, Request]] = []  # (due, order, request), a heap
        self.num_reported = 0  # records the router has heard of
        self.placed = 0
        self.done = False  # its engine loop has ended
        self._wake: simpy.Event | None = None

    # ---- Arrivals, for the engine loop -------------------------------------------------

    def admit(self, now: float) -> None:
        self.cluster.route_until(now)
        inbox = self.inbox
        rejected = False
        while inbox and inbox[0][0] <= now:
            req = heapq.heappop(inbox)[2]
            rejected |= self.core.add_request(req) is not None
        if rejected:  # it ended here at once: the router hears of it now
            self.report(now)

    def more_may_come(self) -> bool:
        return bool(self.inbox) or self.cluster.more_may_come(self)

    def next_time(self) -> float:
        due = self.inbox[0][0] if self.inbox else math.inf
        return min(due, self.cluster.next_decision(self))

    def soonest(self) -> float:
        due = self.inbox[0][0] if self.inbox else math.inf
        return min(due, self.cluster.soonest(self))

    def horizon(self) -> float:
        return self.cluster.horizon(self)

    def wake(self) -> simpy.Event:
        if self._wake is None or self._wake.triggered:
            self._wake = self.cluster.env.event()
        return self._wake

    def stepped(self, now: float) -> None:
        self.report(now)

    # ---- the cluster's side ------------------------------------------------------------

    def deliver(self, due: float, req: Request) -> None:
        self.placed += 1
        heapq.heappush(self.inbox, (due, self.placed, req))
        self.nudge()

    def nudge(self) -> None:
        """Wake the engine loop if it waits idle: what it waits for has changed."""
        if self._wake is not None and not self._wake.triggered:
            self._wake.succeed()

    def report(self, now: float) -> None:
        records = self.core.records[self.num_reported :]
        self.num_reported = len(self.core.records)
        ended = [r.req_id for r in records]
        report = _report(self.index, self.core, ended)
        self.routing.post(report, now, self.cluster.decided_until)
        if records:
            self.cluster.ended(self, records)
