"""Confidence-scheduled variable-length drafts (DEEPINFER_ENABLE_MTP_VARLEN=1).

Pure Python, so the scheduler runs it under both executors. Each request's drafts
come with confidences q_1..q_L (the drafter's probability of each draft); draft j is
accepted, all drafts before it too, with probability about c_j = q_1 * ... * q_j.

A step of n tokens costs about S + n token-times (S: the step's fixed cost, weights
read and launches, in tokens: below S a step is memory-bound and one more token is
nearly free) and yields E tokens in expectation (one per request, plus each draft's
c_j). Drafts are added in decreasing c_j (a request's c_j only fall, so its drafts stay
a prefix) while one raises E / (S + n), i.e. while c_j > E / (S + n): at batch 1
almost every draft pays; as the batch grows the verify budget shrinks and
speculation fades out instead of slowing the engine.
"""

from __future__ import annotations

import heapq
from collections.abc import Mapping, Sequence

# Fixed cost of a step in token-times: roughly the batch at which a decode step of a
# DeepSeek-style MoE turns compute-bound on an H100/H200 class GPU.
STEP_FIXED_COST_TOKENS = 256.0


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
    lengths = {rid: 0 for rid in confidences}
    expected = float(len(confidences))  # tokens the step yields: one per request so far
    tokens = float(len(confidences) + num_other_tokens)
    heap: list[tuple[float, str, int]] = []  # (-c_j, req_id, j), j 1-based
    for rid, conf in confidences.items():
        if conf and max_len > 0:
            heap.append((-float(conf[0]), rid, 1))
    heapq.heapify(heap)
    while heap:
        neg_c, rid, j = heapq.heappop(heap)
        c = -neg_c
        if c * (fixed_cost_tokens + tokens) <= expected:  # c <= E / (S + n): no longer pays
            break
        lengths[rid] = j
        expected += c
        tokens += 1
        conf = confidences[rid]
        if j < min(max_len, len(conf)):
            heapq.heappush(heap, (-(c * float(conf[j])), rid, j + 1))
    return lengths
