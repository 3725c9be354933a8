"""What the scheduler takes from the engine and its callers beyond the config: the
model's max length and the executor's vocabulary and token-id needs, request ids, the
priority policy, and its own abort and reject calls (paths the property suite's
simulated engine never takes)."""

from __future__ import annotations

import pytest

from deepinfer.engine import EngineCore
from deepinfer.request import FinishReason, RequestStatus
from deepinfer.scheduler import Scheduler
from tests.factories import (
    ScriptedExecutor,
    StepClock,
    make_config,
    make_engine,
    make_request,
    run_to_completion,
)


def test_the_models_max_len_caps_max_model_len() -> None:
    cfg = make_config(num_gpu_blocks=20)
    engine = EngineCore(cfg, ScriptedExecutor(20), clock=StepClock(), model_max_len=12)
    assert engine.max_model_len == 12
    reason = engine.add_request(make_request("long", 12))  # no room for an output token
    assert reason is not None and "max_model_len=12" in reason
    req = make_request("r", 5, max_tokens=100)
    engine.add_request(req)
    run_to_completion(engine)
    assert req.finish_reason is FinishReason.LENGTH and req.num_tokens == 12


class WithVocabulary(ScriptedExecutor):
    vocab_size = 50


def test_a_prompt_token_outside_the_executors_vocabulary_is_rejected() -> None:
    engine = EngineCore(make_config(num_gpu_blocks=20), WithVocabulary(20), clock=StepClock())
    reason = engine.add_request(make_request("r", [1, 49, 50]))
    assert reason == "prompt token id 50 is outside the vocabulary [0, 50)"
    assert engine.add_request(make_request("ok", [0, 1, 49])) is None


def test_a_scheduler_sends_token_ids_only_when_asked() -> None:
    """The simulator's executor needs no token ids: building them would cost host time."""
    plain = Scheduler(make_config(), 10)
    plain.add_request(make_request("r", 3))
    assert plain.schedule().scheduled[0].token_ids is None
    real = Scheduler(make_config(), 10, emit_token_ids=True)
    real.add_request(make_request("r", 3))
    assert real.schedule().scheduled[0].token_ids == [1, 2, 3]


def test_a_request_id_already_in_the_engine_is_refused_naming_it() -> None:
    engine = make_engine()
    engine.add_request(make_request("a", 3))
    with pytest.raises(ValueError, match="request id 'a' is already in the engine"):
        engine.add_request(make_request("a", 5))


def test_the_priority_policy_starts_the_most_urgent_waiting_request_first() -> None:
    engine = make_engine(policy="priority", max_num_seqs=1, num_gpu_blocks=20)
    low = make_request("low", 3, max_tokens=2)
    low.priority = 3
    urgent = make_request("urgent", 3, max_tokens=2)
    urgent.priority = 0
    engine.add_request(low)
    engine.add_request(urgent)
    assert [sr.req_id for sr in engine.schedule().scheduled] == ["urgent"]


def test_scheduler_abort_ends_a_live_request_as_aborted_and_frees_its_blocks() -> None:
    sched = Scheduler(make_config(num_gpu_blocks=10), 10)
    req = make_request("a", 6)
    sched.add_request(req)
    sched.schedule()
    assert sched.abort("a") is req
    assert (req.status, req.finish_reason) == (RequestStatus.ABORTED, FinishReason.ABORT)
    assert sched.num_aborted == 1 and sched.kv.pool.num_free_blocks == 10
    assert sched.abort("a") is None  # no longer live


def test_only_a_request_never_scheduled_can_be_rejected() -> None:
    sched = Scheduler(make_config(num_gpu_blocks=10), 10)
    waiting, preempted = make_request("w", 3), make_request("p", 3)
    sched.add_request(preempted)
    sched.fail_step([sched.schedule()], {})  # requeued with nothing computed, once scheduled
    assert preempted.status is RequestStatus.PREEMPTED and not preempted.num_computed_tokens
    sched.add_request(waiting)
    assert sched.add_request(make_request("huge", 100)) is not None  # rejected on arrival
    message = r"reject\('p'\): only a request never scheduled can be rejected"
    with pytest.raises(ValueError, match=message):
        sched.reject("p", "grammar failed")
    assert sched.reject("w", "grammar failed") is waiting
    assert (waiting.status, waiting.finish_reason) == (
        RequestStatus.REJECTED,
        FinishReason.REJECTED,
    )
    assert waiting.reject_reason == "grammar failed" and sched.num_rejected == 2
    assert sched.reject("w", "again") is None
