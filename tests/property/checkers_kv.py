"""Checkers of block safety, the prefix cache, step budgets and the prefill watermark.

Each reads the `KVMirror` (which must come first in the driver's checker list)
and raises AssertionError naming the step, the request and the block.
"""

from __future__ import annotations

from deepinfer.config import EngineRole
from deepinfer.outputs import ModelRunnerOutput, SchedulerOutput
from deepinfer.request import RequestStatus
from tests.property.harness import Checker, Driver, max_model_len, note
from tests.property.mirror import KVMirror
from tests.property.queue_mirror import QueueChecker, QueueView


class BlockSafety(Checker):
    """Ref counts equal holders; and under async scheduling, no block that the step in
    flight writes leaves its request before that step is processed: the slots of its
    tokens (below the computed count, after any rollback of rejected drafts) and the
    k - 1 slots past them where its drafter writes the chained drafts' KV. Which
    requests are still live and their computed counts come from the mirror (its tables
    and `comp`, kept from the outputs), never from the scheduler's requests."""

    def __init__(self, mirror: KVMirror) -> None:
        self.mirror = mirror
        self.sent: dict[str, list[int]] = {}  # the step in flight's tables, by request
        self.sent_step = -1

    def _check(self, d: Driver, when: str) -> None:
        pool, held = d.sched.kv.pool, self.mirror.held()
        for block in pool.blocks:
            n = held.get(block.block_id, 0)
            assert block.ref_cnt >= 0, f"{when}: {block} has a negative ref count"
            assert block.ref_cnt == n, f"{when}: {block} but {n} tables hold it"
        assert pool.num_free_blocks == pool.num_blocks - len(held), (
            f"{when}: {pool.num_free_blocks} free blocks, but {len(held)} of "
            f"{pool.num_blocks} are held"
        )

    def on_schedule(self, d: Driver, out: SchedulerOutput, in_flight: bool) -> None:
        self._check(d, f"step {out.step_id} scheduled")
        if d.case.config.async_scheduling:
            kv = d.sched.kv
            self.sent = {sr.req_id: kv.block_ids(sr.req_id) for sr in out.scheduled}
            self.sent_step = out.step_id

    def on_process(self, d: Driver, out: SchedulerOutput, res: ModelRunnerOutput) -> None:
        self._check(d, f"step {out.step_id} processed")
        if self.sent_step <= out.step_id:
            return  # the step just processed is the latest: nothing else in flight
        cfg = d.case.config
        k = cfg.num_speculative_tokens
        for rid, table in self.sent.items():
            if rid not in self.mirror.tables:
                continue  # ended: the step in flight's results for it are dropped
            written = min(self.mirror.comp[rid] + max(k - 1, 0), max_model_len(d.case))
            need = -(-written // cfg.block_size)
            held = d.sched.kv.block_ids(rid)
            assert held[:need] == table[:need], (
                f"step {out.step_id} processed: {rid} holds {held}, but step "
                f"{self.sent_step}, in flight, writes {written} slots of {table}"
            )

    def on_abort(self, d: Driver, req_id: str) -> None:
        self._check(d, f"abort of {req_id}")


class EndedHoldNothing(BlockSafety):
    def _check(self, d: Driver, when: str) -> None:
        for rid, req in d.reqs.items():
            if req.is_finished or req.status is RequestStatus.PREEMPTED:
                assert not d.sched.kv.holds_blocks(rid), f"{when}: {req!r} holds blocks"
                assert rid not in self.mirror.tables, f"{when}: outputs left {rid} a table"


class AllFreeAtEnd(Checker):
    def on_end(self, d: Driver) -> None:
        pool = d.sched.kv.pool
        assert pool.num_free_blocks == pool.num_blocks, "blocks still held at the end"
        for block in pool.blocks:
            assert block.ref_cnt == 0, f"at the end {block} is still referenced"
            if block.block_hash is not None:  # cached content stays findable (evictable)
                assert pool.lookup(block.block_hash) is block, f"{block} cached but unindexed"


class PrefixCache(Checker):
    def __init__(self, mirror: KVMirror) -> None:
        self.mirror = mirror
        self.num_hits = 0  # blocks reused across the run (to see that hits happen)

    def on_schedule(self, d: Driver, out: SchedulerOutput, in_flight: bool) -> None:
        for a in self.mirror.admissions:
            self.num_hits += a.hits
            where = f"step {out.step_id}, {a.req_id} ({a.num_tokens} tokens)"
            if not d.imports_kv(a.req_id):
                assert a.start % d.case.config.block_size == 0, f"{where}: hit not block-aligned"
                assert a.start <= a.num_tokens - 1, f"{where}: a hit covers {a.start} tokens"
                assert a.table[: a.hits] == a.predicted, (
                    f"{where}: reused blocks {a.table[: a.hits]}, the reference dict finds "
                    f"{a.predicted}"
                )
        assert not self.mirror.hit_mismatches, "\n".join(self.mirror.hit_mismatches)
        self._shared(d, f"step {out.step_id} scheduled")

    def on_process(self, d: Driver, out: SchedulerOutput, res: ModelRunnerOutput) -> None:
        self._shared(d, f"step {out.step_id} processed")

    def _shared(self, d: Driver, when: str) -> None:
        errors = self.mirror.shared_content_errors(d)
        assert not errors, f"{when}:\n" + "\n".join(errors[:5])


class Budgets(QueueChecker):
    """Token, sequence, draft and length budgets of each step; the requests that hold a
    sequence slot (running, or a chunked prefill in progress) and each request's limit on
    its computed count come from its QueueMirror, kept from the outputs."""

    def check_schedule(
        self, d: Driver, out: SchedulerOutput, view: QueueView, in_flight: bool
    ) -> None:
        cfg, where = d.case.config, f"step {out.step_id}"
        assert out.num_batched_tokens <= cfg.max_num_batched_tokens, f"{where}: token budget"
        assert len(out.scheduled) <= cfg.max_num_seqs, f"{where}: {len(out.scheduled)} requests"
        length = max_model_len(d.case)
        for sr in out.scheduled:
            ndraft = len(sr.draft_token_ids)
            assert ndraft <= cfg.num_speculative_tokens, f"{where}: {sr.req_id} {ndraft} drafts"
            assert sr.num_tokens > ndraft, f"{where}: {sr.req_id} scheduled only drafts"
            assert sr.num_computed_tokens + sr.num_tokens <= length, (
                f"{where}: {sr.req_id} computes past max_model_len={length}"
            )
        q = self.queues  # after this step: who holds a sequence slot
        seqs = len(q.running) + len(q.in_progress)
        assert seqs <= cfg.max_num_seqs, (
            f"{where}: {q.running} run and {q.in_progress} are mid-prefill, "
            f"max_num_seqs={cfg.max_num_seqs}"
        )
        self._computed(d, where, strict=False)

    def on_process(self, d: Driver, out: SchedulerOutput, res: ModelRunnerOutput) -> None:
        super().on_process(d, out, res)
        # With nothing in flight every scheduled token is known: computed <= tokens.
        self._computed(
            d, f"step {out.step_id} processed", strict=not d.case.config.async_scheduling
        )

    def _computed(self, d: Driver, where: str, strict: bool) -> None:
        """Each live request's computed count (the core's) within its known tokens, plus,
        while a step is in flight, the placeholders and unverified drafts the mirror
        counts for it."""
        for rid, c in self.queues.counts.items():
            req, known = d.reqs[rid], len(d.tokens(rid))
            limit = known if strict else known + c.placeholders + c.pending_drafts
            assert 0 <= req.num_computed_tokens <= limit, (
                f"{where}: {rid} has {req.num_computed_tokens} computed of {known} tokens, "
                f"{c.placeholders} placeholders and {c.pending_drafts} drafts in flight"
            )


class WatermarkNewPrompts(Checker):
    """NORMAL role: a prompt starts only while usage <= prefill_watermark."""

    def __init__(self, mirror: KVMirror) -> None:
        self.mirror = mirror

    def on_schedule(self, d: Driver, out: SchedulerOutput, in_flight: bool) -> None:
        cfg, n = d.case.config, d.case.config.num_gpu_blocks
        assert n is not None
        if cfg.role is not EngineRole.NORMAL:
            return
        for a in self.mirror.admissions:
            usage = 1.0 - (n - a.held_before) / n  # the core's formula, to the last bit
            assert usage <= cfg.prefill_watermark, (
                f"step {out.step_id}: {a.req_id} started a prompt at usage {usage:.3f} > "
                f"watermark {cfg.prefill_watermark}"
            )


class WatermarkExemption(QueueChecker):
    """The in-progress chunked prefill at the head of waiting is scheduled whenever
    the running requests leave budget over, after a preemption too (bug B1). Who is
    mid-prefill and who runs: its own QueueMirror, kept from the outputs."""

    def check_schedule(
        self, d: Driver, out: SchedulerOutput, view: QueueView, in_flight: bool
    ) -> None:
        cfg, snap, n = d.case.config, d.snap, d.case.config.num_gpu_blocks
        assert snap is not None and n is not None
        if not view.in_progress:
            return
        head, running = view.in_progress[0], set(view.running)
        used = sum(sr.num_tokens for sr in out.scheduled if sr.req_id in running)
        if used >= cfg.max_num_batched_tokens:
            return
        before = 1.0 - (n - len({b for t in snap.tables.values() for b in t})) / n  # for the note
        assert head in {sr.req_id for sr in out.scheduled}, (
            f"step {out.step_id}: in-progress prefill {head} held back with "
            f"{cfg.max_num_batched_tokens - used} tokens of budget left, usage "
            f"{before:.3f}, watermark {cfg.prefill_watermark}"
        )
        if before > cfg.prefill_watermark:
            note("an in-progress chunk continued above the watermark")
