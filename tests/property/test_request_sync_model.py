"""Request sync between a rank and the front-end (deepinfer/data_parallel/request_sync.py),
model-tested: the rank's requests change as steps leave them (tokens and their logprob
rows and times, prompt logprob rows chunk by chunk, status, counters, timestamps, a
finish), and after any of them the rank sends a request's delta, which the front-end
applies to its own copy. The rules, restated from the module's docstring:
- after each delta is applied, the front-end's copy equals the rank's request in every
  field the front-end returns;
- a delta carries only what the front-end lacks: the outputs, logprob rows, token times
  and prompt logprob rows added since the request's last delta (all of them in its
  first), and says where its tokens start;
- a finished request is forgotten: a later request under its id starts from nothing;
- a delta that does not start where the front-end's tokens end is refused, naming the
  request and both positions.
The reference is the front-end's own copy as the test last saw it, never the tracker.
"""

from __future__ import annotations

import copy

import pytest
from hypothesis import given
from hypothesis import strategies as st

from deepinfer.data_parallel.request_sync import DeltaTracker, RequestDelta, apply_delta
from deepinfer.request import FinishReason, Request, RequestStatus
from tests.property.strategies import at_least

PROMPT = list(range(1, 9))
LIVE = [RequestStatus.WAITING, RequestStatus.PREFILLING, RequestStatus.RUNNING,
        RequestStatus.PREEMPTED]  # fmt: skip
ENDS = [
    (RequestStatus.FINISHED, FinishReason.STOP, None),
    (RequestStatus.FINISHED, FinishReason.LENGTH, None),
    (RequestStatus.ABORTED, FinishReason.ABORT, "aborted by the client"),
    (RequestStatus.REJECTED, FinishReason.REJECTED, "prompt too long"),
]


def fields(req: Request) -> dict[str, object]:
    t = req.times
    return {
        "status": req.status,
        "finish_reason": req.finish_reason,
        "reject_reason": req.reject_reason,
        "num_computed_tokens": req.num_computed_tokens,
        "num_preemptions": req.num_preemptions,
        "num_cached_tokens": req.num_cached_tokens,
        "output_token_ids": list(req.output_token_ids),
        "logprobs": list(req.logprobs),
        "prompt_logprobs": dict(req.prompt_logprobs),
        "times": (t.first_scheduled, t.first_token, t.finish, list(t.token_times)),
    }


def step(req: Request, draw: st.DrawFn, clock: float) -> None:
    """What one engine step may do to a live request."""
    kind = draw(st.integers(0, 6))
    if kind <= 2:  # a step that samples 1-3 tokens (speculation), maybe with logprobs
        n = draw(st.integers(1, 3))
        start = len(req.output_token_ids)
        req.output_token_ids.extend(range(100 + start, 100 + start + n))
        if draw(st.booleans()):
            req.logprobs.extend({100 + start + i: -0.5 * i} for i in range(n))
        if draw(st.booleans()):
            req.times.token_times.append(clock)
        if req.times.first_token is None:
            req.times.first_token = clock
        req.status = RequestStatus.RUNNING
    elif kind == 3:  # a prompt chunk, with its prompt logprob rows in position order
        at = len(req.prompt_logprobs)
        n = draw(st.integers(1, 3))
        req.prompt_logprobs.update({at + i: {PROMPT[0]: -float(at + i)} for i in range(n)})
        req.status = RequestStatus.PREFILLING
    elif kind == 4:  # preempted, or back to waiting
        req.status = draw(st.sampled_from(LIVE))
        req.num_preemptions += req.status is RequestStatus.PREEMPTED
    elif kind == 5:  # first scheduled, with a prefix-cache hit
        req.times.first_scheduled = clock
        req.num_cached_tokens = draw(st.integers(0, len(PROMPT)))
    req.num_computed_tokens = draw(st.integers(0, 20))


@at_least(200)
@given(data=st.data())
def test_the_front_ends_copy_follows_the_rank_by_deltas(data: st.DataObject) -> None:
    tracker = DeltaTracker()
    rank: dict[str, Request] = {}
    front: dict[str, Request] = {}
    finished: set[str] = set()
    clock = 0.0
    for _ in range(data.draw(st.integers(1, 20))):
        clock += 1.0
        rid = data.draw(st.sampled_from(["a", "b", "c"]))
        if rid not in rank or rid in finished:  # (re)arrives: a new request under the id
            rank[rid] = Request(rid, PROMPT, arrival_time=clock)
            front[rid] = Request(rid, PROMPT, arrival_time=clock)
            finished.discard(rid)
        req, mine = rank[rid], front[rid]
        if data.draw(st.integers(0, 7)) == 0:
            status, reason, why = data.draw(st.sampled_from(ENDS))
            req.status, req.finish_reason, req.reject_reason = status, reason, why
            req.times.finish = clock
            finished.add(rid)
        else:
            step(req, data.draw, clock)
        before = fields(mine)
        d = tracker.delta(req)
        held = len(mine.output_token_ids)
        assert d.req_id == rid and d.first_new == held, f"{rid}: delta from {d.first_new}"
        assert d.new_tokens == req.output_token_ids[held:]
        assert d.new_logprobs == req.logprobs[len(mine.logprobs) :]
        assert d.new_token_times == req.times.token_times[len(mine.times.token_times) :]
        assert d.new_prompt_logprobs == {
            pos: row for pos, row in req.prompt_logprobs.items() if pos not in mine.prompt_logprobs
        }
        if d.new_tokens:  # the same delta again would start short of the copy's end
            with pytest.raises(RuntimeError, match=rf"request '{rid}'.* index {held}, .*holds"):
                stale = copy.deepcopy(mine)
                apply_delta(stale, d)
                apply_delta(stale, d)
        apply_delta(mine, d)
        assert fields(mine) == fields(req), f"{rid}: front-end copy {fields(mine)} (was {before})"


def test_a_delta_from_the_wrong_index_is_refused_before_any_change() -> None:
    req = Request("x", PROMPT)
    d = RequestDelta("x", RequestStatus.RUNNING, None, None, 3, 0, 0, 1.0, 1.0, None,
                     2, [5], [], [1.0])  # fmt: skip
    before = fields(req)
    with pytest.raises(RuntimeError, match=r"request 'x': .* from index 2, the front-end holds 0"):
        apply_delta(req, d)
    assert fields(req) == before
