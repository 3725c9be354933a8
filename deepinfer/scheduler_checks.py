"""A scheduler checked from outside: its invariants, each step's budgets, and why it
stalled.

Functions over a `Scheduler` that read its state and change nothing. The engine runs
`check_output` and `check_invariants` after every step when asked
(`EngineCore(check_invariants=True)`), as the tests do, and raises `raise_stalled`'s
error when live requests have nothing schedulable.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, NoReturn

from deepinfer.errors import SchedulerStalled
from deepinfer.kv_cache.manager import cdiv
from deepinfer.outputs import SchedulerOutput
from deepinfer.request import RequestStatus

if TYPE_CHECKING:
    from deepinfer.scheduler import Scheduler

_WAITING_STATUSES = (RequestStatus.WAITING, RequestStatus.PREEMPTED, RequestStatus.PREFILLING)


def diagnose_stall(sched: Scheduler) -> str:
    """Why nothing can be scheduled: the head request, its blocks, usage, watermark."""
    cfg = sched.config
    head = sched.waiting.peek()
    lines = [
        f"step {sched.step_id}: {len(sched.running)} running, {len(sched.waiting)} waiting, "
        f"nothing schedulable",
        f"KV cache: {sched.kv.num_blocks} blocks of {sched.block_size} tokens, usage "
        f"{sched.kv.usage:.3f}, {sched.kv.pool.num_free_blocks} free (incl. evictable); "
        f"prefill watermark {cfg.prefill_watermark} (role {cfg.role.value})",
    ]
    if head is not None:
        held = len(sched.kv.block_ids(head.request_id))
        need = cdiv(head.num_tokens, sched.block_size)
        lines.append(
            f"head of waiting: {head.request_id!r} status {head.status.value}, "
            f"{head.num_tokens} tokens, {head.num_computed_tokens} computed, holds {held} "
            f"blocks, needs {need}; chunked prefill in progress: "
            f"{head.status is RequestStatus.PREFILLING}"
        )
    holders = sorted(sched.kv.req_blocks.items(), key=lambda kv: -len(kv[1]))[:5]
    lines.append(
        "largest block holders: " + ", ".join(f"{rid}={len(blocks)}" for rid, blocks in holders)
        if holders
        else "no block holders"
    )
    return "\n".join(lines)


def raise_stalled(sched: Scheduler) -> NoReturn:
    """Stop a scheduler that has live requests and nothing schedulable."""
    raise SchedulerStalled(diagnose_stall(sched))


def check_output(sched: Scheduler, out: SchedulerOutput) -> None:
    """Budgets of one step (docs/design.md, "Invariants")."""
    if out.num_batched_tokens > sched.config.max_num_batched_tokens:
        raise AssertionError(
            f"step {out.step_id}: {out.num_batched_tokens} tokens > max_num_batched_tokens"
        )
    if len(out.scheduled) > sched.config.max_num_seqs:
        raise AssertionError(f"step {out.step_id}: {len(out.scheduled)} requests > max_num_seqs")
    if len({s.req_id for s in out.scheduled}) != len(out.scheduled):
        raise AssertionError(f"step {out.step_id}: a request scheduled twice")


def check_invariants(sched: Scheduler) -> None:
    """Every block free or held, ref counts exact, each request in one place."""
    sched.kv.check_invariants()
    waiting_ids = [r.request_id for r in sched.waiting]
    running_ids = [r.request_id for r in sched.running]
    both = set(waiting_ids) & set(running_ids)
    if both:
        raise AssertionError(f"requests both waiting and running: {sorted(both)}")
    if len(set(waiting_ids)) != len(waiting_ids) or len(set(running_ids)) != len(running_ids):
        raise AssertionError("a request is queued twice")
    if set(waiting_ids) | set(running_ids) != set(sched.requests):
        raise AssertionError("live requests and queues disagree")
    for req in sched.running:
        if req.status is not RequestStatus.RUNNING:
            raise AssertionError(f"{req!r} in running with status {req.status}")
        if not sched.kv.holds_blocks(req.request_id):
            raise AssertionError(f"running {req!r} holds no blocks")
    for i, req in enumerate(sched.waiting):
        if req.status not in _WAITING_STATUSES:
            raise AssertionError(f"{req!r} in waiting with status {req.status}")
        prefilling = req.status is RequestStatus.PREFILLING
        if prefilling != (i < sched.waiting.num_in_progress):
            raise AssertionError(f"waiting {req!r}: chunked prefills in progress must lead")
        if sched.kv.holds_blocks(req.request_id) != prefilling:
            raise AssertionError(f"waiting {req!r}: holds blocks iff a prefill in progress")
    for req in sched.requests.values():
        limit = req.num_tokens + req.num_output_placeholders + req.num_pending_drafts
        if req.num_computed_tokens > limit:
            raise AssertionError(f"{req!r} computed more tokens than it has")
    accounted = (
        sched.num_finished
        + sched.num_aborted
        + sched.num_rejected
        + len(sched.waiting)
        + len(sched.running)
    )
    if accounted != sched.num_submitted:
        raise AssertionError(f"{sched.num_submitted} submitted but {accounted} accounted for")
