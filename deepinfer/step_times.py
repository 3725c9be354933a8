"""What varlen's uniform decode / verify steps cost: their measured seconds by batch
bucket and draft length (`StepTimes`), which `spec_policy.draft_lengths` prices draft
lengths from. Pure Python: varlen's DraftPlan keeps one under either executor (the
simulator's steps last what its cost model says)."""

from __future__ import annotations

from collections import deque

# Fixed cost of a step in token-times: roughly the batch at which a decode step of a
# DeepSeek-style MoE turns compute-bound. Fitted so that the model gives the ratio of
# Moonlight's steps of 128 requests verifying 3 drafts each (S + 512) to its decode
# steps of 128 (S + 128); timed steps correct it once a length has them.
STEP_FIXED_COST_TOKENS = 200.0
MAX_ATTEMPTS = 3  # choices of an unmeasured length before it is no longer tried first
# Steps of its bucket after which a length priced by fewer than SETTLED recent steps is
# measured again (StepTimes.due); WINDOW: the recent steps that price a length.
RETRY_AFTER = 8
SETTLED = 2
WINDOW = 8
# A chained pass of the drafter (its MTP layer and the LM head over the step's requests)
# costs about this fraction of the model's units of a decode step of those requests (S +
# n): one MTP layer and the head against the whole model. The fraction is smaller at
# batch 1 than at large batches; this lies between.
PASS_COST_FRACTION = 0.1


class StepTimes:
    """Measured seconds of uniform decode / verify steps (no prompt tokens, every request
    verifying the same number of drafts), by batch bucket (powers of two) and length.

    Each bucket and length keeps its latest WINDOW steps' seconds per model unit (S +
    the step's tokens), so a step of another batch size in the bucket is priced by the
    model's scaling from them, at their lower quartile (the cheapest of up to three): a
    step's wall time can hold the host's stalls and part of another step's (a stall can
    stretch a few steps in a row, and the steps after it then look short), so one slow
    step must not set a price, nor a burst of them, and a length that looks cheaper than
    it is gets chosen and timed again. A length with fewer than SETTLED recent steps is
    due to be measured again once `retry_after` later steps of its bucket have passed
    (`due`): a hill climb never returns to a neighbour measured worse, so one slow step
    would otherwise keep it out until it went stale. A step goes stale after
    `stale_after` later steps of its bucket, and a length with none left is measured
    again (once), since costs move as contexts grow."""

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
        num_reqs_at_choice: int | None = None,
        proposals: int | None = None,
    ) -> None:
        """A uniform step of `num_reqs` requests verifying `length` drafts each, its
        drafter then proposing `proposals` (None: max(1, length)), took `seconds`; it is
        filed under the bucket of `num_reqs_at_choice` (the requests running when its length
        was chosen; default num_reqs), in seconds per unit (`units`), so that a length
        timed while the drafter proposed more (the hill climb asks for one more, and a
        recent longer length keeps asking for it) is priced as if it proposed its own."""
        if num_reqs <= 0 or seconds <= 0:
            return
        bucket = self.bucket(num_reqs_at_choice if num_reqs_at_choice is not None else num_reqs)
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
        return self._fresh(self.pricing_bucket(num_reqs))

    def due(self, num_reqs: int) -> set[int]:
        """Lengths among `prices` with fewer than SETTLED recent steps, the latest of
        them `retry_after` or more steps of its bucket ago: to be measured again."""
        bucket = self.pricing_bucket(num_reqs)
        now = self._steps.get(bucket, 0)
        return {
            length
            for length, recent in self._recent(bucket).items()
            if len(recent) < SETTLED and now - recent[-1][1] >= self.retry_after
        }

    def settled(self, num_reqs: int) -> set[int]:
        """Lengths whose price stands for a batch of `num_reqs`: priced by recent steps
        (`prices`) and not due to be timed again, or due but given up (their steps never
        come out uniform, so no timing would come of trying them)."""
        return self.prices(num_reqs).keys() - (self.due(num_reqs) - self.given_up(num_reqs))

    def per_unit(self, num_reqs: int) -> dict[int, float]:
        """length -> measured seconds per model unit in the batch's bucket, for the
        lengths measured recently enough (maybe none)."""
        return self._fresh(self.bucket(num_reqs))

    def pricing_bucket(self, num_reqs: int) -> int:
        """The bucket whose steps price a batch of `num_reqs` (`prices`): its own while it
        has any recent ones, else the nearest that has (the larger of two as near)."""
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
