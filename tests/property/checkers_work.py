"""Work conservation (docs/design.md): the converse of every limit.

The limit checkers (checkers_kv) show that a step never does more than the rules
allow; `WorkConservation` shows it does all they allow. From the state just before
`schedule()` as the test itself kept it from the outputs (the QueueMirror's queues,
token counts, drafts and varlen history; the KVMirror's block tables and prefix dict,
never the scheduler's own structures, whose bugs would pass into the expectation) it
replays the rules by hand:

- running phase: running requests in order, each given min(its known tokens plus
  drafts not yet computed, the budget left, max_model_len minus computed), where
  drafts of steps in flight count as known and a step scheduled over one in flight
  verifies k placeholder drafts (docs/design.md, "Async scheduling"); when the free blocks do not
  cover a request's new blocks (plus the MTP drafter's lookahead slots), the newest
  running request is preempted (itself last), and only then;
- waiting phase: waiting requests in queue order while budget is left; a chunked
  prefill in progress continues (min(rest of its prompt, budget left)); any other
  request starts when nothing was preempted this step, fewer than max_num_seqs are
  running or mid-prefill, usage <= prefill_watermark (NORMAL role), the budget
  takes its whole prompt unless chunking, and the free blocks cover its prompt
  minus its prefix hits; its first chunk starts after exactly the hits the
  reference dict finds;
- queue order: the scheduler's waiting queue is the mirror's (chunked prefills in
  progress first; behind them fcfs puts preempted requests at the front, ahead of new
  ones in submission order, and priority orders them all by (priority, arrival,
  submission)).

The first disagreement with the step's output fails, naming the rule, the step and
the request. Rule names (`RULES`) select which ones a test asserts.
"""

from __future__ import annotations

from collections import Counter

from deepinfer.config import EngineRole
from deepinfer.kv_cache.manager import cdiv
from deepinfer.outputs import SchedulerOutput
from tests.property.harness import Driver, max_model_len, note
from tests.property.mirror import KVMirror
from tests.property.queue_mirror import QueueChecker, QueueView

RUNNING = "a running request is scheduled every step unless preempted or the budget is spent"
CHUNK = "a chunk is min(remaining work, remaining budget)"
PREEMPT = "preemption happens only when an allocation failed, newest running first"
HEAD = "the head of waiting is started when the rules allow it"
FCFS = "waiting requests are served in queue order"
QUEUE = "the waiting queue is in policy order"
PREFIX = "a cached prefix is hit"
BLOCKS = "a request holds the blocks its tokens need, no more"
RULES = (RUNNING, CHUNK, PREEMPT, HEAD, FCFS, QUEUE, PREFIX, BLOCKS)


def lookahead(d: Driver, end: int) -> int:
    """KV slots past a step ending at `end` tokens that the MTP drafter writes."""
    k = d.case.config.num_speculative_tokens
    return max(0, min(k - 1, max_model_len(d.case) - end))


