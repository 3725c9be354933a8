"""Scheduler rules of docs/design.md ("Scheduling rules"), each as a small scenario."""

from __future__ import annotations

import pytest

from deepinfer.config import EngineRole
from deepinfer.engine import EngineCore
from deepinfer.errors import SchedulerStalled
from deepinfer.request import RequestStatus
from tests.factories import make_config, make_engine, make_request, run_to_completion


def test_37_token_prompt_chunked_through_10_blocks_of_4_finishes() -> None:
    """The watermark deadlock: the prompt's reserved blocks alone keep usage above
    the watermark, so only the in-progress-chunk exemption lets it continue."""
    engine = make_engine(block_size=4, num_gpu_blocks=10, max_num_batched_tokens=8)
    req = make_request("long", 37, max_tokens=3)
    assert engine.add_request(req) is None
    run_to_completion(engine)
    assert req.status is RequestStatus.FINISHED
    assert req.num_output_tokens == 3
    assert engine.scheduler.kv.pool.num_free_blocks == 10


def test_first_chunk_reserves_the_whole_prompt() -> None:
    engine = make_engine(block_size=4, num_gpu_blocks=10, max_num_batched_tokens=8)
    engine.add_request(make_request("long", 30))
    out = engine.schedule()
    assert out.scheduled[0].num_tokens == 8 and out.scheduled[0].is_prompt
    assert len(out.scheduled[0].new_block_ids) == 8  # ceil(30 / 4)
    assert engine.scheduler.waiting.num_in_progress == 1


def test_prompt_larger_than_the_cache_is_rejected_with_both_sizes() -> None:
    engine = make_engine(block_size=4, num_gpu_blocks=10)
    reason = engine.add_request(make_request("huge", 40))  # 40 + 1 tokens > 40
    assert reason is not None and "40 tokens" in reason and "10 blocks" in reason
    assert engine.records[-1].status == "rejected" and engine.records[-1].reason == reason
    assert not engine.has_unfinished()


def test_max_model_len_is_capped_by_the_cache_and_stops_with_length() -> None:
    engine = make_engine(block_size=4, num_gpu_blocks=4, max_model_len=1000)
    assert engine.scheduler.max_model_len == 16
    req = make_request("r", 10, max_tokens=100)
    engine.add_request(req)
    run_to_completion(engine)
    assert req.finish_reason.value == "length" and req.num_tokens == 16


def test_without_chunked_prefill_a_too_long_prompt_is_rejected() -> None:
    engine = make_engine(enable_chunked_prefill=False, max_num_batched_tokens=8, num_gpu_blocks=20)
    # max_model_len is capped at the budget: a preempted request is recomputed in one step.
    assert engine.scheduler.max_model_len == 8
    assert engine.add_request(make_request("r", 9)) is not None
    assert engine.add_request(make_request("q", 8)) is not None  # no room for an output token
    ok = make_request("s", 7, max_tokens=4)
    assert engine.add_request(ok) is None
    run_to_completion(engine)
    assert ok.status is RequestStatus.FINISHED and ok.num_tokens == 8  # stopped by length


def test_watermark_holds_back_new_prompts_only() -> None:
    engine = make_engine(
        block_size=4, num_gpu_blocks=10, prefill_watermark=0.5, max_num_batched_tokens=64
    )
    engine.add_request(make_request("a", 24, max_tokens=50))  # 6 of 10 blocks: usage 0.6
    engine.step()
    engine.add_request(make_request("b", 4))
    out = engine.schedule()
    assert [s.req_id for s in out.scheduled] == ["a"]


def test_fcfs_and_running_first() -> None:
    engine = make_engine(num_gpu_blocks=50, max_num_batched_tokens=16)
    engine.add_request(make_request("a", 4, max_tokens=5))
    engine.step()
    engine.add_request(make_request("b", 20))
    engine.add_request(make_request("c", 4))
    out = engine.schedule()
    assert [s.req_id for s in out.scheduled] == ["a", "b"]  # a decodes, b takes the rest
    assert [s.num_tokens for s in out.scheduled] == [1, 15]


def test_preemption_frees_the_newest_and_it_recomputes() -> None:
    engine = make_engine(
        block_size=4, num_gpu_blocks=6, max_num_batched_tokens=64, prefill_watermark=1.0
    )
    a = make_request("a", 8, max_tokens=8)
    b = make_request("b", 8, max_tokens=8)
    engine.add_request(a)
    engine.add_request(b)
    run_to_completion(engine)
    assert a.status is b.status is RequestStatus.FINISHED
    assert b.num_preemptions >= 1 and a.num_preemptions == 0
    assert a.num_output_tokens == b.num_output_tokens == 8


def test_prefix_cache_hit_skips_cached_blocks() -> None:
    engine = make_engine(num_gpu_blocks=20, max_num_batched_tokens=64)
    engine.add_request(make_request("a", 13))
    run_to_completion(engine)
    b = make_request("b", 13)
    engine.add_request(b)
    out = engine.schedule()
    assert out.scheduled[0].num_computed_tokens == 12 and out.scheduled[0].num_tokens == 1
    assert b.num_cached_tokens == 12


def test_prefill_role_finishes_after_the_first_token() -> None:
    engine = make_engine(role=EngineRole.PREFILL, num_gpu_blocks=20)
    r = make_request("p", 10, max_tokens=50)
    engine.add_request(r)
    run_to_completion(engine)
    assert r.num_output_tokens == 1 and r.finish_reason.value == "length"


