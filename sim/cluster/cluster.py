"""The simulated cluster: instances in one simpy environment, routers between them.

Arrivals are routed over the entry instances (colocated, or prefill) by the cluster's
router. Disaggregated, a request's handover begins when its prefill instance first
schedules it: the decode router picks a decode instance, which queues the request as
awaiting its KV (`Request.awaiting_kv`) and reserves its blocks as it would start it (in
queue order, when they are free); the prompt's KV crosses the link once it is both
computed and has blocks to land in (layer by layer: each layer once computed), and the
request is scheduled there once it has arrived (a decode engine counts the prompt as
computed). The prefill instance finishes the request at its first token. Decisions are
made in time order by whichever instance's loop first reaches their time, each reading
the reports true by then (`PoolRouting`).
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
    """A request on its way from its prefill instance to a decode instance."""

    req_id: str
    prefill_started: float  # its first step on the prefill instance: the decode router's turn
    prefill_instance: str
    decode_instance: str = ""
    reserved: float = math.nan  # the decode instance reserved its blocks
    ready: float = math.nan  # the prefill's last step applied (its first token)
    kv_bytes: float = 0.0
    kv_arrived: float = math.nan
    cancelled: bool = False  # the prefill ended it without a first token
    decode_ended: bool = False  # it ended on the decode instance (counted there)


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
        self.decode_of: dict[str, Instance] = {}  # a routed handover's decode instance
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
        """The decode router's choice: the request waits there for its KV."""
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
        req.awaiting_kv = True
        assert self.decode_routing is not None
        target = self.decode[self.decode_routing.decide(req, at)]
        ho.decode_instance = target.name
        # The executor's handover (DisaggregatedEngine): the prompt's KV but its last
        # token's, which the decode engine computes to sample the second token.
        ho.kv_bytes = float(self.kv_bytes_per_token * (orig.num_prompt_tokens - 1))
        self.decode_of[ho.req_id] = target
        target.deliver(at, req)

    def kv_reserved(self, req_id: str, at: float) -> None:
        """The decode instance reserved the request's blocks at `at`."""
        ho = self.handovers[req_id]
        ho.reserved = at
        if not math.isnan(ho.ready):
            self._send(ho)

    def _send(self, ho: Handover) -> None:
        """Both ends known (the prefill's end, the decode's reservation): the KV's arrival."""
        ho.kv_arrived = self._kv_arrival(ho)
        self.decode_of[ho.req_id].kv_due(ho.kv_arrived, ho.req_id)

    def _kv_arrival(self, ho: Handover) -> float:
        """When the prompt's KV is whole on the decode instance: the link's latency plus
        the bytes at its bandwidth after the prefill's last step, or after the decode
        instance reserved the blocks if that came later. Layer by layer (`layerwise`), a
        layer goes once computed and the blocks are reserved: only the last layer's share
        is left after the later of the two, and the rest went from the later of the
        prefill's start and the reservation (no sooner than the link allows)."""
        link = self.link
        wire = ho.kv_bytes / link.bandwidth
        end = max(ho.ready, ho.reserved)
        if not self.spec.layerwise:
            return end + link.latency_s + wire
        tail = end + link.latency_s + wire / self.num_layers
        return max(tail, max(ho.prefill_started, ho.reserved) + link.latency_s + wire)

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

    def started(self, inst: Instance, started: list[tuple[str, float]]) -> None:
        """Requests `inst` (a prefill instance) scheduled for the first time, each with
        when: the decode router's turn comes."""
        handovers = self.handovers
        for req_id, at in started:
            ho = handovers[req_id] = Handover(req_id, at, inst.name)
            # (`at` is never before decisions already made: a safeguard)
            heapq.heappush(self.pending, (max(at, self.decided_until), len(handovers), ho))
        if started:
            for d in self.decode:
                d.nudge()

    def ended(self, inst: Instance, records: list[RequestRecord]) -> None:
        """Requests ended on `inst`: a prefill's finished ones send their KV once their
        decode instance reserved its blocks; one it ended otherwise after its decode
        router's turn is withdrawn there."""
        final = len(records)
        if inst.role == "prefill":
            final = 0
            for rec in records:
                ho = self.handovers.get(rec.req_id)
                if rec.status != "finished" or ho is None:
                    if ho is None or not ho.decode_ended:  # (else it ended there)
                        final += 1
                    if ho is not None and not ho.decode_ended:
                        self._cancel(ho)
                    continue
                assert rec.finish is not None
                ho.ready = rec.finish
                if not math.isnan(ho.reserved):
                    self._send(ho)
        elif inst.role == "decode":
            for rec in records:
                ho = self.handovers[rec.req_id]
                if ho.cancelled:  # counted where it ended first
                    final -= 1
                else:
                    ho.decode_ended = True
        if final and self.on_final is not None:
            self.on_final(final)

    def _cancel(self, ho: Handover) -> None:
        """The prefill ended the request for good: its decode instance lets it go."""
        if ho.cancelled:
            return
        ho.cancelled = True
        target = self.decode_of.get(ho.req_id)
        if target is None:  # the decode router's turn has not come: it never will
            self.pending = [p for p in self.pending if p[2] is not ho]
            heapq.heapify(self.pending)
        else:
            target.withdraw(ho.req_id)

    def entry_loop_ended(self, inst: Instance) -> None:
        inst.done = True
        self.entry_running -= 1
        if not self.entry_running:
            for d in self.decode:
                d.nudge()
