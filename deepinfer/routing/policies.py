"""The routing policies, registered by name (`make_router`).

Each is a `Router`; "least-load" is the data-parallel front-end's default. Loads come
from the instances' reports; `outstanding` (placed, not finished) is the router's own.
"""

from __future__ import annotations

import random
from collections.abc import Callable, Sequence
from typing import Any

from deepinfer.request import Request
from deepinfer.routing.instance_view import InstanceLoad, InstanceView
from deepinfer.routing.router import Router


class RoundRobinRouter(Router):
    """Each instance in turn (skipping those the request does not fit)."""

    name = "round-robin"

    def __init__(self, num_instances: int) -> None:
        super().__init__(num_instances)
        self.next = 0

    def choose(self, request: Request, instances: Sequence[InstanceView]) -> int:
        after = [v.index for v in instances if v.index >= self.next]
        index = after[0] if after else instances[0].index
        self.next = (index + 1) % self.num_instances
        return index


class LeastRequestsRouter(Router):
    """The fewest outstanding requests (placed there and not finished)."""

    name = "least-requests"

    def choose(self, request: Request, instances: Sequence[InstanceView]) -> int:
        out = self.outstanding
        return min(instances, key=lambda v: (out[v.index], v.index)).index


class LeastKVRouter(Router):
    """The lowest reported KV usage, then the fewest outstanding requests."""

    name = "least-kv"
    reads_run_state = True

    def choose(self, request: Request, instances: Sequence[InstanceView]) -> int:
        out = self.outstanding
        return min(instances, key=lambda v: (v.load.kv_usage, out[v.index], v.index)).index


class PowerOfTwoRouter(Router):
    """Two instances drawn at random (seeded), the one with fewer outstanding requests."""

    name = "power-of-two"

    def __init__(self, num_instances: int, seed: int = 0) -> None:
        super().__init__(num_instances)
        self.rng = random.Random(seed)

    def choose(self, request: Request, instances: Sequence[InstanceView]) -> int:
        if len(instances) == 1:
            return instances[0].index
        a, b = self.rng.sample(range(len(instances)), 2)
        out = self.outstanding
        pair = (instances[a], instances[b])
        return min(pair, key=lambda v: (out[v.index], v.index)).index


class PrefixAffinityRouter(Router):
    """Where the longest prefix of the prompt is cached (then the fewest outstanding
    requests), unless that instance has more than `max_imbalance` outstanding requests
    beyond the least loaded one: then the least loaded. With nothing cached anywhere it
    is least-requests."""

    name = "prefix-affinity"
    reads_run_state = True

    def __init__(self, num_instances: int, max_imbalance: int = 8) -> None:
        super().__init__(num_instances)
        if not isinstance(max_imbalance, int) or isinstance(max_imbalance, bool):
            raise ValueError(f"max_imbalance={max_imbalance!r}: expected an integer")
        if max_imbalance < 0:
            raise ValueError(f"max_imbalance={max_imbalance}: must be >= 0")
        self.max_imbalance = max_imbalance

    def choose(self, request: Request, instances: Sequence[InstanceView]) -> int:
        out = self.outstanding
        least = min(instances, key=lambda v: (out[v.index], v.index))
        hits = [(v.cached_prefix_blocks(request), v) for v in instances]
        best_hit, best = min(hits, key=lambda h: (-h[0], out[h[1].index], h[1].index))
        if best_hit == 0 or out[best.index] > out[least.index] + self.max_imbalance:
            return least.index
        return best.index


class LeastLoadRouter(Router):
    """The shortest queue (reported waiting plus placed since that report), then the
    lowest KV usage, then the fewest running: a burst of arrivals spreads over the
    instances instead of all landing on the one that looked idlest when it began."""

    name = "least-load"
    reads_run_state = True

    def __init__(self, num_instances: int) -> None:
        super().__init__(num_instances)
        self.loads = [InstanceLoad() for _ in range(num_instances)]
        self.placed = [0] * num_instances  # placed on each instance since its last report

    def on_placed(self, request: Request, index: int) -> None:
        super().on_placed(request, index)
        self.placed[index] += 1

    def on_report(self, index: int, load: InstanceLoad) -> None:
        self.loads[index] = load
        self.placed[index] = 0

    def key(self, index: int) -> tuple[int, float, int, int]:
        load = self.loads[index]
        return (load.num_waiting + self.placed[index], load.kv_usage, load.num_running, index)

    def choose(self, request: Request, instances: Sequence[InstanceView]) -> int:
        return min((v.index for v in instances), key=self.key)


ROUTERS: dict[str, Callable[..., Router]] = {
    r.name: r
    for r in (
        RoundRobinRouter,
        LeastRequestsRouter,
        LeastKVRouter,
        PowerOfTwoRouter,
        PrefixAffinityRouter,
        LeastLoadRouter,
    )
}
# The options a user may set per policy, beyond the instance count.
ROUTER_OPTIONS: dict[str, tuple[str, ...]] = {"prefix-affinity": ("max_imbalance",)}
SEEDED = ("power-of-two",)  # the policies that draw at random, from the run's seed


def make_router(name: str, num_instances: int, *, seed: int = 0, **options: Any) -> Router:
    """The policy `name` over `num_instances`; an unknown name or option is refused by name."""
    if name not in ROUTERS:
        raise ValueError(f"router {name!r}: expected one of {', '.join(ROUTERS)}")
    allowed = ROUTER_OPTIONS.get(name, ())
    for key in options:
        if key not in allowed:
            takes = f"takes {', '.join(allowed)}" if allowed else "takes no options"
            raise ValueError(f"router {name!r}: unknown option {key!r} ({name} {takes})")
    if name in SEEDED:
        options["seed"] = seed
    return ROUTERS[name](num_instances, **options)
