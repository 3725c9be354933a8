"""Varlen's pricing rules restated (deepinfer/step_times.py, deepinfer/spec_policy.py,
docs/design.md "Variable-length drafts"), as the oracle of their model tests.

`ReferenceStepTimes` keeps the whole history of choices and timed steps in one list and
answers every query from it by the documented rule, with none of `StepTimes`'s
per-bucket windows, counters or attempt maps: a bucket's steps are numbered by
counting, a length's window is the last WINDOW of its steps, a length is given up by
counting the choices since its last step. `reference_draft_lengths` and
`reference_proposals` restate the policy from its docstrings: the rate E(L) / cost(L)
of each length, the hill climb next to the best measured length, the probe.

The numbers are the specification's (restated here, not imported), so a change of a
tuning value is a change the tests must be told of.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

FIXED_COST_TOKENS = 200.0  # S, the default fixed cost of a step in token-times
MAX_ATTEMPTS = 3  # choices without a uniform step after which a length is given up
RETRY_AFTER = 8  # steps of its bucket after which a lightly timed length is due
SETTLED = 2  # recent steps that make a length's price stand
WINDOW = 8  # the latest steps of a length that price it
STALE_AFTER = 256  # steps of its bucket after which a step no longer prices
PASS_COST = 0.1  # a chained pass of the drafter, as a fraction of S + n
PROBE_EVERY = 4  # steps: every PROBE_EVERY-th step asks for one draft more
SMOOTHING = 0.25  # weight of the latest chances in a running mean


def bucket_of(num_reqs: int) -> int:
    """Batch buckets are powers of two: 0 for no request, then 1; 2-3; 4-7; ..."""
    b = 0
    while num_reqs >= 2**b:
        b += 1
    return b


def model_units(num_reqs: int, length: int, proposals: int | None, fixed: float) -> float:
    """S + n (1 + L), plus PASS_COST (S + n) for each draft proposed past max(1, L)."""
    units = fixed + num_reqs * (1 + length)
    if proposals is not None and proposals > max(1, length):
        units += PASS_COST * (fixed + num_reqs) * (proposals - max(1, length))
    return units


@dataclass(frozen=True)
class Choice:
    bucket: int
    length: int


@dataclass(frozen=True)
class Timed:
    bucket: int
    length: int
    per_unit: float
    number: int  # the how-manyth step of its bucket


class ReferenceStepTimes:
    def __init__(
        self,
        fixed_cost_tokens: float = FIXED_COST_TOKENS,
        stale_after: int = STALE_AFTER,
        retry_after: int = RETRY_AFTER,
    ) -> None:
        self.fixed = fixed_cost_tokens
        self.stale_after = stale_after
        self.retry_after = retry_after
        self.history: list[Choice | Timed] = []
        # bucket -> recent(bucket), for the history as long as _memo_len (it only grows)
        self._memo: dict[int, dict[int, list[Timed]]] = {}
        self._memo_len = 0

    def note_choice(self, num_reqs: int, length: int) -> None:
        self.history.append(Choice(bucket_of(num_reqs), length))

    def observe(
        self,
        num_reqs: int,
        length: int,
        seconds: float,
        num_reqs_at_choice: int | None = None,
        proposals: int | None = None,
    ) -> None:
        if num_reqs < 1 or not seconds > 0:
            return  # no step to learn from
        b = bucket_of(num_reqs if num_reqs_at_choice is None else num_reqs_at_choice)
        number = self.num_steps(b) + 1
        per_unit = seconds / model_units(num_reqs, length, proposals, self.fixed)
        self.history.append(Timed(b, length, per_unit, number))

    def num_steps(self, b: int) -> int:
        """The steps timed in bucket b: the number of its latest."""
        return max(
            (e.number for e in self.history if isinstance(e, Timed) and e.bucket == b), default=0
        )

    def recent(self, b: int) -> dict[int, list[Timed]]:
        """length -> its last WINDOW steps in bucket b, less those STALE_AFTER steps of
        the bucket old; lengths with none left are absent."""
        if self._memo_len != len(self.history):
            self._memo, self._memo_len = {}, len(self.history)
        if b not in self._memo:
            self._memo[b] = self._recent(b)
        return self._memo[b]

    def _recent(self, b: int) -> dict[int, list[Timed]]:
        steps: dict[int, list[Timed]] = {}
        for e in self.history:
            if isinstance(e, Timed) and e.bucket == b:
                steps.setdefault(e.length, []).append(e)
        now = max((e.number for timed in steps.values() for e in timed), default=0)
        out = {}
        for length, timed in steps.items():
            kept = [e for e in timed[-WINDOW:] if now - e.number <= self.stale_after]
            if kept:
                out[length] = kept
        return out

    def fresh(self, b: int) -> dict[int, float]:
        """The lower quartile: the cheapest of 1-3 steps, the second of 4-7, the third of 8."""
        return {
            length: sorted(e.per_unit for e in steps)[len(steps) // 4]
            for length, steps in self.recent(b).items()
        }

    def pricing_bucket(self, num_reqs: int) -> int:
        here = bucket_of(num_reqs)
        timed = {e.bucket for e in self.history if isinstance(e, Timed)}
        with_recent = [b for b in timed if self.recent(b)]
        if here in with_recent or not with_recent:
            return here
        return min(with_recent, key=lambda b: (abs(b - here), -b))

    def prices(self, num_reqs: int) -> dict[int, float]:
        return self.fresh(self.pricing_bucket(num_reqs))

    def per_unit(self, num_reqs: int) -> dict[int, float]:
        return self.fresh(bucket_of(num_reqs))

    def num_measured(self, num_reqs: int) -> int:
        return self.num_steps(bucket_of(num_reqs))

    def given_up(self, num_reqs: int) -> set[int]:
        b = bucket_of(num_reqs)
        since: dict[int, int] = {}  # length -> choices since its last step in b
        for e in self.history:
            if e.bucket != b:
                continue
            if isinstance(e, Timed):
                since.pop(e.length, None)
            else:
                since[e.length] = since.get(e.length, 0) + 1
        return {length for length, n in since.items() if n >= MAX_ATTEMPTS}

    def due(self, num_reqs: int) -> set[int]:
        b = self.pricing_bucket(num_reqs)
        now = self.num_steps(b)
        return {
            length
            for length, steps in self.recent(b).items()
            if len(steps) < SETTLED and now - steps[-1].number >= self.retry_after
        }

    def settled(self, num_reqs: int) -> set[int]:
        due_now = self.due(num_reqs) - self.given_up(num_reqs)
        return {length for length in self.prices(num_reqs) if length not in due_now}


def chances(confidences: Sequence[float]) -> list[float]:
    """c_1, c_1 c_2, ...: the chance that each draft and all before it are accepted."""
    out, product = [], 1.0
    for c in confidences:
        product *= c
        out.append(product)
    return out


def reference_smooth(
    means: Sequence[float], confidences: Sequence[float], weight: float = SMOOTHING
) -> list[float]:
    """Each position's mean moved `weight` of the way to the latest chance; a position
    only one side has keeps that side's value."""
    latest = chances(confidences)
    out = []
    for j in range(max(len(means), len(latest))):
        if j < len(means) and j < len(latest):
            out.append(means[j] + weight * (latest[j] - means[j]))
        else:
            out.append(means[j] if j < len(means) else latest[j])
    return out


