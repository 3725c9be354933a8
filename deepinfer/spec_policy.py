"""Confidence-scheduled variable-length drafts (DEEPINFER_ENABLE_MTP_VARLEN=1).

Pure Python, so the scheduler runs it under both executors. Each request's drafts
come with confidences q_1..q_L (the drafter's probability of each draft); draft j is
accepted, all drafts before it too, with probability about c_j = q_1 * ... * q_j.

A step of n tokens costs about S + n token-times (S: the step's fixed cost, weights
read and launches, in tokens: below S a step is memory-bound and one more token is
nearly free) and yields E tokens in expectation (one per request, plus each verified
draft's c_j).

The step verifies the same number L of drafts for every request: the real executor
replays a verify graph per query length 1 + L, and only for steps in which every
request scores 1 + L tokens; a ragged step (per-request lengths) runs piecewise, with
attention eager, and measured slower on the H200 than verifying the longer uniform
length in a graph (benchmarks/RESULTS.md, 2026-12-04). L maximises E(L) / (S + n(L))
over 0..max_len, where E(L) sums the c_j of every request's first L drafts: the
confidences of the whole batch set it. At
batch 1 almost every likely draft pays; as the batch grows n(L) grows B times faster
than one request's yield, so the verify budget shrinks and speculation fades out
instead of slowing the engine. A request with fewer than L drafts (its drafter chain
ended at the block table's end) verifies what it has; such a ragged step runs piecewise
on the real executor, and its cost here counts the tokens it verifies.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

# Fixed cost of a step in token-times: roughly the batch at which a decode step of a
# DeepSeek-style MoE turns compute-bound. Fitted on the H200 (Moonlight shapes): 128
# requests took 13.5 ms a step decoding and 29.3 ms verifying 3 drafts each (512 tokens,
# with the drafter), so S + 512 = 2.17 (S + 128), S = 200 (benchmarks/RESULTS.md).
STEP_FIXED_COST_TOKENS = 200.0


def draft_lengths(
    confidences: Mapping[str, Sequence[float]],
    max_len: int,
    fixed_cost_tokens: float = STEP_FIXED_COST_TOKENS,
    num_other_tokens: int = 0,
) -> dict[str, int]:
    """How many of its drafts each request verifies next step (0..max_len).

    confidences: req_id -> its drafts' confidences (empty: no drafts); every listed
    request is one token of the step plus its drafts; num_other_tokens: the step's
    other tokens (prompt chunks).
    """
    expected = float(len(confidences))  # E(0): one token per request
    tokens = float(len(confidences) + num_other_tokens)  # n(0)
    best_len, best_rate = 0, expected / (fixed_cost_tokens + tokens) if confidences else 0.0
    cumulative = {rid: 1.0 for rid in confidences}
    for length in range(1, max_len + 1):
        drafting = [rid for rid, conf in confidences.items() if len(conf) >= length]
        if not drafting:
            break
        for rid in drafting:
            cumulative[rid] *= float(confidences[rid][length - 1])
            expected += cumulative[rid]
        tokens += len(drafting)
        rate = expected / (fixed_cost_tokens + tokens)
        if rate > best_rate:
            best_len, best_rate = length, rate
    return {rid: min(best_len, len(conf)) for rid, conf in confidences.items()}
