"""Confidence-scheduled variable-length drafts (DEEPINFER_ENABLE_MTP_VARLEN=1).

Pure Python, so the scheduler runs it under both executors. Each request's drafts
come with confidences q_1..q_L (the drafter's probability of each draft); draft j is
accepted, all drafts before it too, with probability about c_j = q_1 * ... * q_j.

A step verifies the same number L of drafts for every request, since the real executor
replays a verify graph per query length 1 + L only for steps in which every request
scores 1 + L tokens; a ragged step runs piecewise with attention eager, which costs more
than verifying the longer uniform length in a graph. L maximises E(L) / cost(L) over
0..max_len, where E(L) sums the c_j of every request's first L drafts (plus one token
per request): the confidences of the whole batch set it. At batch 1 almost every likely
draft pays; as the batch grows the step's tokens n(L) grow B times faster than one
request's yield, so speculation fades out instead of slowing the engine. A request with
fewer than L drafts (its drafter chain ended at the block table's end) verifies what it
has, and the step runs piecewise.

cost(L) comes from a model scaled by this engine's own step times. The model: a step of
n tokens costs about S + n token-times (S: the step's fixed cost, weights read and
launches, in tokens: below S a step is memory-bound and one more token is nearly free),
plus a fraction of S + n for each chained pass of the drafter past the steady state
(`StepTimes.units`). The times (`step_times.StepTimes`, on either executor: the
simulator's steps last what its cost model says) correct the model where no model or
profile can see, as where a step that falls back from graphs costs more than a longer
one that replays a graph. A length not timed in the batch's bucket is priced from the
nearest timed one, a bucket with nothing timed from the nearest bucket that has, and
with nothing timed anywhere by the model alone.

Under async scheduling the drafts a step verifies come from the step in flight, so their
confidences are unseen when it is scheduled: a request's running mean chances by
position (`smooth_chances`) stand in for them, and until it has its own, the engine's
over all requests (otherwise its first decode step would verify none, which in a short
answer is one step in every few).

Lengths not timed recently are tried only next to the best timed one (a hill climb), so
a bucket's exploration costs a step or two, not one step per length; the drafter
proposes one draft more than the chosen length while the next length is untimed and
every PROBE_EVERY steps (`proposals`), so that the climb can take that step.

Because the lengths follow measured times, a seeded request's sampled tokens may differ
between runs under varlen (each run is exactly distributed; greedy output never moves).
"""

from __future__ import annotations

import itertools
import operator
from collections.abc import Callable, Collection, Mapping, Sequence

from deepinfer.step_times import STEP_FIXED_COST_TOKENS, StepTimes


def _step_cost(
    times: StepTimes | None, num_reqs: int, fixed_cost_tokens: float = STEP_FIXED_COST_TOKENS
) -> tuple[Callable[[int, float], float], dict[int, float]]:
    """cost(length, tokens) of a step of `num_reqs` requests, with the drafter's passes
    after it at the steady state (`StepTimes.units`): measured seconds per model unit of
    the nearest length measured in the bucket (in the nearest bucket while its own has
    none: `StepTimes.prices`) times the model's units, or the model's units alone where
    nothing is measured; and what is measured. With `times`, the model's
    fixed cost is the one its units were measured in."""
    measured = times.prices(num_reqs) if times is not None else {}
    if times is not None:
        fixed_cost_tokens = times.fixed_cost_tokens

    def cost(length: int, tokens: float) -> float:
        if not measured:
            return fixed_cost_tokens + tokens
        nearest = min(measured, key=lambda m: (abs(m - length), m))
        return measured[nearest] * (fixed_cost_tokens + tokens)

    return cost, measured


PROBE_EVERY = 4  # steps: a length measured worse is still proposed this often
CONFIDENCE_SMOOTHING = 0.25


def smooth_chances(
    means: Sequence[float], confidences: Sequence[float], weight: float = CONFIDENCE_SMOOTHING
) -> list[float]:
    """A running mean (a request's, or the engine's over all requests), by position j,
    of drafts' chance c_1 * ... * c_j of being accepted through draft j, moved toward
    the latest drafts' (`confidences`; a position not drafted before starts at its
    value). Under async scheduling the drafts a step verifies are proposed by the step
    still in flight, so the host has not seen their confidences: the latest it has
    belong to other drafts, and acting on them draft by draft follows noise. The means
    of the chances (not of each confidence: a step's confidences may rise and fall
    together) predict them as well as anything the host holds."""
    chances = list(itertools.accumulate(confidences, operator.mul))
    out = [m + weight * (c - m) for m, c in zip(means, chances)]
    out += chances[len(means) :]
    return out + list(means[len(chances) :])


