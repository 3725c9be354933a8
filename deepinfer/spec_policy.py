"""Confidence-scheduled variable-length drafts (DEEPINFER_ENABLE_MTP_VARLEN=1).

Pure Python, so the scheduler runs it under both executors. Each request's drafts
come with confidences q_1..q_L (the drafter's probability of each draft); draft j is
accepted, all drafts before it too, with probability about c_j = q_1 * ... * q_j.

A step's cost: this engine's own measured seconds of steps of its batch size and
draft length (`StepTimes`: decode and verify steps, the lower quartile of the latest few by
batch bucket and length, a length timed once timed again, on either executor: the
simulator's steps last what its cost model says), scaled to the step by the model below; a length not measured yet in the
bucket is priced from the nearest measured one by the model, a bucket with nothing
measured from the nearest bucket that has, and with nothing measured anywhere by the
model alone. The model: a step of n tokens costs about S + n
token-times (S: the step's fixed cost, weights read and launches, in tokens: below S a
step is memory-bound and one more token is nearly free). The measurements matter
where the model is wrong: on the H200 a batch of 256 verifying 1 or 2 drafts each ran
piecewise and took longer than verifying 3 in a graph, which the model cannot know
(verify graphs now exist for every length, but the point stands for what a profile or
a model cannot see).
A step yields E tokens in expectation (one per request, plus each verified draft's c_j).
Under async scheduling the drafts a step verifies come from the step in flight, so their
confidences are unseen when it is scheduled: a request's running mean chances by
position (`smooth_chances`) stand in for them, and the engine's over all requests
before the request has its own (its first decode step: without them it verified none,
one step in every few of a short answer; in the simulator, on the Azure code trace at
20 requests/s, mean TPOT fell from 12.3 to 9.8 ms, 2026-12-05).

The step verifies the same number L of drafts for every request: the real executor
replays a verify graph per query length 1 + L, and only for steps in which every
request scores 1 + L tokens; a ragged step (per-request lengths) runs piecewise, with
attention eager, and measured slower on the H200 than verifying the longer uniform
length in a graph (benchmarks/RESULTS.md, 2026-12-04). L maximises E(L) / cost(L)
over 0..max_len, where E(L) sums the c_j of every request's first L drafts: the
confidences of the whole batch set it. At batch 1 almost every likely draft pays; as
the batch grows n(L) grows B times faster than one request's yield, so the verify
budget shrinks and speculation fades out instead of slowing the engine. A request with
fewer than L drafts (its drafter chain ended at the block table's end) verifies what it
has; such a ragged step runs piecewise on the real executor.

Lengths not measured recently are tried next to the best measured one only (a hill
climb), so a bucket's exploration costs a step or two, not one step per length. The
drafter then proposes `proposals` drafts after the step, from the longest L of the last
PROBE_EVERY steps (so one step of low confidences that chose a shorter L is no
ratchet): L + 1 while L + 1 is not measured (the next step may grow by one) and every
PROBE_EVERY steps, else L (at least one, whose confidence keeps the policy informed);
each chained pass past what the next step uses costs a pass of the MTP layer and the
head.

Because the lengths follow measured times, a seeded request's sampled tokens may differ
between runs under varlen (each run is exactly distributed; greedy output never moves).
"""

from __future__ import annotations

import itertools
import operator
from collections import deque
from collections.abc import Callable, Collection, Mapping, Sequence

# Fixed cost of a step in token-times: roughly the batch at which a decode step of a
# DeepSeek-style MoE turns compute-bound. Fitted on the H200 (Moonlight shapes): 128
# requests took 13.5 ms a step decoding and 29.3 ms verifying 3 drafts each (512 tokens,
# with the drafter), so S + 512 = 2.17 (S + 128), S = 200 (benchmarks/RESULTS.md).
STEP_FIXED_COST_TOKENS = 200.0
MAX_ATTEMPTS = 3  # choices of an unmeasured length before it is no longer tried first
# Steps of its bucket after which a length priced by fewer than SETTLED recent steps is
# measured again (StepTimes.due); WINDOW: the recent steps that price a length.
RETRY_AFTER = 8
# A chained pass of the drafter (its MTP layer and the LM head over the step's requests)
# costs about this fraction of the model's units of a decode step of those requests (S +
# n). On the H100 (Moonlight shapes) one more pass cost 0.45-0.6 ms beside a 7.4-8.5 ms
# verify step of one request and 1.6 ms beside a 27.4 ms step of 256 requests verifying 3
# drafts (benchmarks/RESULTS.md, 2026-12-05): 0.06-0.07 and 0.16 of S + n in the units of
# those steps.
PASS_COST_FRACTION = 0.1
SETTLED = 2
WINDOW = 8


