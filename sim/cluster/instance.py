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

    def started(self, inst: Instance, started: list[tuple[str, float]]) -> None: ...

    def kv_reserved(self, req_id: str, at: float) -> None: ...


class Instance:
    """Requests reach the engine from its inbox once they are due (an arrival at its
    arrival time, a handed-over request at its decode router's turn), and a reserved
    request's KV once it has arrived. After every step the instance reports to its
    router and tells the cluster what the handovers need: a prefill instance the requests
    it started and ended, a decode instance the blocks it reserved."""

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
        self.kv_inbox: list[tuple[float, str]] = []  # (arrival, request id): KV, a heap
        self.withdrawn: set[str] = set()  # in the inbox, to end as soon as admitted
        self.num_reported = 0  # records the router has heard of
        self.placed = 0
        self.done = False  # its engine loop has ended
        if role == "prefill":  # its first schedules begin handovers (Cluster.started)
            core.take_started()
        self._wake: simpy.Event | None = None

    # ---- Arrivals, for the engine loop -------------------------------------------------

    def admit(self, now: float) -> None:
        self.cluster.route_until(now)
        inbox = self.inbox
        rejected = False
        while inbox and inbox[0][0] <= now:
            req = heapq.heappop(inbox)[2]
            rejected |= self.core.add_request(req) is not None
            if req.request_id in self.withdrawn:
                self.withdrawn.discard(req.request_id)
                self.core.abort(req.request_id)
                rejected = True
        kv = self.kv_inbox
        while kv and kv[0][0] <= now:
            self.core.kv_arrived(heapq.heappop(kv)[1])
        if rejected:  # it ended here at once: the router hears of it now
            self.report(now)

    def more_may_come(self) -> bool:
        return bool(self.inbox) or self.cluster.more_may_come(self)

    def _due(self) -> float:
        due = self.inbox[0][0] if self.inbox else math.inf
        return min(due, self.kv_inbox[0][0]) if self.kv_inbox else due

    def next_time(self) -> float:
        return min(self._due(), self.cluster.next_decision(self))

    def soonest(self) -> float:
        return min(self._due(), self.cluster.soonest(self))

    def horizon(self) -> float:
        return self.cluster.horizon(self)

    def wake(self) -> simpy.Event:
        if self._wake is None or self._wake.triggered:
            self._wake = self.cluster.env.event()
        return self._wake

    def scheduled(self) -> None:
        if self.role == "prefill":
            self.cluster.started(self, self.core.take_started())
        elif self.role == "decode":
            for req_id, at in self.core.take_kv_reserved():
                self.cluster.kv_reserved(req_id, at)

    def stepped(self, now: float) -> None:
        self.scheduled()  # (one engine: both come before its step's time passes)
        self.report(now)

    def reads_steps(self) -> bool:
        return True

    # ---- the cluster's side ------------------------------------------------------------

    def deliver(self, due: float, req: Request) -> None:
        self.placed += 1
        heapq.heappush(self.inbox, (due, self.placed, req))
        self.nudge()

    def kv_due(self, due: float, req_id: str) -> None:
        """The KV of `req_id`, whose blocks this instance reserved, arrives at `due`."""
        heapq.heappush(self.kv_inbox, (due, req_id))
        self.nudge()

    def withdraw(self, req_id: str) -> None:
        """A request handed over here ended on its prefill instance without a first
        token: it ends here too, aborted (once admitted, if it is still in the inbox: its
        router counted it here, and hears of its end from this instance's report)."""
        if any(req.request_id == req_id for _, _, req in self.inbox):
            self.withdrawn.add(req_id)
            return
        self.kv_inbox = [kv for kv in self.kv_inbox if kv[1] != req_id]
        heapq.heapify(self.kv_inbox)
        self.core.abort(req_id)
        self.report(self.cluster.env.now)
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