def test_decode_role_starts_with_the_prompt_cached() -> None:
    engine = make_engine(role="decode", num_gpu_blocks=20)
    engine.add_request(make_request("d", 10, max_tokens=3))
    out = engine.schedule()
    assert out.scheduled[0].num_computed_tokens == 9 and out.scheduled[0].num_tokens == 1


def test_decode_role_tells_the_executor_its_hits_and_recomputes_a_preempted_request() -> None:
    """The blocks past its own prefix hits are the ones the imported KV fills
    (num_cached_blocks); preempted, it lost that KV and its outputs': it restarts as a
    prompt from its hits, like a request of the normal role."""
    engine = make_engine(role="decode", num_gpu_blocks=20, max_num_batched_tokens=64)
    engine.add_request(make_request("a", 13, max_tokens=2))
    run_to_completion(engine)
    b = make_request("b", 13, max_tokens=3)  # the same 12 leading tokens: 3 cached blocks
    engine.add_request(b)
    (sr,) = engine.schedule().scheduled
    assert (sr.num_computed_tokens, sr.num_cached_blocks, sr.is_prompt) == (12, 3, False)
    engine.scheduler._preempt(b)
    (sr,) = engine.schedule().scheduled
    assert sr.is_prompt and sr.num_computed_tokens == 12 and sr.num_cached_blocks == 3
    assert sr.num_tokens == b.num_tokens - 12


def test_abort_frees_blocks_and_is_terminal() -> None:
    engine = make_engine(num_gpu_blocks=20)
    engine.add_request(make_request("a", 10, max_tokens=50))
    engine.step()
    engine.abort("a")
    assert engine.records[-1].status == "aborted"
    assert engine.scheduler.kv.pool.num_free_blocks == 20 and not engine.has_unfinished()


def test_speculative_steps_verify_drafts_and_roll_back_rejections() -> None:
    engine = make_engine(num_speculative_tokens=3, num_gpu_blocks=40, acceptance_rate=0.5)
    r = make_request("s", 6, max_tokens=40)
    engine.add_request(r)
    engine.step()
    out = engine.schedule()
    assert out.scheduled[0].num_tokens == 4 and len(out.scheduled[0].draft_token_ids) == 3
    engine.apply_results(out, engine.executor.execute(out))
    run_to_completion(engine)
    assert r.num_output_tokens == 40
    assert engine.scheduler.step_id < 40  # some drafts were accepted


def test_async_scheduling_keeps_drafting_with_placeholders_outstanding() -> None:
    """Under async scheduling a step is scheduled while the one before is in flight: its
    drafts are placeholders the executor fills with its own proposals, its position
    assumes the drafts in flight were accepted, and the outputs equal synchronous ones."""
    results = []
    for async_ in (False, True):
        engine = make_engine(
            num_speculative_tokens=3, num_gpu_blocks=60, acceptance_rate=0.6,
            async_scheduling=async_,
        )  # fmt: skip
        reqs = [make_request(f"r{i}", 5 + 3 * i, max_tokens=17) for i in range(3)]
        for r in reqs:
            engine.add_request(r)
        run_to_completion(engine)
        results.append([r.output_token_ids for r in reqs])
        verifies = [s for s in engine.steps if s.num_batched_tokens > s.num_scheduled_reqs]
        assert len(verifies) > 5 and engine.scheduler.num_accepted_drafts > 0
        assert all(len(r.output_token_ids) == 17 for r in reqs)
    assert results[0] == results[1]


def test_async_scheduling_gives_the_same_outputs() -> None:
    results = []
    for async_ in (False, True):
        engine = make_engine(async_scheduling=async_, num_gpu_blocks=30, max_num_batched_tokens=16)
        reqs = [make_request(f"r{i}", 5 + 3 * i, max_tokens=6) for i in range(4)]
        for r in reqs:
            engine.add_request(r)
        run_to_completion(engine)
        results.append([(r.status, r.output_token_ids) for r in reqs])
    assert results[0] == results[1]


def test_stall_is_reported_with_a_diagnosis() -> None:
    engine = make_engine(num_gpu_blocks=10, check=False)  # the test corrupts the pool
    req = make_request("x", 8)
    engine.add_request(req)
    engine.scheduler.kv.pool.allocate(10)  # someone else took every block
    with pytest.raises(SchedulerStalled, match="head of waiting: 'x'"):
        engine.step()


def test_config_rejects_bad_values_naming_the_field() -> None:
    with pytest.raises(ValueError, match="prefill_watermark"):
        make_config(prefill_watermark=1.5)
    with pytest.raises(ValueError, match="unknown engine option"):
        type(make_config()).from_dict({"blok_size": 4})


def test_a_step_record_times_the_executor_even_when_it_runs_synchronously() -> None:
    """execute_async of a synchronous executor returns when the step is done: the step's
    duration starts before the call, not after it."""
    from tests.factories import ScriptedExecutor, StepClock

    clock = StepClock()  # 1 ms a reading

    class Slow(ScriptedExecutor):
        def execute(self, out):  # type: ignore[no-untyped-def]
            for _ in range(50):  # 50 ms of "work" on the injected clock
                clock()
            return super().execute(out)

    cfg = make_config()
    engine = EngineCore(cfg, Slow(cfg.num_gpu_blocks or 0), clock=clock)
    engine.add_request(make_request("a", 3, max_tokens=1))
    engine.step()
    assert engine.steps[-1].duration >= 0.050
