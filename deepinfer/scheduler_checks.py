"""Scheduler introspection: the stall diagnosis and the invariant checks.

Kept apart from the scheduling rules as a base class of `Scheduler` (through
`SchedulerResults`; this module never imports either); the tests call these after every
step.
"""

from __future__ import annotations

from deepinfer.config import EngineConfig
from deepinfer.errors import SchedulerStalled
from deepinfer.kv_cache.manager import KVCacheManager, cdiv
from deepinfer.outputs import SchedulerOutput
from deepinfer.request import Request, RequestStatus
from deepinfer.request_queue import WaitingQueue

_WAITING_STATUSES = (RequestStatus.WAITING, RequestStatus.PREEMPTED, RequestStatus.PREFILLING)


class SchedulerChecks:
    """Read-only views of a scheduler's state: what `Scheduler` holds, checked."""

    config: EngineConfig
    block_size: int
    kv: KVCacheManager
    waiting: WaitingQueue
    running: list[Request]
    requests: dict[str, Request]
    step_id: int
    num_submitted: int
    num_finished: int
    num_aborted: int
    num_rejected: int

    def diagnose(self) -> str:
        """Why nothing can be scheduled: the head request, its blocks, usage, watermark."""
        cfg = self.config
        head = self.waiting.peek()
        lines = [
            f"step {self.step_id}: {len(self.running)} running, {len(self.waiting)} waiting, "
            f"nothing schedulable",
            f"KV cache: {self.kv.num_blocks} blocks of {self.block_size} tokens, usage "
            f"{self.kv.usage:.3f}, {self.kv.pool.num_free_blocks} free (incl. evictable); "
            f"prefill watermark {cfg.prefill_watermark} (role {cfg.role.value})",
        ]
        if head is not None:
            held = len(self.kv.block_ids(head.request_id))
            need = cdiv(head.num_tokens, self.block_size)
            lines.append(
                f"head of waiting: {head.request_id!r} status {head.status.value}, "
                f"{head.num_tokens} tokens, {head.num_computed_tokens} computed, holds {held} "
                f"blocks, needs {need}; chunked prefill in progress: "
                f"{head.status is RequestStatus.PREFILLING}"
            )
        holders = sorted(self.kv.req_blocks.items(), key=lambda kv: -len(kv[1]))[:5]
        lines.append(
            "largest block holders: " + ", ".join(f"{rid}={len(blocks)}" for rid, blocks in holders)
            if holders
            else "no block holders"
        )
        return "\n".join(lines)

    def raise_stalled(self) -> None:
        raise SchedulerStalled(self.diagnose())

    def check_output(self, out: SchedulerOutput) -> None:
        """Budgets of one step (docs/design.md, "Invariants")."""
        if out.num_batched_tokens > self.config.max_num_batched_tokens:
            raise AssertionError(
                f"step {out.step_id}: {out.num_batched_tokens} tokens > max_num_batched_tokens"
            )
        if len(out.scheduled) > self.config.max_num_seqs:
            raise AssertionError(
                f"step {out.step_id}: {len(out.scheduled)} requests > max_num_seqs"
            )
        if len({s.req_id for s in out.scheduled}) != len(out.scheduled):
            raise AssertionError(f"step {out.step_id}: a request scheduled twice")

    def check_invariants(self) -> None:
        """Every block free or held, ref counts exact, each request in one place."""
        self.kv.check_invariants()
        waiting_ids = [r.request_id for r in self.waiting]
        running_ids = [r.request_id for r in self.running]
        both = set(waiting_ids) & set(running_ids)
        if both:
            raise AssertionError(f"requests both waiting and running: {sorted(both)}")
        if len(set(waiting_ids)) != len(waiting_ids) or len(set(running_ids)) != len(running_ids):
            raise AssertionError("a request is queued twice")
        if set(waiting_ids) | set(running_ids) != set(self.requests):
            raise AssertionError("live requests and queues disagree")
        for req in self.running:
            if req.status is not RequestStatus.RUNNING:
                raise AssertionError(f"{req!r} in running with status {req.status}")
            if not self.kv.holds_blocks(req.request_id):
                raise AssertionError(f"running {req!r} holds no blocks")
        for i, req in enumerate(self.waiting):
            if req.status not in _WAITING_STATUSES:
                raise AssertionError(f"{req!r} in waiting with status {req.status}")
            prefilling = req.status is RequestStatus.PREFILLING
            if prefilling != (i < self.waiting.num_in_progress):
                raise AssertionError(f"waiting {req!r}: chunked prefills in progress must lead")
            if self.kv.holds_blocks(req.request_id) != prefilling:
                raise AssertionError(f"waiting {req!r}: holds blocks iff a prefill in progress")
        for req in self.requests.values():
            limit = req.num_tokens + req.num_output_placeholders + req.num_pending_drafts
            if req.num_computed_tokens > limit:
                raise AssertionError(f"{req!r} computed more tokens than it has")
        accounted = (
            self.num_finished
            + self.num_aborted
            + self.num_rejected
            + len(self.waiting)
            + len(self.running)
        )
        if accounted != self.num_submitted:
            raise AssertionError(f"{self.num_submitted} submitted but {accounted} accounted for")
