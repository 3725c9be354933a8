"""A waiting queue with nothing ready to start refuses a pop, saying so.

The scheduler pops only after `peek` found a request, so the other properties never see
the refusal. It guards against a caller's bug: popping an empty queue, or one whose
requests all await their grammars, must raise rather than hand out a request that may
not start, and say why.
"""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from deepinfer.request import Request
from deepinfer.request_queue import WaitingQueue
from tests.property.strategies import scaled


@scaled(0.2)
@given(st.sampled_from(["fcfs", "priority"]), st.integers(0, 4))
def test_a_pop_with_nothing_ready_to_start_refuses_saying_so(policy: str, n: int) -> None:
    """n requests, each awaiting its grammar (none when n is 0): `peek` finds none and
    `pop` raises IndexError naming why, the requests keeping their places."""
    queue = WaitingQueue(policy)
    reqs = [Request(f"r{i}", [1, 2, 3], arrival_time=float(i), priority=-i) for i in range(n)]
    for req in reqs:
        req.awaiting_grammar = True
        queue.add(req)
    assert queue.peek() is None
    with pytest.raises(IndexError, match="no request ready to start"):
        queue.pop()
    assert sorted(r.request_id for r in queue) == sorted(r.request_id for r in reqs)
