"""The model runner's per-request state: what it keeps for each request the scheduler
sends (its block table, sampling state, grammar matcher, the drafter's latest proposal),
and how the tokens a step sampled are applied to it (`record_sampled`).

A request's state is built when it arrives with its whole block table (first schedule,
or resumed after a preemption: the state is then rebuilt); afterwards only
`new_block_ids` are appended. It is dropped when the request ends or is preempted.
"""

from __future__ import annotations

from collections.abc import ItemsView, Iterable, Iterator
from dataclasses import dataclass, field

import torch

from deepinfer.errors import RequestFailed
from deepinfer.outputs import ModelRunnerOutput, ScheduledRequest, SchedulerOutput, TokenLogprob
from deepinfer.sampling_params import SamplingParams
from executors.sampler import SamplingState
from executors.step_handle import StepResult
from executors.structured_outputs import GrammarCompiler, GrammarState, GrammarViolation


@dataclass
class RequestState:
    block_table: list[int]
    sampling: SamplingState
    num_prompt_tokens: int
    last_token: int | None = None  # last sampled token (used when async scheduling omits it)
    prompt_ids: list[int] | None = None  # the whole prompt, when prompt logprobs are wanted
    num_computed: int = 0  # tokens in the KV cache (the scheduler's count may run ahead)
    drafts: list[int] = field(default_factory=list)  # the drafter's latest proposal
    grammar: GrammarState | None = None  # its so_args matcher

    def record_history(self, start: int, tokens: list[int]) -> None:
        """Extend the sampler's prompt / output history with tokens at positions start...

        Only contiguous history is kept: positions the runner never saw (a prefix-cache
        hit on a resumed request) leave it short.
        """
        s, n_prompt = self.sampling, self.num_prompt_tokens
        end = start + len(tokens)
        known = len(s.prompt_token_ids)
        if start <= known < min(end, n_prompt):
            s.prompt_token_ids.extend(tokens[known - start : min(end, n_prompt) - start])
        if len(s.prompt_token_ids) == n_prompt:
            pos = n_prompt + len(s.output_token_ids)  # next output position to record
            if start <= pos < end:
                s.output_token_ids.extend(tokens[pos - start :])


class RequestStates:
    """req_id -> RequestState of every request the runner holds.

    `update` applies a SchedulerOutput's changes (requests that ended, arrived, or were
    given blocks); `grammars` compiles the matchers of structured requests (set by the
    executor; None: a request with so_args fails).
    """

    def __init__(self, eos_token_id: int | None) -> None:
        self.eos_token_id = eos_token_id
        self.grammars: GrammarCompiler | None = None
        self._by_id: dict[str, RequestState] = {}

    def __getitem__(self, req_id: str) -> RequestState:
        return self._by_id[req_id]

    def get(self, req_id: str) -> RequestState | None:
        return self._by_id.get(req_id)

    def __contains__(self, req_id: object) -> bool:
        return req_id in self._by_id

    def __iter__(self) -> Iterator[str]:
        return iter(self._by_id)

    def __len__(self) -> int:
        return len(self._by_id)

    def items(self) -> ItemsView[str, RequestState]:
        return self._by_id.items()

    def clear(self) -> None:
        """Forget every request (the executor shuts down)."""
        self._by_id.clear()

    def params(self, sr: ScheduledRequest) -> SamplingParams | None:
        """The request's sampling params (None: no state held, and none sent)."""
        if sr.block_table is not None:
            return sr.sampling_params or SamplingParams()
        state = self._by_id.get(sr.req_id)
        return None if state is None else state.sampling.params

    def drop(self, req_ids: Iterable[str]) -> None:
        """Forget these requests (they ended or were preempted)."""
        for req_id in req_ids:
            self._by_id.pop(req_id, None)

    def update(self, out: SchedulerOutput) -> None:
        """Drop the requests `out` says ended or were preempted; build the state of each
        request sent with its whole block table; extend the others' tables."""
        self.drop(out.finished_req_ids | out.preempted_req_ids)
        for sr in out.scheduled:
            if sr.block_table is not None:
                params = sr.sampling_params or SamplingParams()
                sampling = SamplingState(params, [], eos_token_id=self.eos_token_id)
                state = RequestState(
                    list(sr.block_table), sampling, sr.num_prompt_tokens,
                    num_computed=sr.num_computed_tokens,
                )  # fmt: skip
                self._by_id[sr.req_id] = state
                if sr.prior_token_ids:
                    state.record_history(0, sr.prior_token_ids)
                if sr.prompt_token_ids is not None:
                    state.prompt_ids = list(sr.prompt_token_ids)
                if params.so_args is not None:
                    state.grammar = self._grammar(sr.req_id, params.so_args)
            elif sr.req_id not in self._by_id:
                raise ValueError(
                    f"request {sr.req_id!r}: no block_table and no state held "
                    "(first schedule and resumes must send the whole table)"
                )
            else:
                table = self._by_id[sr.req_id].block_table
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


def record_sampled(
    rows: list[tuple[str, tuple[int, int, list[int]]]],
    states: list[RequestState],
    tokens: list[list[int]],
    logprobs: list[list[TokenLogprob]] | None,
    logits: torch.Tensor,
    out: ModelRunnerOutput,
) -> StepResult:
    """Apply each request's sampled tokens (rows and states in the same order) to its
    state (the state of a request dropped meanwhile is no longer the runner's).

    rows: (req_id, (first row in the step's sampled logits, rows, drafts verified));
    tokens: each request's accepted drafts and its sampled token; logits [N, vocab]."""
    if logprobs is not None:
        out.logprobs = {}
    result = StepResult(out, logits)
    for (req_id, (first, n, _)), state, toks in zip(rows, states, tokens):
        if state.grammar is not None and not state.grammar.done:
            try:  # those past the grammar's end (a draft ended it) are dropped
                toks = toks[: state.grammar.accept(toks)]
            except GrammarViolation as e:
                raise RequestFailed({req_id: str(e)}) from None
            if state.grammar.done:
                out.completed_req_ids.add(req_id)
        state.sampling.output_token_ids.extend(toks)
        state.last_token = toks[-1]
        state.num_computed -= n - len(toks)  # rejected drafts' KV is overwritten later
        out.sampled_token_ids[req_id] = toks
        if out.logprobs is not None and logprobs is not None:
            out.logprobs[req_id] = logprobs[first : first + len(toks)]
        result.rows[req_id] = (first, n)
    return result