def reference_confidences(chance_list: Sequence[float]) -> list[float]:
    """The inverse of `chances`: each chance over the one before (0 after a chance of 0)."""
    return [
        0.0 if j and chance_list[j - 1] <= 0 else c / (chance_list[j - 1] if j else 1.0)
        for j, c in enumerate(chance_list)
    ]


def reference_proposals(
    length: int, max_len: int, num_reqs: int = 1, times: Any = None, step_id: int = 0
) -> int:
    """At most max_len; one more than `length` on a probe step (every PROBE_EVERY-th, or
    always without times) or while length + 1's price does not stand; else `length`,
    at least 1."""
    if length >= max_len:
        return max_len
    probe = times is None or step_id % PROBE_EVERY == 0
    if probe or length + 1 not in times.settled(num_reqs):
        return length + 1
    return max(1, length)


def reference_draft_lengths(
    confidences: Mapping[str, Sequence[float]],
    max_len: int,
    fixed_cost_tokens: float = FIXED_COST_TOKENS,
    num_other_tokens: int = 0,
    times: Any = None,
    pending: Collection[int] = (),
) -> dict[str, int]:
    """The length L maximising E(L) / cost(L) (ties: the shorter), each request capped
    at its own drafts. E(L): a token per request plus, per request, the chances of its
    first min(L, drafts) drafts; cost(L): S + the step's tokens, times the price of the
    nearest measured length (ties: the shorter) where any is measured. With times, the
    lengths neither settled, given up nor pending, within one of the best measured
    length (any, when none is measured), are the only candidates if there are any."""
    n = len(confidences)
    if n == 0:
        return {}
    measured = times.prices(n) if times is not None else {}
    fixed = times.fixed_cost_tokens if times is not None else fixed_cost_tokens
    longest = max(len(conf) for conf in confidences.values())
    rates: dict[int, float] = {}
    for length in range(min(max_len, longest) + 1):
        expected = n + sum(sum(chances(conf[:length])) for conf in confidences.values())
        tokens = n + num_other_tokens + sum(min(length, len(c)) for c in confidences.values())
        cost = fixed + tokens
        if measured:
            nearest = min(sorted(measured), key=lambda m: abs(m - length))
            cost *= measured[nearest]
        rates[length] = expected / cost
    candidates = list(rates)
    if times is not None:
        skip = times.settled(n) | times.given_up(n) | set(pending)
        timed = [m for m in sorted(measured) if m in rates]
        best = max(timed, key=lambda m: (rates[m], -m)) if timed else None
        near = [m for m in rates if best is None or abs(m - best) <= 1]
        candidates = [m for m in near if m not in skip] or candidates
    chosen = max(candidates, key=lambda m: (rates[m], -m))
    return {rid: min(chosen, len(conf)) for rid, conf in confidences.items()}
