"""Checkers of the stop conditions (docs/design.md) in generated workloads.

harness.expected_end predicts, from a request's spec alone, after how many output
tokens it ends and why: SimExecutor emits a known token at each position, and the
strategies place stop token ids and EOS at chosen output indices.
"""

from __future__ import annotations

from deepinfer.outputs import ModelRunnerOutput, SchedulerOutput
from deepinfer.request import RequestStatus
from tests.property.harness import Checker, Driver, expected_end, note
from tests.property.strategies import ReqSpec


class StopConditions(Checker):
    """A request ends in the update that produces its first output token that meets a
    stop condition, with that token last, the finish reason of that condition, and no
    block held once the update returns; until then it goes on."""

    def on_process(self, d: Driver, out: SchedulerOutput, res: ModelRunnerOutput) -> None:
        for sr in out.scheduled:
            rid = sr.req_id
            if rid not in d.live_before_process or not sr.will_sample:
                continue
            req, spec = d.reqs[rid], d.specs[rid]
            want, reason = expected_end(d.case, spec, text=d.text)
            got, where = req.num_output_tokens, f"step {out.step_id}, request {rid}"
            rule = f"rule 'stop conditions' ({spec})"
            if not req.is_finished:
                assert got < want, (
                    f"{rule}: {where} has {got} output tokens and goes on, but output #{want} "
                    f"ended it ({reason})"
                )
                continue
            assert req.status is RequestStatus.FINISHED, f"{rule}: {where} is {req.status}"
            assert got == want, (
                f"{rule}: {where} ended after {got} output tokens, its first stop condition "
                f"is met by output #{want} ({reason})"
            )
            assert req.finish_reason is not None and req.finish_reason.value == reason, (
                f"{rule}: {where} ended with reason {req.finish_reason}, not {reason}"
            )
            assert not d.sched.kv.holds_blocks(rid), (
                f"{rule}: {where} ended but still holds blocks {d.sched.kv.block_ids(rid)}"
            )
            self._note(spec, req.output_token_ids, len(res.sampled_token_ids[rid]), reason)

    @staticmethod
    def _note(spec: ReqSpec, outputs: list[int], num_sampled: int, reason: str) -> None:
        last = outputs[-1]
        if reason == "stop":
            note("stopped on a stop token id" if last in spec.stop_token_ids else "stopped on EOS")
            if num_sampled > 1:
                note("stopped inside a multi-token step (accepted drafts)")
        ignored = set(spec.stop_token_ids) & set(outputs[: max(spec.min_tokens - 1, 0)])
        if ignored:
            note("a stop token id before min_tokens was ignored")
        if spec.ignore_eos and spec.eos_token_id in outputs:
            note("EOS ignored (ignore_eos)")


class EndedAreAnnounced(Checker):
    """Every request that ends (finished in an update, or aborted) is in the next step's
    `finished_req_ids` and nothing else is: the executor drops its state then. An empty
    step is never launched, so the ids it lists stay for the next one too (else the
    executor would keep their state for good once the engine drains)."""

    def __init__(self) -> None:
        self.ended: set[str] = set()

    def on_abort(self, d: Driver, req_id: str) -> None:
        self.ended.add(req_id)

    def on_process(self, d: Driver, out: SchedulerOutput, res: ModelRunnerOutput) -> None:
        self.ended |= {r for r in d.live_before_process if d.reqs[r].is_finished}

    def on_schedule(self, d: Driver, out: SchedulerOutput, in_flight: bool) -> None:
        assert out.finished_req_ids == self.ended, (
            f"rule 'ended requests are announced': step {out.step_id} announces "
            f"{sorted(out.finished_req_ids)} as finished; ended since the last step: "
            f"{sorted(self.ended)}"
        )
        if out.scheduled:
            self.ended = set()