class WorkConservation(QueueChecker):
    """Must come after the KVMirror in the driver's checker list (it reads the mirror's
    prefix dict and tables as they stand after the step's allocations); keeps its own
    QueueMirror."""

    def __init__(self, mirror: KVMirror, rules: tuple[str, ...] = RULES) -> None:
        super().__init__()
        self.mirror, self.rules = mirror, set(rules)

    def _fail(self, rule: str, out: SchedulerOutput, rid: str, what: str) -> None:
        if rule in self.rules:
            raise AssertionError(f"rule '{rule}': step {out.step_id}, request {rid}: {what}")

    def check_schedule(
        self, d: Driver, out: SchedulerOutput, view: QueueView, in_flight: bool
    ) -> None:
        got = {sr.req_id: sr for sr in out.scheduled}
        self._queue_order(d, view, out)
        self._blocks(d, out)
        budget = self._running_phase(d, view, out, got)
        if budget is not None:
            self._waiting_phase(d, view, out, got, budget)

    def _queue_order(self, d: Driver, view: QueueView, out: SchedulerOutput) -> None:
        """Before the step, the scheduler's waiting queue is the one the rules built
        from the outputs (the mirror's): prefills in progress, then the policy's order."""
        assert d.snap is not None
        actual = d.snap.waiting  # the scheduler's own queue: the thing checked
        if actual != view.waiting:
            rid = next(
                (a for a, b in zip(actual, view.waiting, strict=False) if a != b),
                (actual + view.waiting)[min(len(actual), len(view.waiting))],
            )
            policy = d.case.config.policy
            self._fail(QUEUE, out, rid, f"waiting {actual}, policy {policy} wants {view.waiting}")
        elif len(actual) > len(view.in_progress) + 1:
            note(f"the waiting queue held several requests in {d.case.config.policy} order")

    def _blocks(self, d: Driver, out: SchedulerOutput) -> None:
        """After the allocations, a scheduled request's table covers the tokens computed
        once the step is done, or its whole prompt while that is being prefilled (the
        first chunk reserves it), and not one block more."""
        bs = d.case.config.block_size
        for sr in out.scheduled:
            req = d.reqs[sr.req_id]
            reserve = req.num_tokens if sr.is_prompt else 0
            end = max(sr.num_computed_tokens + sr.num_tokens, reserve)
            # Plus the MTP drafter's slots past the step (docs/design.md, "Speculative decoding":
            # KV of chained drafts 1..k-1, never past max_model_len).
            want = cdiv(end + lookahead(d, end), bs)
            table = self.mirror.tables[sr.req_id]
            if len(table) != want:
                self._fail(
                    BLOCKS,
                    out,
                    sr.req_id,
                    f"holds {len(table)} blocks of {bs} tokens after computing "
                    f"{sr.num_computed_tokens} + {sr.num_tokens} (reserving {reserve}): "
                    f"want {want}",
                )
                return

    # ---- running requests ------------------------------------------------------------

    def _running_phase(
        self, d: Driver, view: QueueView, out: SchedulerOutput, got: dict
    ) -> int | None:
        """Replays the running phase; returns the budget left for waiting requests (None
        when a disagreement was found but not asserted: the rest cannot be replayed)."""
        cfg, bs, length = d.case.config, d.case.config.block_size, max_model_len(d.case)
        n = cfg.num_gpu_blocks
        assert n is not None
        tables = self.mirror.before
        refs = Counter(b for t in tables.values() for b in t)
        free = n - len(refs)
        budget = cfg.max_num_batched_tokens
        running, preempted = list(view.running), []
        lengths = view.lengths  # varlen: the mirror's choice from its own history
        i = 0
        while i < len(running) and budget > 0:
            rid = running[i]
            s = view.counts[rid]
            # docs/design.md, "Async scheduling": drafts of steps in flight count as
            # accepted, and a step scheduled over one in flight verifies k placeholder
            # drafts (the executor fills in the in-flight step's proposal).
            known = len(d.tokens(rid)) + s.placeholders + s.pending_drafts
            k = lengths.get(rid, 0) if lengths is not None else cfg.num_speculative_tokens
            if s.placeholders and k and view.proposals_in_flight is not None:
                k = min(k, view.proposals_in_flight)  # varlen: what the step in flight proposes
            ndrafts = k if s.placeholders and k else len(s.drafts[:k])
            num_new = min(known + ndrafts - s.computed, budget, length - s.computed)
            if num_new <= 0:
                i += 1
                continue
            end = s.computed + num_new
            need = max(cdiv(end + lookahead(d, end), bs) - len(tables[rid]), 0)
            while need > free:  # the allocation fails: free the newest running request
                victim = running.pop()
                preempted.append(victim)
                for b in tables[victim]:
                    refs[b] -= 1
                    free += refs[b] == 0
                if victim == rid:
                    break
            if preempted and preempted[-1] == rid:
                break
            sr = got.get(rid)
            if sr is None:
                if rid in out.preempted_req_ids:
                    self._fail(
                        PREEMPT,
                        out,
                        rid,
                        f"preempted, though {free} free blocks cover the {need} new blocks of "
                        f"{num_new} tokens it needs (running {running}, preempted {preempted})",
                    )
                else:
                    self._fail(
                        RUNNING,
                        out,
                        rid,
                        f"running, not preempted, {num_new} tokens of work and {budget} of "
                        f"budget left, but not scheduled",
                    )
                return None
            if sr.num_computed_tokens != s.computed:
                self._fail(
                    CHUNK,
                    out,
                    rid,
                    f"running, starts at {sr.num_computed_tokens} computed tokens; the "
                    f"outputs so far computed {s.computed}",
                )
                return None
            if sr.num_tokens != num_new:
                self._fail(
                    CHUNK,
                    out,
                    rid,
                    f"running, given {sr.num_tokens} tokens; its known tokens plus drafts "
                    f"({known} + {ndrafts}) minus computed ({s.computed}), the budget "
                    f"left ({budget}) and max_model_len ({length}) allow {num_new}",
                )
                return None
            free -= need
            budget -= num_new
            i += 1
        if set(preempted) != out.preempted_req_ids:
            extra = sorted(out.preempted_req_ids - set(preempted))
            self._fail(
                PREEMPT,
                out,
                ",".join(extra or sorted(preempted)),
                f"preempted {sorted(out.preempted_req_ids)}; failed allocations (newest "
                f"first) account for {preempted}",
            )
            return None
        if preempted:
            note("work conservation: a step preempted exactly as allocations required")
        return budget

    # ---- waiting requests ------------------------------------------------------------

    def _waiting_phase(
        self, d: Driver, view: QueueView, out: SchedulerOutput, got: dict, budget: int
    ) -> None:
        cfg, bs = d.case.config, d.case.config.block_size
        n = cfg.num_gpu_blocks
        assert n is not None
        running = set(view.running)
        seqs = len(view.running) - len(out.preempted_req_ids) + len(view.in_progress)
        served = [sr.req_id for sr in out.scheduled if sr.req_id not in running]
        twice = [rid for rid, k in Counter(served).items() if k > 1]
        if twice:
            self._fail(CHUNK, out, twice[0], f"two chunks in one step: served {served}")
            return
        order = [rid for rid in view.waiting if rid in served]
        if served != order or order != view.waiting[: len(order)]:
            skipped = next((r for r in view.waiting if r not in served), served[0])
            self._fail(FCFS, out, skipped, f"passed over: waiting {view.waiting}, served {served}")
            return
        for rid in order:
            sr, num_tokens = got[rid], len(d.tokens(rid))
            if rid not in view.in_progress:
                seqs += 1
                adm = next(a for a in self.mirror.admissions if a.req_id == rid)
                if not d.imports_kv(rid) and adm.start != len(adm.predicted) * bs:
                    self._fail(
                        PREFIX,
                        out,
                        rid,
                        f"started at {adm.start} computed tokens; the reference dict finds "
                        f"{len(adm.predicted)} cached blocks ({adm.predicted}) of {bs} tokens",
                    )
                    return
            want = min(num_tokens - sr.num_computed_tokens, budget)
            if sr.num_tokens != want:
                self._fail(
                    CHUNK,
                    out,
                    rid,
                    f"prompt chunk of {sr.num_tokens} tokens from {sr.num_computed_tokens} of "
                    f"{num_tokens}, with {budget} budget left: want {want}",
                )
                return
            budget -= want
        rest = view.waiting[len(order) :]
        if budget <= 0 or not rest:
            return
        self._head(d, view, out, rest[0], budget, seqs)

    def _head(
        self, d: Driver, view: QueueView, out: SchedulerOutput, rid: str, budget: int, seqs: int
    ) -> None:
        """`rid` is the first waiting request not served, with `budget` left: each rule
        that may hold it back must do so."""
        cfg, bs = d.case.config, d.case.config.block_size
        n = cfg.num_gpu_blocks
        assert n is not None
        if rid in view.in_progress:
            self._fail(HEAD, out, rid, f"chunked prefill in progress held back, {budget} left")
            return
        held = self.mirror.held()  # blocks held once the step's allocations are done
        usage = 1.0 - (n - len(held)) / n  # the core's formula, to the last bit
        tokens = d.tokens(rid)
        hits = self.mirror.prefix.lookup(rid, tokens)
        num_new = 1 if d.imports_kv(rid) else len(tokens) - len(hits) * bs
        need = cdiv(len(tokens) + lookahead(d, len(tokens)), bs) - len(hits)  # + MTP slots
        available = n - len(held) - sum(1 for b in hits if b not in held)
        reasons = [
            (bool(out.preempted_req_ids), "this step preempted"),
            (seqs >= cfg.max_num_seqs, f"{seqs} running or mid-prefill >= max_num_seqs"),
            (
                cfg.role is EngineRole.NORMAL and usage > cfg.prefill_watermark,
                f"usage {usage:.3f} > watermark",
            ),
            (
                not cfg.enable_chunked_prefill and num_new > budget,
                f"{num_new} prompt tokens > {budget} budget left, no chunking",
            ),
            (need > available, f"needs {need} blocks, {available} available"),
        ]
        why = [text for holds, text in reasons if holds]
        if why:
            note("work conservation: the head of waiting was held back by a rule")
            return
        self._fail(
            HEAD,
            out,
            rid,
            f"not started, though nothing was preempted, {seqs} < max_num_seqs="
            f"{cfg.max_num_seqs} are running or mid-prefill, usage {usage:.3f} <= watermark "
            f"{cfg.prefill_watermark} (role {cfg.role.value}), {budget} budget is left and "
            f"{available} available blocks cover the {need} its {len(tokens)} tokens need "
            f"beyond {len(hits)} cached blocks",
        )
