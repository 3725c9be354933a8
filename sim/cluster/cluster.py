"""The simulated cluster: instances in one simpy environment, routers between them.

Arrivals are routed over the entry instances (colocated, or prefill) by the cluster's
router; a prefill instance finishes a request at its first token, and the cluster
hands it over: the decode router picks a decode instance, the prompt's KV crosses the
link, and the request joins that instance's queue once its KV has arrived (a decode
engine counts the prompt as computed). Decisions are made in time order by whichever
instance's loop first reaches their time, each reading the reports true by then
(`PoolRouting`).
"""

from __future__ import annotations

import heapq
import math
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

import simpy

from deepinfer.records import RequestRecord
from deepinfer.request import Request
from deepinfer.sampling_params import SamplingParams
from sim.cluster.description import ClusterSpec, Link
from sim.cluster.instance import Instance
from sim.cluster.pool_routing import PoolRouting


@dataclass
class Handover:
    """A prefill instance's finished request on its way to a decode instance."""

    req_id: str
    ready: float  # the prefill's last step applied (its first token)
    prefill_started: float  # its first step on the prefill instance
    prefill_instance: str
    decode_instance: str = ""
    kv_bytes: float = 0.0
    kv_arrived: float = math.nan


class Cluster:
    """The routing state shared by every instance of one simulated cluster."""

    def __init__(
        self,
        env: simpy.Environment,
        spec: ClusterSpec,
        requests: list[Request],
        kv_bytes_per_token: int,
        num_layers: int,
        on_final: Callable[[int], None] | None = None,
    ) -> None:
        self.env = env
        self.spec = spec
        self.arrivals = deque(requests)
        self.by_id = {r.request_id: r for r in requests}
        self.entry: list[Instance] = []
        self.decode: list[Instance] = []
        self.entry_routing: PoolRouting | None = None
        self.decode_routing: PoolRouting | None = None
        self.pending: list[tuple[float, int, Handover]] = []  # handovers to route, a heap
        self.handovers: dict[str, Handover] = {}
        self.decided_until = -math.inf
        self.link: Link = spec.kv_transfer_link()
        self.kv_bytes_per_token = kv_bytes_per_token
        self.num_layers = num_layers
        self.entry_running = 0  # entry instances whose loops have not ended
        self.on_final = on_final

    # ---- decisions -----------------------------------------------------------------

    def route_until(self, now: float) -> None:
        """Make every decision due by `now`, in time order."""
        if now > self.decided_until:
            self.decided_until = now
        arrivals, pending = self.arrivals, self.pending
        while True:
            a = arrivals[0].arrival_time if arrivals else math.inf
            h = pending[0][0] if pending else math.inf
            if a <= h:
                if a > now:
                    return
                req = arrivals.popleft()
                assert self.entry_routing is not None
                self.entry[self.entry_routing.decide(req, a)].deliver(a, req)
            else:
                if h > now:
                    return
                self._hand_over(heapq.heappop(pending)[2], h)

    def _hand_over(self, ho: Handover, at: float) -> None:
        """The decode router's choice, and the KV's transfer to it."""
        orig = self.by_id[ho.req_id]
        req = Request(
            ho.req_id,
            orig.prompt,
            SamplingParams(
                temperature=0.0, max_tokens=orig.sampling_params.max_tokens, ignore_eos=True
            ),
            at,
            priority=orig.priority,
        )
        assert self.decode_routing is not None
        target = self.decode[self.decode_routing.decide(req, at)]
        ho.decode_instance = target.name
        ho.kv_bytes = float(self.kv_bytes_per_token * orig.num_prompt_tokens)
        ho.kv_arrived = self._kv_arrival(ho)
        target.deliver(ho.kv_arrived, req)

    def _kv_arrival(self, ho: Handover) -> float:
        """When the prompt's KV is whole on the decode instance: after the last step of
        the prefill plus the link's latency and the bytes at its bandwidth; layer by layer
        (`layerwise`), only the last layer's share is left after that step, and the rest
        went while the prefill ran (no sooner than the link allows from its start)."""
        link = self.link
        wire = ho.kv_bytes / link.bandwidth
        if not self.spec.layerwise:
            return ho.ready + link.latency_s + wire
        tail = ho.ready + link.latency_s + wire / self.num_layers
        return max(tail, ho.prefill_started + link.latency_s + wire)

    # ---- what the instances' loops ask -------------------------------------------------

    def more_may_come(self, inst: Instance) -> bool:
        if inst.role != "decode":
            return bool(self.arrivals)
        return bool(self.arrivals or self.pending or self.entry_running)

    def next_decision(self, inst: Instance) -> float:
        """When an idle instance must next look: entry instances route arrivals, decode
        instances hand requests over."""
        if inst.role != "decode":
            return self.arrivals[0].arrival_time if self.arrivals else math.inf
        return self.pending[0][0] if self.pending else math.inf

    def soonest(self, inst: Instance) -> float:
        """The earliest a request not yet in `inst`'s inbox may reach it: the next
        arrival; for a decode instance the next handover, or one not made yet, which is
        no sooner than the end of some prefill instance's current step."""
        if inst.role != "decode":
            return self.arrivals[0].arrival_time if self.arrivals else math.inf
        unknown = min((e.clock.now for e in self.entry if not e.done), default=math.inf)
        return min(self.pending[0][0] if self.pending else math.inf, unknown)

    def horizon(self, inst: Instance) -> float:
        """A decode run of `inst` ends before its router's next decision when the router
        reads what changes within a run (the KV usage it reports, its cached prefixes,
        which the run's new blocks evict); the next handover
        may be one not yet known, no sooner than the end of any prefill instance's
        current step."""
        if not inst.routing.router.reads_run_state:
            return math.inf
        return self.soonest(inst)

    def ended(self, inst: Instance, records: list[RequestRecord]) -> None:
        """Requests ended on `inst`: a prefill's finished ones go on to a decode instance."""
        final = len(records)
        if inst.role == "prefill":
            final = 0
            for rec in records:
                if rec.status != "finished":
                    final += 1
                    continue
                assert rec.finish is not None and rec.first_scheduled is not None
                ho = Handover(rec.req_id, rec.finish, rec.first_scheduled, inst.name)
                self.handovers[rec.req_id] = ho
                heapq.heappush(self.pending, (rec.finish, len(self.handovers), ho))
            for d in self.decode:
                d.nudge()
        if final and self.on_final is not None:
            self.on_final(final)

    def entry_loop_ended(self, inst: Instance) -> None:
        inst.done = True
        self.entry_running -= 1
        if not self.entry_running:
            for d in self.decode:
                d.nudge()
