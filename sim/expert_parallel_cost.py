"""The price of one lock-step round of data-parallel (and expert-parallel) ranks.

Every rank runs its own step; a round ends when the slowest rank is done, so a rank
with a heavier batch makes the others wait (a straggler). With expert parallelism each
MoE layer also exchanges tokens: a rank sends every (token, expert) pair whose expert
lives on another rank and gets the weighted output back, so per MoE layer

    all_to_all = 4 x latency + max over ranks of (pairs out, pairs in) x hidden x bytes / link

for the dispatch and again for the combine (executors/distributed/expert_parallel.py
makes four all_to_all_single calls a layer: counts, rows, routing, outputs). Which
expert a pair goes to is drawn each round (uniform routing, seeded): the rank whose
experts drew the most pairs computes longest, which is where routing imbalance
stragglers come from. With the analytic model at hand a rank's routed-expert time is
moved from "its own tokens over all E experts" (what the one-GPU cost model priced) to
"the pairs its E/N experts received"; a cost model without hardware (unit) keeps its
own price.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from deepinfer.model_config import ModelConfig
from sim.analytic_cost_model import AnalyticCostModel
from sim.hardware import HardwareSpec


@dataclass
class RoundCost:
    seconds: float  # the round: slowest rank + all-to-all
    rank_seconds: list[float]  # each rank's own step (host + device, experts re-priced)
    all_to_all_seconds: float
    pairs_received: list[int] = field(default_factory=list)  # per rank (expert parallel)


class ExpertParallelCost:
    def __init__(
        self,
        model: ModelConfig,
        hardware: HardwareSpec,
        num_ranks: int,
        *,
        expert_parallel: bool,
        analytic: AnalyticCostModel | None,
        seed: int = 0,
        activation_bytes: int = 2,
    ) -> None:
        self.num_ranks = num_ranks
        self.expert_parallel = expert_parallel
        self.analytic = analytic
        self.top_k = model.num_experts_per_tok
        self.num_experts = model.n_routed_experts
        self.num_moe_layers = model.num_moe_layers
        self.row_bytes = model.hidden_size * activation_bytes
        if expert_parallel:
            if not self.num_experts:
                raise ValueError(f"enable_expert_parallel: {model.name} has no routed experts")
            if self.num_experts % num_ranks:
                raise ValueError(
                    f"data_parallel_size={num_ranks} with enable_expert_parallel: the model's "
                    f"{self.num_experts} routed experts do not split evenly over {num_ranks} ranks"
                )
            if hardware.nvlink_bandwidth is None:
                raise ValueError(
                    f"hardware {hardware.name!r} lists no nvlink_bandwidth in sim/data/"
                    "hardware.json: the all-to-all of expert parallelism cannot be priced"
                )
        self.link_bandwidth = hardware.nvlink_bandwidth or 0.0
        self.latency = hardware.all_to_all_latency_s
        self._rng = np.random.default_rng(seed)

    def round(self, tokens: list[int], step_seconds: list[float]) -> RoundCost:
        """tokens: each rank's tokens this round; step_seconds: each rank's step as the
        one-GPU cost model priced it (host + device; 0 for an idle rank)."""
        if not self.expert_parallel:
            return RoundCost(max(step_seconds), list(step_seconds), 0.0)
        n, per_rank = self.num_ranks, self.num_experts // self.num_ranks
        # pairs[r, s]: pairs of rank r's tokens routed to experts held by rank s.
        pairs = np.zeros((n, n), dtype=np.int64)
        for r, t in enumerate(tokens):
            if t:
                by_expert = self._rng.multinomial(
                    t * self.top_k, [1.0 / self.num_experts] * self.num_experts
                )
                pairs[r] = by_expert.reshape(n, per_rank).sum(axis=1)
        received = pairs.sum(axis=0)
        off = pairs - np.diag(np.diag(pairs))  # pairs that cross a link
        busiest = float(max(off.sum(axis=1).max(), off.sum(axis=0).max()))
        per_layer = 2 * (2 * self.latency + busiest * self.row_bytes / self.link_bandwidth)
        a2a = self.num_moe_layers * per_layer
        rank_s = list(step_seconds)
        if self.analytic is not None:
            for s in range(n):
                own = self.analytic.routed_expert_seconds(tokens[s] * self.top_k, self.num_experts)
                held = self.analytic.routed_expert_seconds(int(received[s]), per_rank)
                rank_s[s] += held - own
        return RoundCost(max(rank_s) + a2a, rank_s, a2a, [int(x) for x in received])
