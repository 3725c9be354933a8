"""The model runner's per-request state, a mixin: what `update_states` keeps for each
request the scheduler sends (its block table, sampling state, grammar matcher), built
when a request arrives with its whole block table (first schedule, or resumed after a
preemption) and dropped when it ends or is preempted."""

from __future__ import annotations

from deepinfer.errors import RequestFailed
from deepinfer.outputs import SchedulerOutput
from deepinfer.sampling_params import SamplingParams
from executors.sampler import SamplingState
from executors.step_inputs import RequestState, StepInputs
from executors.structured_outputs import GrammarCompiler, GrammarState


class RunnerStates(StepInputs):
    """ModelRunner's request bookkeeping; the runner sets these attributes (and
    StepInputs')."""

    eos_token_id: int | None
    grammars: GrammarCompiler | None

    def _drop(self, out: SchedulerOutput) -> None:
        """Forget the requests `out` says ended or were preempted."""
        for req_id in out.finished_req_ids | out.preempted_req_ids:
            self.requests.pop(req_id, None)
            if self.drafter is not None:
                self.drafter.pending.pop(req_id, None)

    def update_states(self, out: SchedulerOutput) -> None:
        self._drop(out)
        for sr in out.scheduled:
            if sr.block_table is not None:
                if self.drafter is not None:  # (re)started: nothing of its past is pending
                    self.drafter.pending.pop(sr.req_id, None)
                params = sr.sampling_params or SamplingParams()
                state = SamplingState(params, [], eos_token_id=self.eos_token_id)
                self.requests[sr.req_id] = RequestState(
                    list(sr.block_table), state, sr.num_prompt_tokens,
                    num_computed=sr.num_computed_tokens,
                )  # fmt: skip
                if sr.prior_token_ids:
                    self._record_history(self.requests[sr.req_id], 0, sr.prior_token_ids)
                if sr.prompt_token_ids is not None:
                    self.requests[sr.req_id].prompt_ids = list(sr.prompt_token_ids)
                if params.so_args is not None:
                    self.requests[sr.req_id].grammar = self._grammar(sr.req_id, params.so_args)
            elif sr.req_id not in self.requests:
                raise ValueError(
                    f"request {sr.req_id!r}: no block_table and no state held "
                    "(first schedule and resumes must send the whole table)"
                )
            else:
                table = self.requests[sr.req_id].block_table
                if sr.num_prior_blocks is not None:  # slots of rejected drafts were freed
                    del table[sr.num_prior_blocks :]
                table.extend(sr.new_block_ids)

    def _grammar(self, req_id: str, so_args: dict) -> GrammarState:
        """A fresh matcher (a resumed request catches up with its history in collect)."""
        if self.grammars is None:
            raise RequestFailed({req_id: "so_args: this model runner has no grammar compiler"})
        try:
            return GrammarState(self.grammars.compiled(so_args))
        except Exception as e:  # the engine schedules a request once its compile succeeded
            raise RequestFailed({req_id: f"so_args: {e}"}) from e
