"""The scheduler: who computes how many tokens each step, and what a step's results do.

There is no prefill phase: each step gives every chosen request some tokens,
and `num_computed_tokens` catches up with `num_tokens`. Running requests are
served first (decodes, draft verification), then the waiting queue in order.
docs/design.md ("Scheduling rules") is the specification; rule names below follow it.

The class reads in the order a request meets it: construction; admission (a request
queued or rejected, or ended from outside); scheduling (`schedule` and its helpers,
preemption by recompute and the drafter's lookahead among them); then a step's results
applied (sampled tokens, accepted drafts, a failed or discarded step undone, requests
ended). The invariant checks and the stall diagnosis read a scheduler from outside:
deepinfer/scheduler_checks.py.
"""

from __future__ import annotations

import bisect
import logging
from collections.abc import Sequence
from dataclasses import dataclass, field

from deepinfer.config import EngineConfig, EngineRole
from deepinfer.decode_run import AdvancedRun, DecodeRun
from deepinfer.draft_plan import DraftPlan
from deepinfer.kv_cache.block_pool import KVBlock
from deepinfer.kv_cache.manager import KVCacheManager, TierHit, cdiv
from deepinfer.kv_cache.tiers import KVTiers
from deepinfer.outputs import (
    DRAFT_PLACEHOLDER,
    ModelRunnerOutput,
    ScheduledRequest,
    SchedulerOutput,
)
from deepinfer.request import FinishReason, Request, RequestStatus
from deepinfer.request_queue import WaitingQueue
from deepinfer.spec_policy import smooth_chances
from deepinfer.stop_checker import check_stop

logger = logging.getLogger(__name__)


