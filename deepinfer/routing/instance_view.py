"""What a router sees of one instance: its last reported load and its cached prefixes.

An instance is one EngineCore (a simulated instance of a cluster, or a data-parallel
rank of the real front-end). It reports after every step; the router reads only these
reports, never the engine itself, so the simulator's router and the real front-end's
decide from the same information.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from deepinfer.kv_cache.hashing import update_block_hashes
from deepinfer.request import Request


@dataclass(frozen=True)
class InstanceLoad:
    """One instance's load as its scheduler last reported it."""

    num_waiting: int = 0  # queued, not yet started (or preempted)
    num_running: int = 0
    kv_usage: float = 0.0  # fraction of KV blocks held by requests


@dataclass
class InstanceView:
    """The router's picture of one instance, kept up to date from its reports.

    max_prompt_tokens: the longest prompt the instance can ever admit (its max_model_len
    and KV cache); a longer one would be rejected there. cached: the chain hashes of the
    prefix blocks the instance last reported cached (blocks of `block_size` tokens)."""

    index: int
    block_size: int
    max_prompt_tokens: int
    load: InstanceLoad = field(default_factory=InstanceLoad)
    cached: set[int] = field(default_factory=set)

    def fits(self, request: Request) -> bool:
        return request.num_prompt_tokens <= self.max_prompt_tokens

    def cached_prefix_blocks(self, request: Request) -> int:
        """How many of the request's leading full blocks the instance holds cached."""
        if not self.cached:
            return 0
        n = 0
        for h in update_block_hashes(request, self.block_size):
            if h not in self.cached:
                break
            n += 1
        return n

    def apply_cache_changes(self, changes: Mapping[int, bool]) -> None:
        """A report's changes (`BlockPool.drain_cache_changes`): hash -> cached now."""
        cached = self.cached
        for h, now in changes.items():
            if now:
                cached.add(h)
            else:
                cached.discard(h)


def views_of(block_size: int, max_prompt_tokens: Sequence[int]) -> list[InstanceView]:
    """Fresh views of instances with these admission limits (all idle, nothing cached)."""
    return [InstanceView(i, block_size, m) for i, m in enumerate(max_prompt_tokens)]
