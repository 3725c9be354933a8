"""What the engine keeps of each step's results, beyond the sampled tokens.

The simulator returns sampled tokens and drafts only. A real executor also returns, on
request, each sampled token's logprobs and each prompt position's logprobs, reports
structured requests whose grammar is complete, and may propose no drafts for a request.
Here the simulator's results are extended with all of these (hypothesis picks which
requests ask for logprobs, whose grammar completes at which output, which get no
drafts), and the engine must:

- keep one logprobs row per output token, that token's, for a request that asks, and
  none for one that does not; keep the rows of every prompt position a prompt chunk
  computed, for a request that asks, and none otherwise;
- end a request whose grammar the executor reports complete on the last token of that
  step, with reason stop, unless its own stop conditions or lengths end it first (the
  completion comes before a prefill engine's hand-over after one token);
- take each request's next drafts as the executor proposed them, none if it proposed
  none;
- refuse a result that breaks the executor's contract (no token for a request scheduled
  to sample; more tokens than its drafts plus one) with an error naming the request.
"""

from __future__ import annotations

import copy
from dataclasses import replace

from hypothesis import given
from hypothesis import strategies as st

from deepinfer.config import EngineRole
from deepinfer.outputs import ModelRunnerOutput, SchedulerOutput, TokenLogprob
from deepinfer.request import FinishReason, RequestStatus
from tests.property.harness import Checker, Driver, expected_end
from tests.property.strategies import EngineCase, Workload, any_case_and_workload, scaled


def _row(token: int) -> list[TokenLogprob]:
    """The logprobs row the test's executor reports for `token` (any fixed function)."""
    return [TokenLogprob(token, -float(token % 97), 1)]


