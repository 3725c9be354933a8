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

With speculation each pass of a rank's MTP drafter is one more MoE layer (the MTP
layer's experts are sharded like the others), and the ranks run the same number of
passes a round: the most any rank drafts (docs/design.md, data parallelism). A rank's
step, as its cost model priced it, holds its verify step and its own passes
(`draft_pass_rows`: pass 1 over the step's tokens, then one row per sampling request
in each chained pass); the round adds, for every pass, the all-to-all of that pass's
rows, and with the analytic model each rank's experts re-priced for the pass's pairs
they received, so a rank padding a pass it does not draft still serves its experts.
The ranks' passes are summed, then the slowest rank taken: the barrier of each pass
is not priced apart, as the model's layers are not.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np

from deepinfer.model_config import ModelConfig
from deepinfer.outputs import SchedulerOutput
from sim.analytic_cost_model import AnalyticCostModel
from sim.hardware import HardwareSpec


def draft_pass_rows(out: SchedulerOutput, num_speculative_tokens: int) -> list[int]:
    """Rows of each MTP pass the drafter runs after `out` (executors/mtp_drafter.py's
    rule, `mtp_passes`): none without speculation or tokens; pass 1 over the step's
    tokens; then, when requests sample and drafts are asked for (the step's
    num_proposals under variable-length drafts, else num_speculative_tokens), k - 1
    chained passes of one row per sampling request. The lookahead slots the scheduler
    holds let every chain run to k (a chain cut at max_model_len is not modelled)."""
    tokens = out.num_batched_tokens
    if not num_speculative_tokens or not tokens:
        return []
    k = num_speculative_tokens if out.num_proposals is None else out.num_proposals
    sampling = sum(1 for sr in out.scheduled if sr.will_sample)
    if k <= 0 or not sampling:
        return [tokens]
    return [tokens] + [sampling] * (min(k, num_speculative_tokens) - 1)


@dataclass
class RoundCost:
    seconds: float  # the round: slowest rank + all-to-all
    rank_seconds: list[float]  # each rank's own step (host + device, experts re-priced)
    all_to_all_seconds: float
    pairs_received: list[int] = field(default_factory=list)  # per rank, the model's layers
    draft_passes: int = 0  # MTP passes every rank ran (or padded) this round


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

    def round(
        self,
        tokens: list[int],
        step_seconds: list[float],
        draft_rows: Sequence[Sequence[int]] = (),
    ) -> RoundCost:
        """tokens: each rank's tokens this round; step_seconds: each rank's step as the
        one-GPU cost model priced it (host + device, its own MTP passes included; 0 for
        an idle rank); draft_rows: each rank's rows per MTP pass (`draft_pass_rows`;
        empty: the ranks do not draft)."""
        if not self.expert_parallel:
            return RoundCost(max(step_seconds), list(step_seconds), 0.0)
        rank_s = list(step_seconds)
        received, a2a = self._exchange(tokens, rank_s, self.num_moe_layers)
        passes = max((len(rows) for rows in draft_rows), default=0)
        for j in range(passes):
            rows_j = [rows[j] if j < len(rows) else 0 for rows in draft_rows]
            a2a += self._exchange(rows_j, rank_s, 1)[1]
        return RoundCost(max(rank_s) + a2a, rank_s, a2a, received, passes)

    def _exchange(
        self, tokens: list[int], rank_s: list[float], layers: int
    ) -> tuple[list[int], float]:
        """`layers` MoE layers over each rank's `tokens`: the pairs each rank's experts
        received (routing drawn once for them all) and the layers' all-to-all seconds;
        with the analytic model each rank's routed-expert time in `rank_s` moves from
        its own tokens over all E experts to the pairs its E/N experts received."""
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
        if self.analytic is not None:
            share = layers / self.num_moe_layers  # (routed_expert_seconds: every MoE layer)
            for s in range(n):
                own = self.analytic.routed_expert_seconds(tokens[s] * self.top_k, self.num_experts)
                held = self.analytic.routed_expert_seconds(int(received[s]), per_rank)
                rank_s[s] += (held - own) * share
        return [int(x) for x in received], layers * per_layer