class StepTimes:
    """Measured seconds of uniform decode / verify steps (no prompt tokens, every request
    verifying the same number of drafts), by batch bucket (powers of two) and length.

    Each bucket and length keeps its latest WINDOW steps' seconds per model unit (S +
    the step's tokens), so a step of another batch size in the bucket is priced by the
    model's scaling from them, at their lower quartile (the cheapest of up to three):
    a step's wall time can hold the host's stalls and part of another step's (on the
    H100 at batch 256, three steps in a row of 27.5 ms work took 45, 35 and 55 ms, and
    the next two 26 and 22), so one slow step must not set a price, nor a burst of
    them, and a length that looks cheaper than it is gets chosen and timed again. A length with fewer than
    SETTLED recent steps is due to be measured again once `retry_after` later steps of
    its bucket have passed (`due`): a hill climb never returns to a neighbour measured
    worse, so one slow step would otherwise keep it out until it went stale. A step goes
    stale after `stale_after` later steps of its bucket, and a length with none left is
    measured again (once), since costs move as contexts grow."""

    def __init__(
        self,
        fixed_cost_tokens: float = STEP_FIXED_COST_TOKENS,
        stale_after: int = 256,
        retry_after: int = RETRY_AFTER,
    ) -> None:
        self.fixed_cost_tokens = fixed_cost_tokens
        self.stale_after = stale_after
        self.retry_after = retry_after
        # bucket -> length -> the latest WINDOW (seconds per unit, the bucket's step count
        # when measured), oldest first
        self._samples: dict[int, dict[int, deque[tuple[float, int]]]] = {}
        self._steps: dict[int, int] = {}  # bucket -> uniform steps measured in it
        # bucket -> length -> times chosen since it was last measured: a length whose
        # steps never come out uniform (prompts keep arriving, the token budget cuts the
        # batch) is not tried for ever.
        self._attempts: dict[int, dict[int, int]] = {}

    @staticmethod
    def bucket(num_reqs: int) -> int:
        return num_reqs.bit_length()  # 1; 2-3; 4-7; ...

    def note_choice(self, num_reqs: int, length: int) -> None:
        """The policy chose `length` for a step of `num_reqs` running requests."""
        attempts = self._attempts.setdefault(self.bucket(num_reqs), {})
        attempts[length] = attempts.get(length, 0) + 1

    def units(self, num_reqs: int, length: int, proposals: int | None = None) -> float:
        """The model's units of a uniform step of `num_reqs` requests verifying `length`
        drafts each, after which the drafter proposes `proposals` drafts: S + n (1 + L)
        token-times, which hold the drafter's passes at the steady state (as many drafts
        proposed as verified, at least one), and PASS_COST_FRACTION of S + n for each
        chained pass beyond them."""
        extra = 0 if proposals is None else max(0, proposals - max(1, length))
        n, fixed = num_reqs, self.fixed_cost_tokens
        return fixed + n * (1 + length) + PASS_COST_FRACTION * (fixed + n) * extra

    def observe(
        self,
        num_reqs: int,
        length: int,
        seconds: float,
        decided_reqs: int | None = None,
        proposals: int | None = None,
    ) -> None:
        """A uniform step of `num_reqs` requests verifying `length` drafts each, its
        drafter then proposing `proposals` (None: max(1, length)), took `seconds`; it is
        filed under the bucket of `decided_reqs` (the requests running when its length
        was chosen; default num_reqs), in seconds per unit (`units`), so that a length
        timed while the drafter proposed more (the hill climb asks for one more, and a
        recent longer length keeps asking for it) is priced as if it proposed its own."""
        if num_reqs <= 0 or seconds <= 0:
            return
        bucket = self.bucket(decided_reqs if decided_reqs is not None else num_reqs)
        self._attempts.get(bucket, {}).pop(length, None)
        count = self._steps[bucket] = self._steps.get(bucket, 0) + 1
        unit = seconds / self.units(num_reqs, length, proposals)
        lengths = self._samples.setdefault(bucket, {})
        lengths.setdefault(length, deque(maxlen=WINDOW)).append((unit, count))

    def num_measured(self, num_reqs: int) -> int:
        """Uniform steps measured in the batch's bucket."""
        return self._steps.get(self.bucket(num_reqs), 0)

    def given_up(self, num_reqs: int) -> set[int]:
        """Lengths chosen MAX_ATTEMPTS times in the bucket with no uniform step to show
        for it: no longer tried first."""
        attempts = self._attempts.get(self.bucket(num_reqs), {})
        return {length for length, n in attempts.items() if n >= MAX_ATTEMPTS}

    def prices(self, num_reqs: int) -> dict[int, float]:
        """What prices a step of `num_reqs` requests: the bucket's own `per_unit`, or,
        while it has none, the nearest bucket's (seconds per model unit carry across
        buckets by the model's scaling), so that a batch crossing a power of two (256
        requests, one finishes: 255) does not explore every length again."""
        return self._fresh(self._pricing_bucket(num_reqs))

    def due(self, num_reqs: int) -> set[int]:
        """Lengths among `prices` with fewer than SETTLED recent steps, the latest of
        them `retry_after` or more steps of its bucket ago: to be measured again."""
        bucket = self._pricing_bucket(num_reqs)
        now = self._steps.get(bucket, 0)
        return {
            length
            for length, recent in self._recent(bucket).items()
            if len(recent) < SETTLED and now - recent[-1][1] >= self.retry_after
        }

    def per_unit(self, num_reqs: int) -> dict[int, float]:
        """length -> measured seconds per model unit in the batch's bucket, for the
        lengths measured recently enough (maybe none)."""
        return self._fresh(self.bucket(num_reqs))

    def _pricing_bucket(self, num_reqs: int) -> int:
        here = self.bucket(num_reqs)
        for bucket in sorted(self._samples.keys() | {here}, key=lambda b: (abs(b - here), -b)):
            if self._recent(bucket):
                return bucket
        return here

    def _recent(self, bucket: int) -> dict[int, list[tuple[float, int]]]:
        """length -> its samples taken within `stale_after` steps of the bucket, if any."""
        now = self._steps.get(bucket, 0)
        out = {}
        for length, samples in self._samples.get(bucket, {}).items():
            recent = [s for s in samples if now - s[1] <= self.stale_after]
            if recent:
                out[length] = recent
        return out

    def _fresh(self, bucket: int) -> dict[int, float]:
        return {
            length: sorted(unit for unit, _ in recent)[len(recent) // 4]
            for length, recent in self._recent(bucket).items()
        }


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
    value). Under async scheduling the drafts
    a step verifies are proposed by the step still in flight, so the host has not seen
    their confidences: the latest it has belong to other drafts, and acting on them
    draft by draft follows noise (in the simulator, where each draft's confidence is
    drawn anew, varlen at batch 1 made 1.32x against 1.52x for a fixed 3 drafts). The
    means of the chances (not of each confidence: a step's confidences may rise and fall
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
    """Drafts the drafter proposes after a step whose requests were decided in the batch
    bucket of `num_reqs`, where `length` is the longest length verified lately (the
    scheduler passes the longest of its last PROBE_EVERY steps, so one step of low
    confidences that chose a shorter length does not keep the next ones from theirs):
    one more while that longer length is unmeasured in the bucket (the hill climb in
    `draft_lengths` tries it next, or prices it by the model once given up) and every
    PROBE_EVERY steps (confidences can rise); else `length`, at least 1 (its confidence
    keeps the policy informed). A chained pass a step for a length measured worse cost
    varlen 13% at batch 1 on the H200 (benchmarks/RESULTS.md). Pass 1 runs whatever this
    says: it writes the MTP layer's KV of the step's tokens."""
    if length >= max_len:
        return max_len
    if times is None or step_id % PROBE_EVERY == 0:
        return length + 1
    settled = times.prices(num_reqs).keys() - times.due(num_reqs)
    return max(1, length) if length + 1 in settled else length + 1


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
    lengths of uniform steps in flight in this bucket, not yet timed (async
    scheduling), which are not tried again meanwhile.
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
    # With measurements to learn from, a length not measured (recently) in this bucket is
    # tried first, since the model may misprice it either way; but only next to the best
    # measured length (a hill climb): trying every length, 0 and 1 included at a batch
    # where 5 pays, cost 3% / 15% of a 40-step run at batch 256 / 32 in the simulator.
    candidates = list(rates)
    if times is not None:
        skip = measured.keys() - times.due(len(confidences))
        skip |= times.given_up(len(confidences)) | set(pending)
        best = max(measured.keys() & rates.keys(), key=lambda n: (rates[n], -n), default=None)
        untried = [n for n in rates if n not in skip and (best is None or abs(n - best) <= 1)]
        candidates = untried or candidates
    best_len = max(candidates, key=lambda length: (rates[length], -length), default=0)
    return {rid: min(best_len, len(conf)) for rid, conf in confidences.items()}
