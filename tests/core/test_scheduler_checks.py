"""The scheduler's own safety net (scheduler_checks.py), fed deliberately broken states.

The property suite runs `check_invariants` / `check_output` after every step of legal
runs, where they never fire; these tests corrupt one thing at a time and expect the
check to name it, and pin the stall diagnosis an operator reads when nothing can run.
"""

from __future__ import annotations

import pytest

from deepinfer.errors import SchedulerStalled
from deepinfer.outputs import ScheduledRequest, SchedulerOutput
from deepinfer.request import Request, RequestStatus
from deepinfer.scheduler import Scheduler
from deepinfer.scheduler_checks import check_invariants, check_output, diagnose_stall, raise_stalled
from tests.factories import make_config, make_request


def _distinct(req_id: str, n: int, base: int) -> Request:
    """A prompt no other request shares a block with (no prefix-cache hits)."""
    return make_request(req_id, [base + i for i in range(n)])


def _scheduler(**overrides: object) -> Scheduler:
    cfg = make_config(**overrides)
    assert cfg.num_gpu_blocks is not None
    return Scheduler(cfg, cfg.num_gpu_blocks)


def _mixed() -> tuple[Scheduler, Request, Request, Request]:
    """A legal state: `r` running, `p` mid chunked prefill, `w` waiting (no blocks)."""
    s = _scheduler(block_size=4, num_gpu_blocks=20, max_num_batched_tokens=8)
    r, p, w = _distinct("r", 4, 100), _distinct("p", 12, 200), _distinct("w", 4, 300)
    s.add_request(r)
    s.schedule()  # r's whole prompt
    s.add_request(p)
    s.add_request(w)
    s.schedule()  # r decodes; p's first chunk of 7 tokens; the budget is spent
    assert r.status is RequestStatus.RUNNING and p.status is RequestStatus.PREFILLING
    assert w.status is RequestStatus.WAITING
    check_invariants(s)
    return s, r, p, w


def _queue_twice(s: Scheduler, r: Request, p: Request, w: Request) -> str:
    s.running.append(r)  # only running repeats (an `and` of the two tests misses it)
    return "a request is queued twice"


def _both(s: Scheduler, r: Request, p: Request, w: Request) -> str:
    s.waiting.add(r)
    return "requests both waiting and running: ['r']"


def _unknown(s: Scheduler, r: Request, p: Request, w: Request) -> str:
    del s.requests["w"]
    return "live requests and queues disagree"


def _running_status(s: Scheduler, r: Request, p: Request, w: Request) -> str:
    r.status = RequestStatus.PREEMPTED
    return f"{r!r} in running with status {RequestStatus.PREEMPTED}"


def _running_no_blocks(s: Scheduler, r: Request, p: Request, w: Request) -> str:
    s.kv.free(r)
    return f"running {r!r} holds no blocks"


def _waiting_status(s: Scheduler, r: Request, p: Request, w: Request) -> str:
    w.status = RequestStatus.FINISHED
    return f"{w!r} in waiting with status {RequestStatus.FINISHED}"


def _prefill_not_leading(s: Scheduler, r: Request, p: Request, w: Request) -> str:
    p.status = RequestStatus.WAITING  # holds blocks, counted in progress, says waiting
    return f"waiting {p!r}: chunked prefills in progress must lead"


def _waiting_holds_blocks(s: Scheduler, r: Request, p: Request, w: Request) -> str:
    assert s.kv.allocate(w, 4) is not None
    return f"waiting {w!r}: holds blocks iff a prefill in progress"


def _computed_too_many(s: Scheduler, r: Request, p: Request, w: Request) -> str:
    r.num_computed_tokens = r.num_tokens + r.num_output_placeholders + 1
    return f"{r!r} computed more tokens than it has"


def _lost(s: Scheduler, r: Request, p: Request, w: Request) -> str:
    s.num_submitted += 1
    return "4 submitted but 3 accounted for"


@pytest.mark.parametrize(
    "corrupt",
    [
        _queue_twice,
        _both,
        _unknown,
        _running_status,
        _running_no_blocks,
        _waiting_status,
        _prefill_not_leading,
        _waiting_holds_blocks,
        _computed_too_many,
        _lost,
    ],
)
def test_check_invariants_names_each_corruption(corrupt) -> None:  # type: ignore[no-untyped-def]
    s, r, p, w = _mixed()
    message = corrupt(s, r, p, w)
    with pytest.raises(AssertionError) as err:
        check_invariants(s)
    assert str(err.value) == message


