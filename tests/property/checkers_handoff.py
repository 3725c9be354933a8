"""What each ScheduledRequest tells the executor (deepinfer/outputs.py's contract).

The simulator reads little of a ScheduledRequest besides its token counts; a real
executor keeps per-request state from it and reads every field. `ExecutorHandoff`
restates each field from the test's own account of the state just before
`schedule()` (a QueueMirror: who runs, who is mid-prefill, each request's counts and
drafts, kept from the outputs) and the request's tokens as the test knows them:

- a request that starts (new, or resumed after preemption) is sent its whole block
  table, its sampling params, and, to an executor that needs token ids, the ids
  before its first chunk (`prior_token_ids`) and, when it asked for prompt logprobs,
  its prompt; a request that continues is sent none of these;
- `num_prior_blocks` is the length of its table before this step's new blocks;
- `is_prompt` is true exactly for steps of the waiting phase (not in the DECODE role,
  where a request starts with all but its last token computed); every scheduled
  request computes at least one token;
- the step's drafts are exactly its positions past the request's known tokens, the
  drafter's proposal (placeholders when a step in flight proposes them);
- `token_ids` are the known ids of the step's positions plus real drafts, None for an
  executor that needs no token ids; `will_sample` when the step reaches the last known token;
- a request asking for prompt logprobs starts with no prefix-cache hit, and the hit
  reported for a request (`num_cached_tokens`) is that of its first start.
"""

from __future__ import annotations

from deepinfer.config import EngineRole
from deepinfer.outputs import (
    DRAFT_PLACEHOLDER,
    ScheduledRequest,
    SchedulerOutput,
)
from tests.property.harness import Driver
from tests.property.queue_mirror import Counts, QueueChecker, QueueView


