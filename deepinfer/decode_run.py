"""A decode run: engine steps whose outcome the scheduler can prove before they happen.

Between events that change a batch (an arrival, a request finishing, a waiting request
that could start, a block the cache cannot give, a prompt chunk), consecutive steps
schedule the same running requests, one decode token each, in the same order; only the
contexts grow, by one token a step. `Scheduler.decode_run` says how many such steps
are certain from its own state (the horizon), and a driver that can price and time
them without running them (the simulator) advances several at once:
`EngineCore.advance_decode` applies their bookkeeping in one call, exactly as the steps
one by one would have left it (docs/design.md, "Fast-forward").
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import NamedTuple

from deepinfer.outputs import SchedulerOutput
from deepinfer.request import Request


@dataclass(frozen=True)
class DecodeRun:
    """Steps first_step_id, first_step_id + 1, ... each scheduling `requests` (in this
    order) that are still in the batch, request i at context contexts[i] + s in the
    run's step s; at most `horizon` of them are certain. Request i is in the run's steps
    s < limits[i] and ends by length in step limits[i] - 1's turn; a run whose horizon
    passes a limit (nothing waits to take the freed room) goes on with the others.
    in_flight_step: under async scheduling, the step in flight when the run starts (the
    same requests, one token each): the run's step s is scheduled before that step's
    results, or step s - 1's, are applied."""

    requests: tuple[Request, ...]
    contexts: tuple[int, ...]  # num_computed_tokens of each before the run's first step
    # The steps after which each ends by length (max_tokens, max_model_len), if the run
    # gets that far: the last step it is in is the run's step limits[i] - 1.
    limits: tuple[int, ...]
    horizon: int
    first_step_id: int
    in_flight_step: int | None
    # Requests that ended or were preempted since the last step scheduled: the run's
    # first step tells the executor to drop them.
    dropped_req_ids: frozenset[str]
    num_preempted_before: int  # of those, preempted: the first step's record counts them

    @property
    def num_reqs(self) -> int:
        return len(self.requests)

    @property
    def ctx_max(self) -> int:
        """The longest context of the run's first step (step s: ctx_max + s)."""
        return max(self.contexts)

    @property
    def ctx_sum(self) -> int:
        """The contexts' sum in the run's first step (step s: ctx_sum + s * num_reqs)."""
        return sum(self.contexts)

    def batches(self) -> Iterator[Batch]:
        """The run's steps up to its horizon as stretches of one batch, in order: a
        stretch ends where a request leaves (its limit). Made as they are read: a run
        cut short (an arrival) makes none past its cut."""
        horizon, limits, contexts = self.horizon, self.limits, self.contexts
        if min(limits) >= horizon:  # (most runs: one batch)
            yield Batch(0, horizon, len(limits), max(contexts), sum(contexts))
            return
        # By limit, the requests still in the batch at a stretch's start are a suffix:
        # its size, longest context and sum are kept from the end.
        by_limit = sorted(zip(limits, contexts))
        n = len(by_limit)
        longest = [0] * n
        total = [0] * n
        top = acc = 0
        for j in range(n - 1, -1, -1):
            c = by_limit[j][1]
            top = c if c > top else top
            acc += c
            longest[j] = top
            total[j] = acc
        start = j = 0
        for end in sorted({h for h in limits if h < horizon} | {horizon}):
            while by_limit[j][0] <= start:
                j += 1
            m = n - j
            yield Batch(start, end - start, m, longest[j] + start, total[j] + m * start)
            start = end


class Batch(NamedTuple):
    """`num_steps` steps of a decode run from its step `first`, each scheduling the same
    `num_reqs` requests: at the first, their longest context is ctx_max and their sum
    ctx_sum (step first + s: ctx_max + s, ctx_sum + num_reqs * s)."""

    first: int
    num_steps: int
    num_reqs: int
    ctx_max: int
    ctx_sum: int


class AdvancedRun(NamedTuple):
    """What `Scheduler.advance_decode` left: the step in flight (under async scheduling,
    the run's last step, scheduled and not applied; else None), the cache usage each
    applied step's record reads, and the requests its last step ended (by length)."""

    in_flight: SchedulerOutput | None
    usages: list[float]
    finished: list[Request]
