"""How the scheduler applies what a real executor returns besides tokens (the simulator
returns none of it, so the property suite never sees it): sampled and prompt logprobs,
a grammar completed while other requests go on, a request given no drafts; and a
result that breaks the executor contract is an error naming the request."""

from __future__ import annotations

import pytest

from deepinfer.outputs import ModelRunnerOutput, SchedulerOutput, TokenLogprob
from deepinfer.request import FinishReason, RequestStatus
from tests.factories import ScriptedExecutor, make_config, make_engine, make_request


def _lp(token: int, pos: int) -> list[TokenLogprob]:
    """A distinct logprobs entry for `token` at position `pos`."""
    return [TokenLogprob(token, -pos / 100, 1), TokenLogprob(token + 1, -1.0 - pos, 2)]


class LogprobExecutor(ScriptedExecutor):
    """Adds one logprobs entry per sampled token and the prompt logprobs of each chunk."""

    def execute(self, out: SchedulerOutput) -> ModelRunnerOutput:
        res = super().execute(out)
        res.logprobs, res.prompt_logprobs = {}, {}
        for sr in out.scheduled:
            if sr.is_prompt:
                start = sr.num_computed_tokens
                res.prompt_logprobs[sr.req_id] = {
                    p: _lp(p, p) for p in range(max(start, 1), start + sr.num_tokens)
                }
            tokens = res.sampled_token_ids.get(sr.req_id)
            if tokens:
                first = sr.num_computed_tokens + sr.num_tokens - len(sr.draft_token_ids)
                res.logprobs[sr.req_id] = [_lp(t, first + j) for j, t in enumerate(tokens)]
        return res


def test_each_sampled_token_keeps_its_logprobs_and_every_prompt_chunk_its_prompt_logprobs() -> None:
    cfg = make_config(num_gpu_blocks=20, max_num_batched_tokens=5)  # a 12-token prompt: 3 chunks
    engine = make_engine(cfg)
    engine.executor = LogprobExecutor(20)
    req = make_request("r", 12, max_tokens=4)
    other = make_request("o", 3, max_tokens=4)  # its entries must not leak into r's
    engine.add_request(req)
    engine.add_request(other)
    while engine.has_unfinished():
        engine.step()
    assert req.logprobs == [_lp(t, 12 + j) for j, t in enumerate(req.output_token_ids)]
    assert req.prompt_logprobs == {p: _lp(p, p) for p in range(1, 12)}
    assert other.logprobs == [_lp(t, 3 + j) for j, t in enumerate(other.output_token_ids)]


class CompletingExecutor(ScriptedExecutor):
    """Request `rid`'s grammar is complete after `after` outputs: as the model runner does,
    the tokens past its end are dropped and the request is reported completed."""

    def __init__(self, num_blocks: int, k: int, rid: str, after: int) -> None:
        super().__init__(num_blocks, k, acceptance_rate=1.0)
        self.rid, self.after, self.num_out = rid, after, 0

    def execute(self, out: SchedulerOutput) -> ModelRunnerOutput:
        res = super().execute(out)
        tokens = res.sampled_token_ids.get(self.rid)
        if tokens:
            tokens[:] = tokens[: self.after - self.num_out]
            self.num_out += len(tokens)
            if self.num_out == self.after:
                res.completed_req_ids.add(self.rid)
        return res


def test_a_completed_grammar_ends_its_request_on_its_last_token_and_no_other() -> None:
    """Two drafts, all accepted: the completing step returns 3 tokens, the last one ends
    the grammar; the request scheduled beside it goes on to max_tokens."""
    cfg = make_config(num_gpu_blocks=40, num_speculative_tokens=2)
    engine = make_engine(cfg)
    engine.executor = CompletingExecutor(40, 2, "c", after=4)
    free, done = make_request("f", 4, max_tokens=12), make_request("c", 5, max_tokens=12)
    engine.add_request(free)
    engine.add_request(done)
    while engine.has_unfinished():
        engine.step()
    assert (done.num_output_tokens, done.finish_reason) == (4, FinishReason.STOP)
    assert (free.num_output_tokens, free.finish_reason) == (12, FinishReason.LENGTH)


class NoDraftsFor(ScriptedExecutor):
    """Proposes no drafts for `rid` (the MTP drafter proposes none for a request whose
    newest token it does not know yet)."""

    def __init__(self, num_blocks: int, k: int, rid: str) -> None:
        super().__init__(num_blocks, k, acceptance_rate=1.0)
        self.rid = rid

    def execute(self, out: SchedulerOutput) -> ModelRunnerOutput:
        res = super().execute(out)
        res.draft_token_ids.pop(self.rid, None)
        return res


def test_a_request_given_no_drafts_goes_on_without_them() -> None:
    engine = make_engine(make_config(num_gpu_blocks=40, num_speculative_tokens=2))
    engine.executor = NoDraftsFor(40, 2, "plain")
    plain, spec = make_request("plain", 4, max_tokens=6), make_request("spec", 4, max_tokens=6)
    engine.add_request(plain)
    engine.add_request(spec)
    engine.step()
    out = engine.schedule()
    drafts = {sr.req_id: sr.draft_token_ids for sr in out.scheduled}
    assert drafts["plain"] == [] and len(drafts["spec"]) == 2
    engine.apply_results(out, engine.executor.execute(out))
    while engine.has_unfinished():
        engine.step()
    assert plain.num_output_tokens == spec.num_output_tokens == 6


class Broken(ScriptedExecutor):
    """Returns `tokens` as request r's sampled tokens whatever it was scheduled for."""

    def __init__(self, tokens: list[int]) -> None:
        super().__init__(20)
        self.tokens = tokens

    def execute(self, out: SchedulerOutput) -> ModelRunnerOutput:
        res = super().execute(out)
        res.sampled_token_ids["r"] = self.tokens
        return res


@pytest.mark.parametrize(
    ("tokens", "message"),
    [
        ([], r"executor returned no token for 'r' in step 1, which was scheduled to sample"),
        ([7, 8, 9], r"executor returned 3 tokens for 'r' with only 0 drafts to verify"),
    ],
)
def test_a_result_that_breaks_the_executor_contract_is_an_error_naming_the_request(
    tokens: list[int], message: str
) -> None:
    engine = make_engine(make_config(num_gpu_blocks=20))
    engine.executor = Broken(tokens)
    engine.add_request(make_request("r", 4))
    with pytest.raises(RuntimeError, match=message):
        engine.step()
    assert engine.scheduler.requests["r"].status is RequestStatus.RUNNING