class ExecutorHandoff(QueueChecker):
    def __init__(self) -> None:
        super().__init__()
        self.first_hit: dict[str, int] = {}  # req_id -> num_cached_tokens at its first start

    def _fail(self, out: SchedulerOutput, sr: ScheduledRequest, what: str) -> None:
        raise AssertionError(f"handoff: step {out.step_id}, request {sr.req_id}: {what}")

    def check_schedule(
        self, d: Driver, out: SchedulerOutput, view: QueueView, in_flight: bool
    ) -> None:
        snap = d.snap
        assert snap is not None
        for sr in out.scheduled:
            running = sr.req_id in view.running
            starts = not running and sr.req_id not in view.in_progress
            self._common(d, out, sr, view.counts[sr.req_id], running, starts)
            self._resume(d, out, sr, starts)
            self._token_ids(d, out, sr, view.counts[sr.req_id], starts)
            # the table before the step: the scheduler's (the KVMirror checks it)
            if len(snap.tables.get(sr.req_id, [])) != sr.num_prior_blocks:
                self._fail(
                    out,
                    sr,
                    f"num_prior_blocks {sr.num_prior_blocks}, but it held "
                    f"{len(snap.tables.get(sr.req_id, []))} blocks before the step",
                )

    def _common(
        self,
        d: Driver,
        out: SchedulerOutput,
        sr: ScheduledRequest,
        s: Counts,
        running: bool,
        starts: bool,
    ) -> None:
        req = d.reqs[sr.req_id]
        is_prompt = not running and not d.imports_kv(sr.req_id)
        if sr.is_prompt is not is_prompt:
            self._fail(out, sr, f"is_prompt {sr.is_prompt!r}, want {is_prompt}")
        if sr.num_prompt_tokens != req.num_prompt_tokens or sr.structured is not req.structured:
            self._fail(
                out,
                sr,
                f"num_prompt_tokens {sr.num_prompt_tokens} / structured {sr.structured!r}, "
                f"want {req.num_prompt_tokens} / {req.structured}",
            )
        num_tokens = len(d.tokens(sr.req_id))
        known = num_tokens + s.placeholders + s.pending_drafts
        end = sr.num_computed_tokens + sr.num_tokens
        drafts = sr.draft_token_ids
        if len(drafts) != max(0, end - known):
            self._fail(
                out,
                sr,
                f"{len(drafts)} drafts in a step over [{sr.num_computed_tokens}, {end}), "
                f"{known} tokens known: drafts are the positions past them",
            )
        want = [DRAFT_PLACEHOLDER] * len(drafts) if s.placeholders else s.drafts[: len(drafts)]
        if drafts != want:
            self._fail(out, sr, f"drafts {drafts}, want {want} (proposed {s.drafts})")
        will_sample = end >= num_tokens + s.placeholders
        if sr.will_sample is not will_sample:
            self._fail(
                out,
                sr,
                f"will_sample {sr.will_sample!r}: the step ends at {end}, "
                f"{num_tokens} + {s.placeholders} tokens known",
            )
        if sr.num_tokens <= 0:
            self._fail(out, sr, f"scheduled with {sr.num_tokens} tokens to compute")
        if starts and not is_prompt and sr.num_computed_tokens != num_tokens - 1:
            self._fail(
                out,
                sr,
                f"DECODE role: starts at {sr.num_computed_tokens} of {num_tokens} "
                f"tokens; its prompt's KV arrived with it, all but the last token",
            )
        wants_logprobs = req.sampling_params.prompt_logprobs is not None
        if starts and wants_logprobs and is_prompt and sr.num_computed_tokens != 0:
            self._fail(out, sr, f"asks for prompt logprobs, starts at {sr.num_computed_tokens}")

    def _resume(self, d: Driver, out: SchedulerOutput, sr: ScheduledRequest, starts: bool) -> None:
        req = d.reqs[sr.req_id]
        table = d.sched.kv.block_ids(sr.req_id) if starts else None
        params = req.sampling_params if starts else None
        if sr.block_table != table or sr.sampling_params is not params:
            self._fail(
                out,
                sr,
                f"block_table {sr.block_table} / sampling_params {sr.sampling_params}, "
                f"want {table} / {params} ({'starts' if starts else 'continues'})",
            )
        if not starts:
            return
        if sr.req_id not in self.first_hit:
            self.first_hit[sr.req_id] = req.num_cached_tokens
            decode = d.case.config.role is EngineRole.DECODE
            if not decode and req.num_cached_tokens != sr.num_computed_tokens:
                self._fail(
                    out,
                    sr,
                    f"num_cached_tokens {req.num_cached_tokens}, but its first start "
                    f"skips {sr.num_computed_tokens} cached tokens",
                )
        elif req.num_cached_tokens != self.first_hit[sr.req_id]:
            self._fail(
                out,
                sr,
                f"num_cached_tokens {req.num_cached_tokens} on a restart: its first start "
                f"hit {self.first_hit[sr.req_id]}",
            )

    def _token_ids(
        self, d: Driver, out: SchedulerOutput, sr: ScheduledRequest, s: Counts, starts: bool
    ) -> None:
        req = d.reqs[sr.req_id]
        want: tuple = None, None, None  # an executor that needs no token ids gets none
        if d.executor.needs_token_ids:
            tokens = d.tokens(sr.req_id)
            start = sr.num_computed_tokens
            real = [t for t in sr.draft_token_ids if t != DRAFT_PLACEHOLDER]
            want = (
                tokens[start : min(start + sr.num_tokens, len(tokens))] + real,
                tokens[:start] if starts else None,
                list(req.prompt)
                if starts and req.sampling_params.prompt_logprobs is not None
                else None,
            )
        ids = sr.token_ids, sr.prior_token_ids, sr.prompt_token_ids
        if ids != want:
            self._fail(
                out,
                sr,
                f"token_ids / prior_token_ids / prompt_token_ids {ids}, want {want} "
                f"(executor needs token ids: {d.executor.needs_token_ids})",
            )
