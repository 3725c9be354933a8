"""A router over one set of instances, deciding as of each decision's own time.

A simulated instance runs ahead of the simpy clock by up to one step (its loop prices a
step and applies it before the clock reaches the step's end), so it posts its report
with the time the report becomes true. A decision at time t applies the reports true
by t first: the router sees every instance as the real front-end would at t, whichever
simpy process happens to make the decision.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence

from deepinfer.request import Request
from deepinfer.routing import InstanceView, Router
from deepinfer.routing.instance_report import InstanceReport, take_report


class PoolRouting:
    __slots__ = ("router", "views", "queued")

    def __init__(self, router: Router, views: Sequence[InstanceView]) -> None:
        self.router = router
        self.views = list(views)
        self.queued: list[deque[tuple[float, InstanceReport]]] = [deque() for _ in views]

    def post(self, report: InstanceReport, true_from: float, decided_until: float) -> None:
        """An instance's report, true from `true_from`. Every decision up to
        `decided_until` has been made, so what is true by then is taken in at once."""
        queue = self.queued[report.index]
        queue.append((true_from, report))
        self._take(queue, decided_until)

    def decide(self, request: Request, at: float) -> int:
        """The index of the instance `request` goes to, decided at time `at`."""
        for queue in self.queued:
            if queue:
                self._take(queue, at)
        return self.router.route(request, self.views)

    def _take(self, queue: deque[tuple[float, InstanceReport]], until: float) -> None:
        while queue and queue[0][0] <= until:
            take_report(self.router, self.views, queue.popleft()[1])
