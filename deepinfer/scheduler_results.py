"""The scheduler's side after a step: applying its results (sampled tokens, accepted
drafts, a failed step undone) and ending requests (finished, aborted, rejected); with
them preemption by recompute and the drafter's lookahead, which scheduling uses too.

A base class of `Scheduler` (deepinfer/scheduler.py decides who computes what; this
module never imports it), over the state that `Scheduler.__init__` sets up.
"""

from __future__ import annotations

from deepinfer.config import EngineRole
from deepinfer.draft_plan import DraftPlan
from deepinfer.kv_cache.block_pool import KVBlock
from deepinfer.outputs import ModelRunnerOutput, SchedulerOutput
from deepinfer.request import FinishReason, Request, RequestStatus
from deepinfer.scheduler_checks import SchedulerChecks
from deepinfer.spec_policy import smooth_chances
from deepinfer.stop_checker import check_stop


class SchedulerResults(SchedulerChecks):
    """Results in, requests out: what `Scheduler` does once a step has run."""

    max_model_len: int
    num_preemptions: int
    prior_chances: list[float]
    num_draft_tokens: int
    num_accepted_drafts: int
    draft_position_stats: list[list[int]]
    _cached_ahead: dict[int, list[KVBlock]]
    varlen: DraftPlan | None
    _finished_since_last: set[str]
    _preempted_since_last: set[str]

    def _lookahead(self, num_tokens: int) -> int:
        """Slots past a step ending at `num_tokens` tokens that the MTP drafter writes: the
        KV of drafts 1..k-1, chained (never past max_model_len)."""
        k = self.config.num_speculative_tokens
        return max(0, min(k - 1, self.max_model_len - num_tokens))

    def _preempt(self, req: Request) -> None:
        """Preemption by recompute: free its blocks, back to the front of waiting."""
        self.running.remove(req)
        self.kv.free(req)
        req.status = RequestStatus.PREEMPTED
        req.num_computed_tokens = 0
        req.num_output_placeholders = 0
        req.num_pending_drafts = 0
        req.spec_token_ids = []
        req.spec_confidences = []
        req.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.add_preempted(req)
        self._preempted_since_last.add(req.request_id)

    def forget_unapplied_steps(self) -> None:
        """Every scheduled step whose results will never be applied (an interrupted
        engine discards them): the blocks they cached ahead leave the prefix cache."""
        for blocks in self._cached_ahead.values():
            self.kv.forget(blocks)
        self._cached_ahead.clear()
        if self.varlen is not None:
            self.varlen.forget_steps()

    def fail_step(self, outs: list[SchedulerOutput], errors: dict[str, str]) -> list[Request]:
        """Undo steps whose work the executor could not run (`outs`: the failed step, and
        the one scheduled after it under async scheduling). Requests in `errors` end as
        aborted with that reason; the steps' other requests are requeued for recompute
        (their blocks freed, as a preemption), so no bookkeeping of the failed steps
        remains. Returns the aborted requests."""
        aborted = []
        for out in outs:  # blocks the failed steps would have filled hold nothing
            self.kv.forget(self._cached_ahead.pop(out.step_id, ()))
        if self.varlen is not None:  # their times measure no step; no placeholder survives
            self.varlen.forget_steps([out.step_id for out in outs])
        # In schedule order (not a set's): requeued requests re-enter the waiting queue in
        # an order that does not depend on the process's string hashing.
        for req_id in dict.fromkeys(sr.req_id for out in outs for sr in out.scheduled):
            req = self.requests.get(req_id)
            if req is None:
                continue  # ended meanwhile
            if req_id in errors:
                req.reject_reason = errors[req_id]
                self._end(req, RequestStatus.ABORTED, FinishReason.ABORT)
                aborted.append(req)
            elif req.status is RequestStatus.RUNNING:
                self._preempt(req)
            elif req.status is RequestStatus.PREFILLING:  # mid-chunk: start over
                self.waiting.remove(req)
                self.kv.free(req)
                req.status = RequestStatus.PREEMPTED
                req.num_computed_tokens = 0
                self.waiting.add_preempted(req)
                self._preempted_since_last.add(req_id)
        return aborted

    def update_from_output(self, out: SchedulerOutput, res: ModelRunnerOutput) -> list[Request]:
        """Apply a step's sampled tokens; returns the requests that gained tokens or ended."""
        changed: list[Request] = []
        for step_id in [s for s in self._cached_ahead if s <= out.step_id]:
            del self._cached_ahead[step_id]  # the step ran: its blocks hold their content
        live, sampled = self.requests, res.sampled_token_ids
        is_prefill_role = self.config.role is EngineRole.PREFILL
        k = self.config.num_speculative_tokens
        completed = res.completed_req_ids
        for sr in out.scheduled:
            req = live.get(sr.req_id)
            if req is not None and res.prompt_logprobs and sr.req_id in res.prompt_logprobs:
                req.prompt_logprobs.update(res.prompt_logprobs[sr.req_id])
            if req is None or not sr.samples:
                continue  # ended while the step was in flight, or a partial prompt chunk
            preempted_meanwhile = req.status is not RequestStatus.RUNNING
            if not preempted_meanwhile:
                req.num_output_placeholders -= 1
            tokens = sampled.get(sr.req_id) or []
            if not tokens:
                raise RuntimeError(
                    f"executor returned no token for {sr.req_id!r} in step "
                    f"{out.step_id}, which was scheduled to sample"
                )
            num_rejected = len(sr.draft_token_ids) - (len(tokens) - 1)
            if num_rejected < 0:
                raise RuntimeError(
                    f"executor returned {len(tokens)} tokens for {sr.req_id!r} "
                    f"with only {len(sr.draft_token_ids)} drafts to verify"
                )
            self._count_acceptance(len(sr.draft_token_ids), len(tokens) - 1)
            if not preempted_meanwhile:
                req.num_computed_tokens -= num_rejected
                req.num_pending_drafts -= len(sr.draft_token_ids)
            reason = None
            logprobs = res.logprobs.get(sr.req_id) if res.logprobs else None
            for j, t in enumerate(tokens):
                req.output_token_ids.append(t)
                if logprobs is not None and j < len(logprobs):
                    req.logprobs.append(logprobs[j])
                reason = check_stop(req, self.max_model_len)
                if reason is None and completed and j == len(tokens) - 1 and sr.req_id in completed:
                    reason = FinishReason.STOP  # its grammar allows nothing more
                if reason is None and is_prefill_role:
                    reason = FinishReason.LENGTH  # a prefill engine hands over after one token
                if reason is not None:
                    break
            changed.append(req)
            if reason is not None:
                self._end(req, RequestStatus.FINISHED, reason)
                continue
            if not preempted_meanwhile:
                if k:
                    req.spec_token_ids = list(res.draft_token_ids.get(sr.req_id, ()))[:k]
                    req.spec_confidences = list(res.draft_confidences.get(sr.req_id, ()))[:k]
                    req.spec_chance_means = smooth_chances(
                        req.spec_chance_means, req.spec_confidences
                    )
                    if req.spec_confidences:
                        self.prior_chances = smooth_chances(
                            self.prior_chances, req.spec_confidences
                        )
                self.kv.cache_computed(req)
                if num_rejected:
                    end = max(req.num_computed_tokens, req.num_tokens + req.num_output_placeholders)
                    self.kv.trim(req, end + self._lookahead(end))
        return changed

    def _count_acceptance(self, num_drafts: int, num_accepted: int) -> None:
        self.num_draft_tokens += num_drafts
        self.num_accepted_drafts += num_accepted
        stats = self.draft_position_stats
        while len(stats) < num_drafts:
            stats.append([0, 0])
        for j in range(min(num_drafts, num_accepted + 1)):
            stats[j][0] += 1
            stats[j][1] += j < num_accepted

    def finish_request(self, req_id: str, reason: FinishReason) -> Request | None:
        """End a live request from outside (a stop string, a client abort)."""
        req = self.requests.get(req_id)
        if req is None:
            return None
        status = RequestStatus.ABORTED if reason is FinishReason.ABORT else RequestStatus.FINISHED
        self._end(req, status, reason)
        return req

    def abort(self, req_id: str) -> Request | None:
        return self.finish_request(req_id, FinishReason.ABORT)

    def reject(self, req_id: str, reason: str) -> Request | None:
        """Reject a request that waits and was never scheduled (its grammar failed to
        compile): it ends as if `add_request` had refused it."""
        req = self.requests.get(req_id)
        if req is None:
            return None
        if req.num_computed_tokens or req.status is not RequestStatus.WAITING:
            raise ValueError(f"reject({req_id!r}): only a request never scheduled can be rejected")
        req.reject_reason = reason
        self._end(req, RequestStatus.REJECTED, FinishReason.REJECTED)
        return req

    def _end(self, req: Request, status: RequestStatus, reason: FinishReason) -> None:
        if req.status is RequestStatus.RUNNING:
            self.running.remove(req)
        else:
            self.waiting.remove(req)
        self.kv.free(req)
        req.status = status
        req.finish_reason = reason
        req.num_output_placeholders = 0
        del self.requests[req.request_id]
        if status is RequestStatus.ABORTED:
            self.num_aborted += 1
        elif status is RequestStatus.REJECTED:
            self.num_rejected += 1
        else:
            self.num_finished += 1
        self._finished_since_last.add(req.request_id)