class Scheduler:
    def __init__(
        self,
        config: EngineConfig,
        num_gpu_blocks: int,
        *,
        model_max_len: int | None = None,
        emit_token_ids: bool = False,
        vocab_size: int | None = None,
        kv_tiers: KVTiers | None = None,
    ) -> None:
        self.config = config
        self.block_size = config.block_size
        self.kv = KVCacheManager(
            num_gpu_blocks, config.block_size, config.enable_prefix_caching, kv_tiers
        )
        self.max_model_len = _effective_max_model_len(config, num_gpu_blocks, model_max_len)
        self.emit_token_ids = emit_token_ids  # the executor needs token ids (a real model)
        self.vocab_size = vocab_size  # prompts' token ids are checked against it
        self.waiting = WaitingQueue(config.policy)
        self.running: list[Request] = []
        self.requests: dict[str, Request] = {}  # live (waiting or running) requests
        self.step_id = 0
        self.num_submitted = 0
        self.num_finished = 0
        self.num_aborted = 0
        self.num_rejected = 0
        self.num_preemptions = 0
        self._draft_lengths: dict[str, int] | None = None  # varlen: this step's draft lengths
        # Varlen's plan across steps: draft lengths, proposals, measured step times.
        k = config.num_speculative_tokens
        self.draft_plan = DraftPlan(k) if config.enable_mtp_varlen and k else None
        # Varlen: the running mean chances by position over every request's proposals
        # (spec_policy.smooth_chances): they judge a request's first unseen drafts, under
        # async scheduling, before it has means of its own.
        self.prior_chances: list[float] = []
        # step_id -> blocks its allocations cached before it ran (kv.take_cached_ahead)
        self._cached_ahead: dict[int, list[KVBlock]] = {}
        self.num_draft_tokens = 0  # drafts verified (speculation)
        self.num_accepted_drafts = 0
        # By draft position j: [verified drafts at j whose drafts before j were all
        # accepted, of them accepted] (conditional acceptance: sim/acceptance.py)
        self.draft_position_stats: list[list[int]] = []
        self._finished_since_last: set[str] = set()
        self._preempted_since_last: set[str] = set()
        # Role decode: requests whose blocks are reserved for a KV on its way (or arrived,
        # not scheduled yet) -> the prefix blocks this engine had cached of its prompt.
        self._kv_reserved: dict[str, int] = {}

    # ---- admission -------------------------------------------------------------------

    def rejection_reason(self, req: Request) -> str | None:
        """Why `req` can never be served, or None. Checked before it is queued."""
        n = req.num_prompt_tokens
        capacity = self.kv.num_blocks * self.block_size
        if n == 0:
            return "empty prompt: at least one prompt token is needed"
        if n + 1 > capacity:
            return (
                f"prompt of {n} tokens plus one output token needs {cdiv(n + 1, self.block_size)} "
                f"KV blocks of {self.block_size} tokens, but the whole cache holds "
                f"{self.kv.num_blocks} blocks ({capacity} tokens)"
            )
        if n + 1 > self.max_model_len:
            return (
                f"prompt of {n} tokens plus one output token exceeds max_model_len="
                f"{self.max_model_len}"
            )
        if self.vocab_size is not None and isinstance(req.prompt, (list, tuple)):
            bad = next((t for t in req.prompt if not 0 <= t < self.vocab_size), None)
            if bad is not None:
                return f"prompt token id {bad} is outside the vocabulary [0, {self.vocab_size})"
        if not self.config.enable_chunked_prefill and n > self.config.max_num_batched_tokens:
            return (
                f"prompt of {n} tokens exceeds max_num_batched_tokens="
                f"{self.config.max_num_batched_tokens} and chunked prefill is disabled"
            )
        return None

    @property
    def max_prompt_tokens(self) -> int:
        """The longest prompt `rejection_reason` lets in (one output token must fit too)."""
        longest = min(self.kv.num_blocks * self.block_size, self.max_model_len) - 1
        if not self.config.enable_chunked_prefill:
            longest = min(longest, self.config.max_num_batched_tokens)
        return longest

    def add_request(self, req: Request) -> str | None:
        """Queue `req`, or reject it (returns the reason; it never enters the queues)."""
        if req.request_id in self.requests:
            raise ValueError(f"request id {req.request_id!r} is already in the engine")
        if req.awaiting_kv and self.config.role is not EngineRole.DECODE:
            raise ValueError(
                f"request {req.request_id!r} awaits its prompt's KV, but only a decode "
                f"engine imports one (this engine's role is {self.config.role.value!r})"
            )
        self.num_submitted += 1
        reason = self.rejection_reason(req)
        if reason is not None:
            req.status = RequestStatus.REJECTED
            req.finish_reason = FinishReason.REJECTED
            req.reject_reason = reason
            self.num_rejected += 1
            return reason
        self.requests[req.request_id] = req
        self.waiting.add(req)
        return None

    def kv_arrived(self, req_id: str) -> None:
        """The prompt's KV of `req_id`, whose blocks were reserved (`kv_reserved`), has
        arrived: it is scheduled from the next step on, ahead of new starts."""
        req = self.requests.get(req_id)
        if req is None or req_id not in self._kv_reserved or not req.awaiting_kv:
            raise ValueError(f"kv_arrived({req_id!r}): no reserved request awaits that KV")
        req.awaiting_kv = False

    @property
    def num_awaiting_kv(self) -> int:
        """Requests holding reserved blocks whose KV has not arrived: work that waits on
        the sender, not on this engine (no stall while there are any)."""
        return sum(self.requests[r].awaiting_kv for r in self._kv_reserved)

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

    # ---- scheduling ------------------------------------------------------------------

    def schedule(self) -> SchedulerOutput:
        step = _StepPlan(self.config.max_num_batched_tokens)
        self._draft_lengths = None
        if self.draft_plan is not None:
            self._draft_lengths = self.draft_plan.choose(self.running, self.prior_chances)
        self._schedule_running(step)
        self._schedule_waiting(step)
        self.step_id += 1
        ahead = self.kv.take_cached_ahead()
        if ahead:  # unwritten until the step runs: forgotten if it fails (fail_step)
            self._cached_ahead[self.step_id] = ahead
        out = SchedulerOutput(
            self.step_id, step.scheduled, self._finished_since_last, self._preempted_since_last
        )
        if step.kv_reserved:
            out.kv_reserved = tuple(step.kv_reserved)
        if self.kv.tiers is not None:
            out.kv_loads = tuple(self.kv.take_loads())
            if step.scheduled:  # (an empty step is never launched: the next one copies them)
                out.kv_saves = tuple(self.kv.take_saves())
        if self.draft_plan is not None and step.scheduled:
            self.draft_plan.plan_proposals(out)
        if step.scheduled:  # an empty step is never launched: the next one tells the
            # executor which requests ended (else it would hold their state for good; a
            # preempted one's state is rebuilt when it resumes, or dropped when it ends)
            self._finished_since_last = set()
        self._preempted_since_last = set()
        return out

    def _schedule_running(self, step: _StepPlan) -> None:
        """Running requests, oldest first; the newest is preempted when blocks run out."""
        running, allocate, max_len = self.running, self.kv.allocate, self.max_model_len
        spec_k, draft_lengths = self.config.num_speculative_tokens, self._draft_lengths
        i = 0
        while i < len(running) and step.budget > 0:
            req = running[i]
            # With steps in flight, assume all their drafts are accepted (the executor
            # knows the truth and shifts; update_from_output corrects the count).
            num_known = req.num_tokens + req.num_output_placeholders + req.num_pending_drafts
            k = spec_k if draft_lengths is None else draft_lengths.get(req.request_id, 0)
            drafts = req.spec_token_ids[:k]
            if req.num_output_placeholders and k:
                # The step in flight proposes this step's drafts: the executor fills them.
                if self.draft_plan is not None and self.draft_plan.proposals_in_flight is not None:
                    k = min(k, self.draft_plan.proposals_in_flight)
                drafts = [DRAFT_PLACEHOLDER] * k
            computed = req.num_computed_tokens
            num_new = min(num_known + len(drafts) - computed, step.budget, max_len - computed)
            if num_new <= 0:
                i += 1
                continue
            num_drafts = max(0, min(len(drafts), num_new - (num_known - computed))) if drafts else 0
            lookahead = self._lookahead(computed + num_new) if spec_k else 0  # (no drafter)
            while (
                blocks := allocate(
                    req, num_new, num_draft_tokens=num_drafts, num_lookahead_tokens=lookahead
                )
            ) is None:
                victim = self.running[-1]
                self._preempt(victim)
                step.num_preempted += 1
                if victim is req:
                    break
            if blocks is None:
                break
            # inlined step.add: this loop runs once per running request per step
            step.scheduled.append(
                self._schedule_one(req, num_new, blocks, drafts[:num_drafts], False)
            )
            step.budget -= num_new
            i += 1

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

    def _schedule_waiting(self, step: _StepPlan) -> None:
        """The waiting queue in order: chunked prefills in progress first, then new starts."""
        while step.budget > 0 and (req := self.waiting.peek()) is not None:
            if req.status is RequestStatus.PREFILLING:
                scheduled = self._continue_prefill(req, step)
            else:
                scheduled = self._start(req, step)
            if not scheduled:
                return

    def _continue_prefill(self, req: Request, step: _StepPlan) -> bool:
        """The next chunk of a prompt whose blocks were reserved with its first chunk.

        Exempt from the watermark, the sequence limit and the after-preemption stop: it
        needs no new blocks, and holding it back would leave a step empty when a running
        request preempted itself for its room.
        """
        num_new = min(req.num_tokens - req.num_computed_tokens, step.budget)
        reserve = req.num_tokens + self._lookahead(req.num_tokens)
        blocks = self.kv.allocate(req, num_new, reserve_tokens=reserve)
        if blocks is None:
            return False
        self.waiting.pop()
        num_cached = self._kv_reserved.pop(req.request_id, None)
        if num_cached is None:
            step.add(self._schedule_one(req, num_new, blocks, [], is_prompt=True))
        else:  # its KV arrived into the blocks reserved for it: its first step here
            sr = self._schedule_one(req, num_new, blocks, [], False, resumed=True)
            sr.num_cached_blocks = num_cached
            step.add(sr)
        self._after_prompt_chunk(req)
        return True

    def _start_held_back(self) -> bool:
        """No waiting request may start now: the sequence limit, or usage past the
        watermark. Both hold for the whole of a decode run where a request waits (then no
        request ends before the run's last step, and blocks are only taken); a run that goes
        on past finishes has no waiting request to hold back."""
        cfg = self.config
        if len(self.running) + self.waiting.num_in_progress >= cfg.max_num_seqs:
            return True
        return cfg.role is EngineRole.NORMAL and self.kv.usage > cfg.prefill_watermark

    def _start(self, req: Request, step: _StepPlan) -> bool:
        """First chunk of a new or preempted request (docs/design.md, "Starting a waiting request")."""
        cfg = self.config
        if step.num_preempted or self._start_held_back():
            return False
        # Prompt logprobs need every prompt token computed: no prefix-cache hit (as vLLM).
        wants_prompt_logprobs = req.sampling_params.prompt_logprobs is not None
        cached = [] if wants_prompt_logprobs else self.kv.find_cached_prefix(req)
        # A decode engine's request arrives with its prompt's KV, once: one it preempted
        # lost that KV (and its outputs') and is recomputed like any other.
        imports_kv = cfg.role is EngineRole.DECODE and req.status is RequestStatus.WAITING
        # Prefix blocks past the HBM hits found in the lower tiers: loaded, not computed.
        # Hits count where they spare computation (not where the prompt's KV arrives).
        takes_hits = not wants_prompt_logprobs and not imports_kv
        loads: list[TierHit] = []
        if takes_hits and self.kv.tiers is not None:
            loads = self.kv.find_tier_hits(req, len(cached))
        num_computed = (len(cached) + len(loads)) * self.block_size
        if imports_kv:
            num_computed = req.num_tokens - 1  # its prompt's KV arrived with it
        num_new = req.num_tokens - num_computed
        if num_new > step.budget and not cfg.enable_chunked_prefill:
            return False
        num_new = min(num_new, step.budget)
        # The first chunk reserves the blocks of the whole prompt.
        reserve = req.num_tokens + self._lookahead(req.num_tokens)
        blocks = self.kv.allocate(req, num_new, cached, reserve_tokens=reserve, loads=loads)
        if blocks is None:
            return False
        self.waiting.pop()
        if imports_kv and req.awaiting_kv:
            self._reserve_for_kv(req, len(cached), step)
            return True
        if takes_hits:
            self.kv.count_lookup(req, len(cached), loads)
        req.num_computed_tokens = num_computed
        if req.num_cached_tokens < 0:
            req.num_cached_tokens = (len(cached) + len(loads)) * self.block_size
        sr = self._schedule_one(req, num_new, blocks, [], not imports_kv, resumed=True)
        sr.num_cached_blocks = len(cached) + len(loads)
        step.add(sr)
        self._after_prompt_chunk(req)
        return True

    def _reserve_for_kv(self, req: Request, num_cached: int, step: _StepPlan) -> None:
        """`req`'s blocks are held (its whole prompt's, as a start takes them) for a KV
        on its way: it waits in progress, passed over, until `kv_arrived`. Its KV lands
        in them, so its prompt counts as computed but its last token."""
        req.num_computed_tokens = req.num_tokens - 1
        if req.num_cached_tokens < 0:
            req.num_cached_tokens = num_cached * self.block_size
        req.status = RequestStatus.PREFILLING
        self.waiting.add_in_progress(req)
        self._kv_reserved[req.request_id] = num_cached
        step.kv_reserved.append(req.request_id)

    def _after_prompt_chunk(self, req: Request) -> None:
        if req.num_computed_tokens < req.num_tokens:
            req.status = RequestStatus.PREFILLING
            self.waiting.add_in_progress(req)
        else:
            req.status = RequestStatus.RUNNING
            self.running.append(req)

    def _schedule_one(
        self,
        req: Request,
        num_new: int,
        blocks: list,
        drafts: list[int],
        is_prompt: bool,
        resumed: bool = False,
    ) -> ScheduledRequest:
        start = req.num_computed_tokens
        table = self.kv.block_ids(req.request_id) if resumed else None
        token_ids = prior = prompt = None
        if self.emit_token_ids:
            token_ids = req.token_ids(start, min(start + num_new, req.num_tokens))
            if drafts[:1] != [DRAFT_PLACEHOLDER]:
                token_ids += drafts
            if resumed:
                prior = req.token_ids(0, start)
                if req.sampling_params.prompt_logprobs is not None:
                    prompt = req.token_ids(0, req.num_prompt_tokens)
        computed = req.num_computed_tokens = start + num_new
        if computed > req.max_computed_tokens:
            req.max_computed_tokens = computed
        will_sample = computed >= req.num_tokens + req.num_output_placeholders
        if will_sample:
            req.num_output_placeholders += 1
        if req.spec_token_ids:  # (this step verifies them, or they were not taken)
            req.spec_token_ids = []
        req.num_pending_drafts += len(drafts)
        # Every field, positional (this runs for every request of every single step):
        # req_id, num_tokens, num_computed_tokens, is_prompt, will_sample, new_block_ids,
        # num_prior_blocks, block_table, token_ids, draft_token_ids (`drafts`, a list of
        # its own: each caller makes it), sampling_params, prior_token_ids,
        # prompt_token_ids, num_prompt_tokens, num_cached_blocks, structured.
        return ScheduledRequest(
            req.request_id, num_new, start, is_prompt, will_sample,
            [b.block_id for b in blocks] if blocks else [],
            len(self.kv.req_blocks[req.request_id]) - len(blocks),
            table, token_ids, drafts, req.sampling_params if resumed else None,
            prior, prompt, req.num_prompt_tokens, 0, req.structured,
        )  # fmt: skip

    # ---- a step's results ------------------------------------------------------------

    def update_from_output(self, out: SchedulerOutput, res: ModelRunnerOutput) -> list[Request]:
        """Apply a step's sampled tokens; returns the requests that gained tokens or ended."""
        changed: list[Request] = []
        for step_id in [s for s in self._cached_ahead if s <= out.step_id]:
            del self._cached_ahead[step_id]  # the step ran: its blocks hold their content
        live, sampled = self.requests, res.sampled_token_ids
        is_prefill_role = self.config.role is EngineRole.PREFILL
        running = RequestStatus.RUNNING
        k = self.config.num_speculative_tokens
        completed = res.completed_req_ids
        for sr in out.scheduled:
            req = live.get(sr.req_id)
            if req is not None and res.prompt_logprobs and sr.req_id in res.prompt_logprobs:
                req.prompt_logprobs.update(res.prompt_logprobs[sr.req_id])
            if req is None or not sr.will_sample:
                continue  # ended while the step was in flight, or a partial prompt chunk
            preempted_meanwhile = req.status is not running
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
            if sr.draft_token_ids:  # (else one token: nothing to count)
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

    def observe_step_time(self, step_id: int, seconds: float) -> None:
        """A step's measured duration (wall time, or the simulator's): varlen prices its
        draft lengths from these (DraftPlan.observe_step_time)."""
        if self.draft_plan is not None:
            self.draft_plan.observe_step_time(step_id, seconds)

    def fail_step(self, outs: list[SchedulerOutput], errors: dict[str, str]) -> list[Request]:
        """Undo steps whose work the executor could not run (`outs`: the failed step, and
        the one scheduled after it under async scheduling). Requests in `errors` end as
        aborted with that reason; the steps' other requests are requeued for recompute
        (their blocks freed, as a preemption), so no bookkeeping of the failed steps
        remains. Returns the aborted requests."""
        aborted = []
        for out in outs:  # blocks the failed steps would have filled hold nothing
            self.kv.forget(self._cached_ahead.pop(out.step_id, ()))
        if self.draft_plan is not None:  # their times measure no step; no placeholder survives
            self.draft_plan.forget_steps([out.step_id for out in outs])
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

    def forget_unapplied_steps(self) -> None:
        """Every scheduled step whose results will never be applied (an interrupted
        engine discards them): the blocks they cached ahead leave the prefix cache."""
        for blocks in self._cached_ahead.values():
            self.kv.forget(blocks)
        self._cached_ahead.clear()
        if self.draft_plan is not None:
            self.draft_plan.forget_steps()

    def _end(self, req: Request, status: RequestStatus, reason: FinishReason) -> None:
        if req.status is RequestStatus.RUNNING:
            self.running.remove(req)
        else:
            self.waiting.remove(req)
        self.kv.free(req)
        req.status = status
        req.finish_reason = reason
        req.num_output_placeholders = 0
        req.awaiting_kv = False
        self._kv_reserved.pop(req.request_id, None)
        del self.requests[req.request_id]
        if status is RequestStatus.ABORTED:
            self.num_aborted += 1
        elif status is RequestStatus.REJECTED:
            self.num_rejected += 1
        else:
            self.num_finished += 1
        self._finished_since_last.add(req.request_id)

    # ---- decode runs (fast-forward) ---------------------------------------------------

    def decode_run(
        self, in_flight: SchedulerOutput | None, through_finishes: bool = False
    ) -> DecodeRun | None:
        """The steps from here that are certain to schedule every running request, in
        order, one decode token each (docs/design.md, "Fast-forward"), or None.

        Certain from this state alone: each request decodes (its known tokens one past
        its computed ones; `in_flight`: under async scheduling, the step in flight, which
        must sample one token of each of the same requests (a decode, or a prompt's last
        chunk), beside requests that ended since it was scheduled); none can end but by
        length (no stop token or EOS, which only its tokens decide: it ends at the step
        that applies its max_tokens-th token or reaches max_model_len); the token budget
        holds them all; no waiting request can start (none waits, or `_start_held_back`);
        and the free blocks cover every block the steps take. The run ends where the
        first request ends, unless `through_finishes` (the driver reads nothing between
        steps) and nothing waits: then the others go on, their batch one smaller, as the
        freed room starts no one. Speculation, a prefill engine and executors that need
        token ids run single steps.
        """
        cfg = self.config
        running = self.running
        n = len(running)
        if (
            not n
            or n > cfg.max_num_batched_tokens
            or cfg.num_speculative_tokens
            or cfg.role is EngineRole.PREFILL
            or self.emit_token_ids
        ):
            return None
        # Requests reserved for a KV on its way are passed over until it arrives (an
        # arrival ends the run: the engine's driver knows when); any other in progress
        # is scheduled, and a waiting one may start.
        awaiting = self.num_awaiting_kv if self._kv_reserved else 0
        if self.waiting.num_in_progress > awaiting:
            return None
        if (
            len(self.waiting) > awaiting
            and n < cfg.max_num_batched_tokens
            and not self._start_held_back()
        ):
            return None
        placeholders = 0
        if in_flight is not None:  # its requests still live, in order: the running ones
            placeholders = 1
            live = self.requests
            flight = [sr for sr in in_flight.scheduled if sr.req_id in live]
            if len(flight) != n:
                return None
            for sr, req in zip(flight, running):
                # Its one token, or the prompt chunk that completed it: a sampled token
                # either way, applied before the run's second step is scheduled.
                if (
                    sr.req_id != req.request_id
                    or not sr.will_sample
                    or sr.draft_token_ids
                    or (sr.num_tokens != 1 and not sr.is_prompt)
                ):
                    return None
        max_len = self.max_model_len
        horizon = max_len
        contexts = []
        limits = []
        for req in running:
            sp = req.sampling_params
            if (
                req.structured
                or req.spec_token_ids
                or req.num_pending_drafts
                or sp.stop
                or sp.stop_token_ids
                or (not sp.ignore_eos and req.eos_token_id is not None)
            ):
                return None
            outputs = len(req.output_token_ids)
            c, t = req.num_computed_tokens, req.num_prompt_tokens + outputs  # (num_tokens)
            if req.num_output_placeholders != placeholders or t + placeholders - c != 1:
                return None
            # The run's step s applies its (outputs + s + 1)-th token: the step that ends
            # it by length may be the run's last.
            h = max_len - t
            if sp.max_tokens is not None and sp.max_tokens - outputs < h:
                h = sp.max_tokens - outputs
            if h < horizon:
                horizon = h
            contexts.append(c)
            limits.append(h)
        if horizon < 1:
            return None
        if through_finishes and not self.waiting:
            horizon = max(limits)
        # Step s writes position c + s: a new block where that is the first slot past
        # the blocks held (in its steps, s < its limit). The step of the (free + 1)-th
        # new block cannot be certain (blocks freed by a request ending are not counted).
        bs = self.block_size
        new_blocks: list[int] = []
        for req, c, h in zip(running, contexts, limits):
            held = len(self.kv.req_blocks[req.request_id])
            new_blocks.extend(range(held * bs - c, h if h < horizon else horizon, bs))
        pool = self.kv.pool
        free = pool.num_free_blocks
        if self.kv.tiers is not None and self.kv.tiers.store is not None:
            # The store is shared: the other engines read it between this one's steps, so
            # a run ends before its first eviction (which writes the store), to write it
            # at the time of its own step.
            free = pool.num_blank_blocks
        if len(new_blocks) > free:
            new_blocks.sort()
            horizon = new_blocks[free]
            if horizon < 1:
                return None
        dropped = frozenset(self._finished_since_last | self._preempted_since_last)
        return DecodeRun(
            requests=tuple(running),
            contexts=tuple(contexts),
            limits=tuple(limits),
            horizon=horizon,
            first_step_id=self.step_id + 1,
            in_flight_step=None if in_flight is None else in_flight.step_id,
            dropped_req_ids=dropped,
            num_preempted_before=len(self._preempted_since_last),
        )

    def _take_blocks(
        self,
        run: DecodeRun,
        events: list[tuple[int, int]],
        tokens: Sequence[Sequence[int]],
        starts: list[int],
        taken: list[int],
    ) -> dict[int, list[KVBlock]]:
        """The allocations of a decode run's steps at `events` ((step, request index), in
        order), each request as it stands when that step is scheduled; counts the blocks
        each step takes in `taken`. Returns the blocks each request took, by index."""
        got: dict[int, list[KVBlock]] = {}
        requests, contexts, allocate = run.requests, run.contexts, self.kv.allocate
        for s, i in events:
            req = requests[i]
            outputs = req.output_token_ids
            have = len(outputs) - starts[i]
            if have < s:  # the tokens applied before step s was scheduled
                outputs.extend(tokens[i][have:s])
            req.num_computed_tokens = contexts[i] + s
            blocks = allocate(req, 1)
            if blocks is None:
                raise RuntimeError(
                    f"decode run: its step {s} found no free block for {req.request_id!r}; "
                    f"the horizon ({run.horizon} steps) was not certain"
                )
            taken[s] += len(blocks)
            got[i] = blocks
        return got

    def advance_decode(
        self, run: DecodeRun, num_steps: int, tokens: Sequence[Sequence[int]]
    ) -> AdvancedRun:
        """Schedule and apply `num_steps` (at most `run.horizon`) steps of `run` at once,
        leaving the state those steps one by one would: tokens[i] are request i's sampled
        tokens, one per step applied to it; blocks are taken and cached in the order the
        steps would take them (their KV work is all in scheduling: in a decode step,
        caching after the results adds no block the scheduling did not cache ahead);
        a request ends by length in its limit's turn, after that turn's step took its
        blocks, in schedule order."""
        k = num_steps
        if not 1 <= k <= run.horizon:
            raise ValueError(f"advance_decode: {k} steps of a run certain for {run.horizon}")
        kv, bs = self.kv, self.block_size
        pipelined = run.in_flight_step is not None
        requests, contexts, limits = run.requests, run.contexts, run.limits
        starts = [len(req.output_token_ids) for req in requests]
        # (step, request): where a step takes a new block or fills one (then caches it),
        # in the order the steps meet them; elsewhere a step's allocation changes nothing.
        events: list[tuple[int, int]] = []
        caching, req_blocks = kv.enable_caching, kv.req_blocks
        for i, req in enumerate(requests):
            c, t = contexts[i], req.num_prompt_tokens + starts[i]  # (num_tokens)
            end = limits[i] if limits[i] < k else k  # its steps in the run
            first = len(req_blocks[req.request_id]) * bs - c  # its first new block
            if caching:  # step s fills min(c + s + 1, t + s) = t + s tokens
                filled = (-t) % bs
                if (first - filled) % bs:  # two progressions, disjoint
                    if filled < end:
                        events += [(s, i) for s in range(filled, end, bs)]
                    lowest = first if first < filled else filled
                else:  # one progression, from the earlier of the two
                    first = lowest = first if first < filled else filled
                if lowest and kv.num_cached_blocks(req.request_id) < t // bs:
                    events.append((0, i))  # full blocks not cached yet (a decode engine's)
            if first < end:  # (most runs are shorter than a block: no event)
                events += [(s, i) for s in range(first, end, bs)]
        events.sort()
        free = kv.pool.num_free_blocks
        taken = [0] * k
        done = 0  # events taken so far
        finished: list[Request] = []
        ended_free: dict[int, int] = {}  # turn -> free blocks after it, where some ended
        for turn, i in sorted([(h - 1, i) for i, h in enumerate(limits) if h < k]):
            if turn not in ended_free:  # its step's blocks first; that step told the
                upto = bisect.bisect_left(events, (turn + 1, -1))  # executor of the last
                self._take_blocks(run, events[done:upto], tokens, starts, taken)
                done = upto
                self._finished_since_last = set()
                self._preempted_since_last = set()
            finished.append(self._end_in_run(run, i, tokens[i], starts[i]))
            ended_free[turn] = kv.pool.num_free_blocks
        last = bisect.bisect_left(events, (k - 1, -1))
        self._take_blocks(run, events[done:last], tokens, starts, taken)
        kv.take_cached_ahead()  # cached by steps the run applies: they ran
        last_blocks = self._take_blocks(run, events[last:], tokens, starts, taken)
        ahead = kv.take_cached_ahead()
        kv.take_saves()  # only the simulator runs decode runs: it copies no block
        # Under async scheduling the step in flight (first_step_id - 1) is applied first.
        last_applied = run.first_step_id + k - 1 - (1 if pipelined else 0)
        for step_id in [s for s in self._cached_ahead if s <= last_applied]:
            del self._cached_ahead[step_id]
        for req, limit, c, start, sampled in zip(
            requests, limits, contexts, starts, tokens, strict=True
        ):
            if limit < k:  # (ended in the run)
                continue
            outputs = req.output_token_ids
            outputs.extend(sampled[len(outputs) - start : k])
            computed = req.num_computed_tokens = c + k
            if computed > req.max_computed_tokens:
                req.max_computed_tokens = computed
        self.step_id += k
        if k > 1:  # the run's earlier steps told the executor (its last: those ended
            # in the turn before it)
            if k - 2 not in ended_free:
                self._finished_since_last = set()
            self._preempted_since_last = set()
        out = None
        if pipelined:
            if ahead:
                self._cached_ahead[self.step_id] = ahead
            scheduled = []
            for i, req in enumerate(requests):
                if limits[i] < k:
                    continue
                num_held = len(req_blocks[req.request_id])
                new = last_blocks.get(i)  # (most requests: no new block in the last step)
                # req_id, num_tokens, num_computed_tokens, is_prompt, will_sample,
                # new_block_ids, num_prior_blocks: positional (every run makes these)
                sr = ScheduledRequest(
                    req.request_id, 1, contexts[i] + k - 1, False, True,
                    [b.block_id for b in new] if new else [],
                    num_held - len(new) if new else num_held,
                    num_prompt_tokens=req.num_prompt_tokens,
                )  # fmt: skip
                scheduled.append(sr)
            out = SchedulerOutput(
                self.step_id, scheduled, self._finished_since_last, self._preempted_since_last
            )
        self._finished_since_last = set()
        self._preempted_since_last = set()
        total = kv.pool.num_blocks
        # After each of the run's steps but its last; it changes only in a step that took
        # blocks (at an event) or where requests ended.
        usages: list[float] = []
        usage = 1.0 - free / total
        for s in sorted({s for s, _ in events if s < k - 1}.union(ended_free)):
            usages += [usage] * (s - len(usages))
            free = ended_free[s] if s in ended_free else free - taken[s]
            usage = 1.0 - free / total
            usages.append(usage)
        usages += [usage] * (k - 1 - len(usages))
        for req, limit in zip(requests, limits):  # the last step's results
            if limit == k and (reason := check_stop(req, self.max_model_len)) is not None:
                self._end(req, RequestStatus.FINISHED, reason)
                finished.append(req)
        usages.append(kv.usage)
        return AdvancedRun(out, usages, finished)

    def _end_in_run(self, run: DecodeRun, i: int, tokens: Sequence[int], start: int) -> Request:
        """End request i of `run` in its limit's turn: all its tokens applied."""
        req = run.requests[i]
        outputs = req.output_token_ids
        outputs.extend(tokens[len(outputs) - start :])
        computed = req.num_computed_tokens = run.contexts[i] + run.limits[i]
        if computed > req.max_computed_tokens:
            req.max_computed_tokens = computed
        reason = check_stop(req, self.max_model_len)
        if reason is None:
            raise RuntimeError(
                f"decode run: {req.request_id!r} did not end after its {run.limits[i]} "
                "steps; its limit was not certain"
            )
        self._end(req, RequestStatus.FINISHED, reason)
        return req

    # ---- introspection ---------------------------------------------------------------

    def has_unfinished(self) -> bool:
        return bool(self.requests)

    @property
    def num_waiting(self) -> int:
        return len(self.waiting)

    @property
    def num_running(self) -> int:
        return len(self.running)