def test_a_request_queued_twice_in_waiting_alone_is_caught() -> None:
    s, r, p, w = _mixed()
    s.waiting.add(w)
    with pytest.raises(AssertionError, match="^a request is queued twice$"):
        check_invariants(s)


def test_computed_up_to_its_tokens_plus_those_in_flight_is_legal() -> None:
    """The bound is inclusive: computed == tokens + placeholders + pending drafts passes
    (the converse of `_computed_too_many`)."""
    s, r, p, w = _mixed()
    r.num_computed_tokens = r.num_tokens + r.num_output_placeholders + r.num_pending_drafts
    check_invariants(s)


def _out(*scheduled: tuple[str, int]) -> SchedulerOutput:
    return SchedulerOutput(
        7, [ScheduledRequest(rid, n, 0, True, False, []) for rid, n in scheduled]
    )


@pytest.mark.parametrize(
    ("out", "message"),
    [
        (_out(("a", 9), ("b", 8)), "step 7: 17 tokens > max_num_batched_tokens"),
        (_out(("a", 1), ("b", 1), ("c", 1)), "step 7: 3 requests > max_num_seqs"),
        (_out(("a", 1), ("a", 1)), "step 7: a request scheduled twice"),
    ],
)
def test_check_output_names_the_broken_budget(out: SchedulerOutput, message: str) -> None:
    s = _scheduler(max_num_seqs=2, max_num_batched_tokens=16)
    check_output(s, _out(("a", 8), ("b", 8)))  # at both limits: legal
    with pytest.raises(AssertionError) as err:
        check_output(s, out)
    assert str(err.value) == message


def test_diagnosis_of_an_empty_scheduler() -> None:
    s = _scheduler(block_size=4, num_gpu_blocks=24, prefill_watermark=1.0)
    assert diagnose_stall(s) == (
        "step 0: 0 running, 0 waiting, nothing schedulable\n"
        "KV cache: 24 blocks of 4 tokens, usage 0.000, 24 free (incl. evictable); "
        "prefill watermark 1.0 (role normal)\n"
        "no block holders"
    )


def test_diagnosis_names_the_head_of_waiting_and_the_five_largest_holders() -> None:
    """Six holders whose names sort differently from their sizes: the five largest are
    listed, largest first."""
    s = _scheduler(
        block_size=4,
        num_gpu_blocks=24,
        max_num_seqs=6,
        max_num_batched_tokens=128,
        prefill_watermark=0.9,
    )
    for i, (rid, n) in enumerate([("a", 4), ("b", 20), ("c", 8), ("d", 16), ("e", 12)]):
        s.add_request(_distinct(rid, n, 100 * (i + 1)))
    s.add_request(_distinct("f", 24, 700))
    s.add_request(_distinct("w", 10, 800))
    s.schedule()  # six start; w is held back by max_num_seqs
    assert diagnose_stall(s) == (
        "step 1: 6 running, 1 waiting, nothing schedulable\n"
        "KV cache: 24 blocks of 4 tokens, usage 0.875, 3 free (incl. evictable); "
        "prefill watermark 0.9 (role normal)\n"
        "head of waiting: 'w' status waiting, 10 tokens, 0 computed, holds 0 blocks, "
        "needs 3; chunked prefill in progress: False\n"
        "largest block holders: f=6, b=5, d=4, e=3, c=2"
    )


def test_diagnosis_of_a_chunked_prefill_in_progress_at_the_head() -> None:
    s = _scheduler(block_size=4, num_gpu_blocks=10, max_num_batched_tokens=8)
    s.add_request(_distinct("long", 37, 100))
    s.schedule()
    assert diagnose_stall(s) == (
        "step 1: 0 running, 1 waiting, nothing schedulable\n"
        "KV cache: 10 blocks of 4 tokens, usage 1.000, 0 free (incl. evictable); "
        f"prefill watermark {s.config.prefill_watermark} (role normal)\n"
        "head of waiting: 'long' status prefilling, 37 tokens, 8 computed, holds 10 "
        "blocks, needs 10; chunked prefill in progress: True\n"
        "largest block holders: long=10"
    )


def test_raise_stalled_carries_the_diagnosis() -> None:
    s = _scheduler(block_size=4, num_gpu_blocks=10, max_num_batched_tokens=8)
    s.add_request(_distinct("long", 37, 100))
    s.schedule()
    with pytest.raises(SchedulerStalled) as err:
        raise_stalled(s)
    assert str(err.value) == diagnose_stall(s)