def confidences_from_chances(chances: Sequence[float]) -> list[float]:
    """The per-draft confidences whose running products are `chances` (what
    `draft_lengths` reads): c_j = chance_j / chance_(j-1), 0 past a chance of 0."""
    out, before = [], 1.0
    for chance in chances:
        out.append(chance / before if before > 0 else 0.0)
        before = chance
    return out


def proposals(
    length: int,
    max_len: int,
    num_reqs: int = 1,
    times: StepTimes | None = None,
    step_id: int = 0,
) -> int:
    """Drafts the drafter proposes after a step whose draft length was chosen in the batch
    bucket of `num_reqs`, where `length` is the longest length verified lately
    (DraftPlan passes the longest of its last PROBE_EVERY steps that chose a length, so
    one step of low confidences that chose a shorter length does not keep the next ones
    from theirs): one more while that longer length's price does not stand
    (`StepTimes.settled`: unmeasured in the bucket, or due to be timed again and not
    given up; the hill climb in `draft_lengths` tries it next), and every PROBE_EVERY
    steps (confidences can rise); else `length`, at least 1 (its confidence keeps the
    policy informed). Proposing more only now and then, not every step, spares the steps
    between probes a chained pass for a length already measured worse: at small batches
    a pass of the drafter is a sizeable share of the step. Pass 1 runs whatever this
    says: it writes the MTP layer's KV of the step's tokens."""
    if length >= max_len:
        return max_len
    if times is None or step_id % PROBE_EVERY == 0:
        return length + 1
    return max(1, length) if length + 1 in times.settled(num_reqs) else length + 1


def draft_lengths(
    confidences: Mapping[str, Sequence[float]],
    max_len: int,
    fixed_cost_tokens: float = STEP_FIXED_COST_TOKENS,
    num_other_tokens: int = 0,
    times: StepTimes | None = None,
    pending: Collection[int] = (),
) -> dict[str, int]:
    """How many of its drafts each request verifies next step (0..max_len).

    confidences: req_id -> its drafts' confidences (empty: no drafts); every listed
    request is one token of the step plus its drafts; num_other_tokens: the step's
    other tokens (prompt chunks); times: the engine's measured step times (None: the
    model alone; when given, its own fixed cost replaces fixed_cost_tokens); pending:
    lengths of uniform steps in flight, chosen in this bucket or the one that prices
    it, not yet timed (async scheduling), which are not tried again meanwhile.
    """
    cost, measured = _step_cost(times, len(confidences), fixed_cost_tokens)

    expected = float(len(confidences))  # E(0): one token per request
    tokens = float(len(confidences) + num_other_tokens)  # n(0)
    rates = {0: expected / cost(0, tokens)} if confidences else {}
    cumulative = {rid: 1.0 for rid in confidences}
    for length in range(1, max_len + 1):
        drafting = [rid for rid, conf in confidences.items() if len(conf) >= length]
        if not drafting:
            break
        for rid in drafting:
            cumulative[rid] *= float(confidences[rid][length - 1])
            expected += cumulative[rid]
        tokens += len(drafting)
        rates[length] = expected / cost(length, tokens)
    # With measurements to learn from (the bucket's, or the nearest bucket's while it has
    # none: StepTimes.prices), a length not measured recently, or due to be timed again,
    # is tried first, since the model may misprice it either way, unless given up or
    # still in flight (`pending`); but only next to the best measured length (a hill
    # climb): trying every length, 0 and 1 included at a batch where 5 pays, would spend
    # a short run's steps on lengths the model already knows are poor.
    candidates = list(rates)
    if times is not None:
        num_reqs = len(confidences)
        skip = times.settled(num_reqs) | times.given_up(num_reqs) | set(pending)
        best = max(measured.keys() & rates.keys(), key=lambda n: (rates[n], -n), default=None)
        untried = [n for n in rates if n not in skip and (best is None or abs(n - best) <= 1)]
        candidates = untried or candidates
    best_len = max(candidates, key=lambda length: (rates[length], -length), default=0)
    return {rid: min(best_len, len(conf)) for rid, conf in confidences.items()}