@dataclass
class _StepPlan:
    """One step being planned: the token budget left and what is scheduled so far."""

    budget: int
    scheduled: list[ScheduledRequest] = field(default_factory=list)
    num_preempted: int = 0
    kv_reserved: list[str] = field(default_factory=list)  # (role decode: `_reserve_for_kv`)

    def add(self, sr: ScheduledRequest) -> None:
        self.scheduled.append(sr)
        self.budget -= sr.num_tokens


def _effective_max_model_len(config: EngineConfig, num_blocks: int, model_max: int | None) -> int:
    """The user's (or model's) limit, capped by what the cache holds for one request."""
    capacity = num_blocks * config.block_size
    if not config.enable_chunked_prefill:
        # A preempted request is recomputed in one step: it must fit the step's budget.
        capacity = min(capacity, config.max_num_batched_tokens)
    wanted = config.max_model_len or model_max
    if wanted is None:
        return capacity
    budget_caps = not config.enable_chunked_prefill and config.max_num_batched_tokens < min(
        wanted, num_blocks * config.block_size
    )
    if budget_caps and config.max_model_len is None:
        logger.warning(
            "max_model_len capped at max_num_batched_tokens=%d (the model allows "
            "%d): without chunked prefill a longer prompt could never be scheduled",
            config.max_num_batched_tokens,
            wanted,
        )
    if wanted > capacity:
        if config.max_model_len is not None:
            logger.warning(
                "max_model_len=%d exceeds what one request can hold (KV cache of %d "
                "blocks x %d tokens, or the batch budget without chunked prefill); "
                "capping it at %d",
                wanted,
                num_blocks,
                config.block_size,
                capacity,
            )
        return capacity
    return wanted
