"""The router interface: which instance of a pool a request goes to.

One interface for the simulator's cluster and the real data-parallel front-end
(docs/design.md, "Clusters"): a router sees each instance only through an
`InstanceView` (its last report), and keeps its own bookkeeping from `on_placed`,
`on_report` and `on_finished`. Ties always go to the lowest index, and anything random
is drawn from the router's own seeded generator, so a simulated run and a served one
place the same requests alike.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence

from deepinfer.request import Request
from deepinfer.routing.instance_view import InstanceLoad, InstanceView


class Router(ABC):
    """Chooses an instance per request. `route` is the entry point: it keeps a request
    off instances that would reject it (a prompt longer than they admit) whenever some
    instance fits it, and books the placement."""

    name: str = ""
    # Whether `choose` reads what changes within a decode run (the reported KV usage, the
    # cached prefixes, which a run's new blocks evict): a simulated instance then ends its
    # runs at this router's next decision.
    reads_run_state: bool = False

    def __init__(self, num_instances: int) -> None:
        if num_instances < 1:
            raise ValueError(f"num_instances={num_instances}: a router needs >= 1 instance")
        self.outstanding = [0] * num_instances  # placed and not finished, per instance

    @property
    def num_instances(self) -> int:
        return len(self.outstanding)

    def route(self, request: Request, views: Sequence[InstanceView]) -> int:
        """The index of the instance `request` goes to (booked as placed there)."""
        if len(views) != self.num_instances:
            raise ValueError(f"{len(views)} views for a router of {self.num_instances} instances")
        eligible = [v for v in views if v.fits(request)] or list(views)
        index = self.choose(request, eligible)
        if not any(v.index == index for v in eligible):
            raise RuntimeError(f"router {self.name!r} chose {index}, not an eligible instance")
        self.on_placed(request, index)
        return index

    @abstractmethod
    def choose(self, request: Request, instances: Sequence[InstanceView]) -> int:
        """The `index` of one of `instances` (never empty, in index order)."""

    def on_placed(self, request: Request, index: int) -> None:
        self.outstanding[index] += 1

    def on_report(self, index: int, load: InstanceLoad) -> None:  # noqa: B027 (optional hook)
        """The instance's load after a step (its view holds it too); by default the
        router reads loads from the views alone."""

    def on_finished(self, request_id: str, index: int) -> None:
        """A request placed on `index` ended there (finished, aborted or rejected)."""
        self.outstanding[index] -= 1
        if self.outstanding[index] < 0:
            raise RuntimeError(f"instance {index}: more requests finished than placed")
