"""Which rank a new request goes to: the least loaded by queue length, then KV usage.

Each rank reports its load after every step; requests placed since its last report
count as queued there, so a burst of arrivals spreads over the ranks instead of all
landing on the rank that looked idlest when the burst began. Ties go to the lowest
rank (deterministic, so the simulator and the real engine place requests alike).
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class RankLoad:
    """One rank's load as its scheduler last reported it."""

    num_waiting: int = 0  # queued, not yet started (or preempted)
    num_running: int = 0
    kv_usage: float = 0.0  # fraction of KV blocks held by requests


class LeastLoadBalancer:
    """Places each request on the rank with the shortest queue, then the lowest KV usage,
    then the fewest running requests, then the lowest index."""

    def __init__(self, num_ranks: int) -> None:
        if num_ranks < 1:
            raise ValueError(f"num_ranks={num_ranks}: must be >= 1")
        self.loads = [RankLoad() for _ in range(num_ranks)]
        self.placed = [0] * num_ranks  # requests placed on each rank since its last report

    @property
    def num_ranks(self) -> int:
        return len(self.loads)

    def report(self, rank: int, load: RankLoad) -> None:
        """The rank's load after a step; it now counts every request placed on it."""
        self.loads[rank] = load
        self.placed[rank] = 0

    def key(self, rank: int) -> tuple[int, float, int, int]:
        load = self.loads[rank]
        return (load.num_waiting + self.placed[rank], load.kv_usage, load.num_running, rank)

    def pick(self) -> int:
        """The rank for the next request (counted as queued there until its report)."""
        rank = min(range(self.num_ranks), key=self.key)
        self.placed[rank] += 1
        return rank
