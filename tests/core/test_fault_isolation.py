"""Fault isolation: an executor failure for one request's work ends that request (aborted,
with the reason) and the engine serves every other request as if nothing happened."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from deepinfer.errors import RequestFailed
from deepinfer.outputs import ModelRunnerOutput, SchedulerOutput
from deepinfer.request import FinishReason, RequestStatus
from deepinfer.scheduler import Scheduler
from deepinfer.scheduler_checks import check_invariants, diagnose_stall
from tests.factories import ScriptedExecutor, make_config, make_engine, make_request


class FaultyExecutor(ScriptedExecutor):
    """Raises at chosen (step number, request) pairs: a RequestFailed naming the request,
    or, for `generic`, a plain error that names nobody."""

    def __init__(self, num_blocks: int, faults: dict[int, str], generic: bool) -> None:
        super().__init__(num_blocks)
        self.faults, self.generic, self.calls = faults, generic, 0

    def execute(self, out: SchedulerOutput) -> ModelRunnerOutput:
        self.calls += 1
        victim = self.faults.get(self.calls)
        if victim is not None and any(sr.req_id == victim for sr in out.scheduled):
            if self.generic:
                raise IndexError("index out of range in self")
            raise RequestFailed({victim: "token id 10**9 is out of the vocabulary"})
        return super().execute(out)


def _run(cfg, executor, specs):  # type: ignore[no-untyped-def]
    engine = make_engine(cfg)
    engine.executor = executor
    reqs = [make_request(rid, n, max_tokens=m) for rid, n, m in specs]
    for r in reqs:
        engine.add_request(r)
    steps = 0
    while engine.has_unfinished():
        engine.step()
        steps += 1
        assert steps < 2000, diagnose_stall(engine.scheduler)
    return engine, reqs


workloads = st.lists(st.tuples(st.integers(1, 30), st.integers(1, 6)), min_size=1, max_size=6).map(
    lambda xs: [(f"r{i}", n, m) for i, (n, m) in enumerate(xs)]
)


@settings(max_examples=60, deadline=None)
@given(workloads, st.integers(1, 12), st.integers(0, 5), st.booleans(), st.booleans())
def test_a_failing_request_is_aborted_and_every_other_finishes_unchanged(
    specs, fault_step, victim_index, async_scheduling, generic
) -> None:
    cfg = make_config(num_gpu_blocks=40, async_scheduling=async_scheduling)
    victim = specs[victim_index % len(specs)][0]
    _, clean = _run(cfg, ScriptedExecutor(40), specs)
    faulty_ex = FaultyExecutor(40, {fault_step: victim}, generic)
    engine, reqs = _run(cfg, faulty_ex, specs)
    check_invariants(engine.scheduler)
    assert engine.scheduler.kv.pool.num_free_blocks == 40  # nothing leaked
    by_id = {r.request_id: r for r in reqs}
    failed = [r for r in reqs if r.status is RequestStatus.ABORTED]
    for r in reqs:
        assert r.is_finished and sum(rec.req_id == r.request_id for rec in engine.records) == 1
    if not generic:
        assert all(r.request_id == victim for r in failed)
        if failed:
            assert "out of the vocabulary" in (by_id[victim].reject_reason or "")
    for r, c in zip(reqs, clean):
        if r.status is RequestStatus.FINISHED:
            assert r.output_token_ids == c.output_token_ids, r.request_id
        else:
            assert r.reject_reason  # aborted with the reason, never silently


def test_abort_of_a_waiting_running_or_prefilling_request_frees_its_blocks() -> None:
    engine = make_engine(make_config(num_gpu_blocks=20, max_num_batched_tokens=8))
    a, b, c = (
        make_request("a", 3, max_tokens=50),
        make_request("b", 20, max_tokens=5),
        make_request("c", 4, max_tokens=5),
    )
    for r in (a, b, c):
        engine.add_request(r)
    engine.step()  # a runs, b is mid-prefill (chunked), c waits
    assert a.status is RequestStatus.RUNNING and b.status is RequestStatus.PREFILLING
    assert c.status is RequestStatus.WAITING
    for r in (a, b, c):
        engine.abort(r.request_id)
        assert not engine.scheduler.kv.holds_blocks(r.request_id)
    check_invariants(engine.scheduler)
    assert engine.scheduler.kv.pool.num_free_blocks == 20 and not engine.has_unfinished()


def test_the_first_step_failing_for_one_of_two_requests() -> None:
    specs = [("good", 5, 3), ("bad", 4, 3)]
    engine, (good, bad) = _run(
        make_config(num_gpu_blocks=40), FaultyExecutor(40, {1: "bad"}, generic=False), specs
    )
    assert bad.status is RequestStatus.ABORTED and "vocabulary" in (bad.reject_reason or "")
    assert good.status is RequestStatus.FINISHED and good.output_token_ids == [1005, 1006, 1007]
    rec = next(r for r in engine.records if r.req_id == "bad")
    assert rec.status == "aborted" and "vocabulary" in (rec.reason or "")


def test_a_failed_step_skips_requests_ended_meanwhile_and_requeues_every_other() -> None:
    """fail_step walks the step's request ids as a set, in no fixed order: whatever the
    order (ten sets of ids), a request aborted while its step was in flight is skipped,
    the one the error names is aborted with that reason, and every other is requeued with
    nothing computed and no block (a running one preempted, one mid-chunk from its
    start), the next step telling the executor so."""
    for trial in range(10):
        sched = Scheduler(make_config(num_gpu_blocks=40, max_num_batched_tokens=30), 40)
        ids = [f"t{trial}r{i}" for i in range(6)]
        reqs = {rid: make_request(rid, 20 if rid == ids[-1] else 4) for rid in ids}
        for r in reqs.values():
            sched.add_request(r)
        out = sched.schedule()
        assert reqs[ids[-1]].status is RequestStatus.PREFILLING  # 10 of its 20 tokens
        gone, bad, requeued = ids[0], ids[1], ids[2:]
        sched.abort(gone)
        assert sched.fail_step([out], {bad: "boom"}) == [reqs[bad]]
        ended = (reqs[bad].status, reqs[bad].finish_reason, reqs[bad].reject_reason)
        assert ended == (RequestStatus.ABORTED, FinishReason.ABORT, "boom")
        for rid in requeued:
            r = reqs[rid]
            assert r.status is RequestStatus.PREEMPTED and r.num_computed_tokens == 0, (
                f"trial {trial}: {r!r} not requeued"
            )
            assert not sched.kv.holds_blocks(rid)
        check_invariants(sched)
        assert sched.schedule().preempted_req_ids == set(requeued)


def test_under_async_scheduling_no_block_of_a_failed_step_stays_cached() -> None:
    """Step 1's results are applied while step 2 (scheduled ahead) is in flight, so the
    request's computed count already covers step 2's token; the block that token would
    complete must not be cached until step 2 has run: here it fails, and a later prompt
    with the same tokens finds nothing."""
    cfg = make_config(block_size=4, num_gpu_blocks=16, async_scheduling=True)
    s = Scheduler(cfg, 16)
    s.add_request(make_request("r", 3, max_tokens=10))
    o1 = s.schedule()  # the prompt; samples a token
    o2 = s.schedule()  # that token's decode, ahead of step 1's results
    tok = 9
    s.update_from_output(o1, ModelRunnerOutput(sampled_token_ids={"r": [tok]}))
    s.fail_step([o2], {})
    prompt = [1, 2, 3, tok, 5]  # r's prompt, its token, one more
    s.add_request(make_request("r2", prompt=prompt, max_tokens=1))
    assert s.kv.find_cached_prefix(s.requests["r2"]) == []


def test_an_engine_that_discards_its_step_in_flight_forgets_the_blocks_it_cached() -> None:
    """An interrupted generate aborts the requests and discards the launched step: the
    blocks that step would have filled leave the prefix cache with it."""
    engine = make_engine(make_config(block_size=4, num_gpu_blocks=16, async_scheduling=True))
    engine.add_request(make_request("r", 8, max_tokens=4))
    engine.schedule()  # the whole prompt: both of its blocks are cached as it is scheduled
    engine.abort("r")
    engine.discard_in_flight()
    again = make_request("r2", 9, max_tokens=1)  # the same 8 tokens, and one more
    engine.add_request(again)
    assert engine.scheduler.kv.find_cached_prefix(again) == []


def test_blocks_that_accepted_drafts_complete_enter_the_prefix_cache() -> None:
    """Drafts are never cached when scheduled (they are guesses); once verified, the
    blocks the accepted ones complete are cached, up to the newest token (whose KV the
    next step writes), so a follow-up prompt holding that text hits them."""
    engine = make_engine(make_config(block_size=4, num_gpu_blocks=32, num_speculative_tokens=3),
                         acceptance_rate=1.0)  # fmt: skip
    req = make_request("r", 3, max_tokens=12)
    engine.add_request(req)
    checked = 0
    while engine.has_unfinished():
        engine.step()
        if req.is_finished:
            break
        tokens = [*req.prompt, *req.output_token_ids]
        written = len(tokens) - 1  # all but the newest token
        probe = make_request(f"probe{checked}", prompt=[*tokens[:written], -1])
        assert len(engine.scheduler.kv.find_cached_prefix(probe)) == written // 4, tokens
        checked += 1
    assert checked >= 2


def test_an_interrupted_engine_keeps_the_blocks_of_the_steps_it_applied() -> None:
    """Only what the discarded step would have filled leaves the prefix cache: the
    prompt's blocks, cached when its step was scheduled, stay cached once that step's
    results were applied, whatever step is in flight when the engine is interrupted."""
    engine = make_engine(make_config(block_size=4, num_gpu_blocks=16, async_scheduling=True))
    engine.add_request(make_request("r", 8, max_tokens=4))
    while not engine.scheduler.requests["r"].output_token_ids:
        engine.step()  # until the prompt's step is applied (the next one is in flight)
    engine.abort("r")
    engine.discard_in_flight()
    again = make_request("r2", 9, max_tokens=1)  # the same 8 tokens, and one more
    engine.add_request(again)
    assert len(engine.scheduler.kv.find_cached_prefix(again)) == 2