class Results(Checker):
    """Extends the simulator's results (see the module docstring) and checks what the
    engine kept of them after each step."""

    def __init__(self, data: st.DataObject, workload: Workload) -> None:
        ids = [s.req_id for s in workload]
        subset = st.sets(st.sampled_from(ids)) if ids else st.just(set())
        self.logprobs: set[str] = data.draw(subset, label="ask logprobs")
        self.prompt_logprobs: set[str] = data.draw(subset, label="ask prompt logprobs")
        self.no_drafts: set[str] = data.draw(subset, label="given no drafts")
        done = st.dictionaries(st.sampled_from(ids), st.integers(1, 12)) if ids else st.just({})
        self.grammar_done_at: dict[str, int] = data.draw(done, label="grammar complete at")
        self.before: dict[int, dict[str, int]] = {}  # step -> outputs each had at execute

    def attach(self, d: Driver) -> None:
        cfg = d.case.config
        self.prefill_role = cfg.role is EngineRole.PREFILL
        self.normal = replace(d.case, config=replace(cfg, role=EngineRole.NORMAL))
        execute = d.executor.execute

        def extended(out: SchedulerOutput) -> ModelRunnerOutput:
            res = self._extend(d, out, execute(out))
            self._broken_results_are_refused(d, out, res)
            return res

        d.executor.execute = extended  # type: ignore[method-assign]

    def _extend(self, d: Driver, out: SchedulerOutput, res: ModelRunnerOutput) -> ModelRunnerOutput:
        before = self.before[out.step_id] = {
            sr.req_id: len(d.reqs[sr.req_id].output_token_ids) for sr in out.scheduled
        }
        logprobs, prompt_logprobs = {}, {}
        for sr in out.scheduled:
            rid, tokens = sr.req_id, res.sampled_token_ids.get(sr.req_id, [])
            if rid in self.logprobs and tokens:
                logprobs[rid] = [_row(t) for t in tokens]
            prompt = d.specs[rid].prompt
            end = min(sr.num_computed_tokens + sr.num_tokens, len(prompt))
            if rid in self.prompt_logprobs and sr.num_computed_tokens < end:
                positions = range(sr.num_computed_tokens, end)
                prompt_logprobs[rid] = {p: _row(prompt[p]) for p in positions}
            done_at = self.grammar_done_at.get(rid)
            if tokens and done_at is not None and before[rid] + len(tokens) >= done_at:
                res.completed_req_ids.add(rid)
            if rid in self.no_drafts:
                res.draft_token_ids.pop(rid, None)
                res.draft_confidences.pop(rid, None)
        res.logprobs = logprobs or None  # None when nobody in the step asked
        res.prompt_logprobs = prompt_logprobs or None
        return res

    @staticmethod
    def _broken_results_are_refused(
        d: Driver, out: SchedulerOutput, res: ModelRunnerOutput
    ) -> None:
        sr = next((sr for sr in out.scheduled if sr.will_sample), None)
        if sr is None or d.case.config.async_scheduling:
            return  # (async: the next schedule() comes before this result is applied)
        rid, n = sr.req_id, len(sr.draft_token_ids)
        for tokens in ([], [7] * (n + 2)):
            broken = replace(res, sampled_token_ids={**res.sampled_token_ids, rid: tokens})
            try:
                copy.deepcopy(d.sched).update_from_output(out, broken)
            except RuntimeError as e:
                assert repr(rid) in str(e), f"{len(tokens)} tokens for {rid}: {e}"
            else:
                raise AssertionError(f"{len(tokens)} tokens for {rid} ({n} drafts) accepted")

    def on_process(self, d: Driver, out: SchedulerOutput, res: ModelRunnerOutput) -> None:
        k = d.case.config.num_speculative_tokens
        before = self.before.pop(out.step_id)
        for sr in out.scheduled:
            rid = sr.req_id
            if rid not in d.live_before_process:
                continue
            req, spec = d.reqs[rid], d.specs[rid]
            outputs = req.output_token_ids
            want = [_row(t) for t in outputs] if rid in self.logprobs else []
            assert req.logprobs == want, f"{rid}: logprobs {req.logprobs}, outputs {outputs}"
            rows = (res.prompt_logprobs or {}).get(rid, {})
            if rid not in self.prompt_logprobs:
                assert not req.prompt_logprobs, f"{rid} kept prompt logprobs it never asked for"
            assert all(req.prompt_logprobs.get(p) == row for p, row in rows.items()), (
                f"{rid}: prompt logprobs of step {out.step_id} not kept"
            )
            tokens = res.sampled_token_ids.get(rid, [])
            if not sr.will_sample or not tokens:
                continue
            reached = before[rid] + len(tokens)
            natural, why = expected_end(self.normal, spec)  # stop conditions and lengths
            if rid not in res.completed_req_ids and self.prefill_role and natural > 1:
                natural, why = 1, "length"  # the hand-over
            if natural <= reached:
                assert len(outputs) == natural and req.finish_reason is not None, (
                    f"{rid}: its stop conditions end it at output {natural}, has {len(outputs)}"
                )
                assert req.finish_reason.value == why, f"{rid}: {req.finish_reason}, not {why}"
            elif rid in res.completed_req_ids:
                assert (len(outputs), req.status, req.finish_reason) == (
                    reached,
                    RequestStatus.FINISHED,
                    FinishReason.STOP,
                ), f"{rid}: grammar complete at output {reached}: {req!r}, {req.finish_reason}"
            else:
                assert not req.is_finished and len(outputs) == reached, (
                    f"{rid}: {len(outputs)} outputs, {reached} expected, {req.finish_reason}"
                )
                if k and req.status is RequestStatus.RUNNING:
                    proposed = list(res.draft_token_ids.get(rid, ()))[:k]
                    assert req.spec_token_ids == proposed, (
                        f"{rid}: next drafts {req.spec_token_ids}, proposed {proposed}"
                    )


@scaled(1.0)
@given(any_case_and_workload(aborts=False), st.data())
def test_logprobs_grammar_completions_and_drafts_from_the_executor_are_kept_as_returned(
    cw: tuple[EngineCase, Workload], data: st.DataObject
) -> None:
    """Logprobs rows (per output token, per prompt position computed) are kept for the
    requests that ask and no others; a grammar reported complete ends its request on the
    step's last token with reason stop, unless its stop conditions end it first; next
    drafts are as proposed (none if none); a result with no token for a sampling request,
    or more than its drafts plus one, is refused naming the request.

    Caught: `update_from_output__mutmut_7` (completions ignored), `_50` (logprobs never
    kept), `_13` (prompt logprobs looked up for requests that have none), `_29` / `_36`
    (a contract error naming nobody), `_93` (a request given no drafts crashes); the
    names of the code at this page's date (MUTATION.md: the 24b5901 run's names are one
    lower)."""
    case, workload = cw
    d = Driver(case, workload, [], text=False)  # its expectations are the engine's alone
    checker = Results(data, workload)
    d.checkers.append(checker)
    checker.attach(d)
    d.run()
