"""What EngineCore hands its scheduler from its arguments and its executor."""

from __future__ import annotations

import pytest

from deepinfer import scheduler_checks
from deepinfer.engine import EngineCore
from deepinfer.executor import StepHandle
from deepinfer.scheduler import Scheduler
from tests.factories import (
    ScriptedExecutor,
    StepClock,
    make_config,
    make_request,
    run_to_completion,
)


class VocabExecutor(ScriptedExecutor):
    """An executor whose model has a vocabulary (as the torch executor's)."""

    vocab_size = 50


def test_the_model_max_len_and_the_executor_vocabulary_limit_requests() -> None:
    cfg = make_config(num_gpu_blocks=40)
    engine = EngineCore(cfg, VocabExecutor(40), clock=StepClock(), model_max_len=12)
    assert engine.max_model_len == 12
    assert engine.add_request(make_request("long", 12)) == (
        "prompt of 12 tokens plus one output token exceeds max_model_len=12"
    )
    assert engine.add_request(make_request("oov", [3, 50, 7])) == (
        "prompt token id 50 is outside the vocabulary [0, 50)"
    )
    assert engine.add_request(make_request("ok", [3, 49, 7])) is None
    # Without them only the cache (40 blocks of 4) limits a request.
    plain = EngineCore(cfg, ScriptedExecutor(40), clock=StepClock())
    assert plain.max_model_len == 160
    assert plain.add_request(make_request("long", 12)) is None
    assert plain.add_request(make_request("oov", [3, 50, 7])) is None


@pytest.mark.parametrize("asked", [None, False, True])
def test_the_per_step_self_checks_run_only_when_asked(
    asked: bool | None, monkeypatch: pytest.MonkeyPatch
) -> None:
    """They walk every block each step: off by default, on with check_invariants=True."""
    cfg = make_config(num_gpu_blocks=40)
    kwargs = {} if asked is None else {"check_invariants": asked}
    engine = EngineCore(cfg, ScriptedExecutor(40), clock=StepClock(), **kwargs)
    calls: list[None] = []
    check = scheduler_checks.check_invariants

    def counted(sched: Scheduler) -> None:
        calls.append(check(sched))

    monkeypatch.setattr(scheduler_checks, "check_invariants", counted)
    engine.add_request(make_request("a", 6, max_tokens=3))
    run_to_completion(engine)
    assert bool(calls) == bool(asked), f"check_invariants={asked}: {len(calls)} checks ran"


class _ManualClock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


class _TimedSyncExecutor(ScriptedExecutor):
    """Does each step's work inside execute_async (as the torch runner does for a step
    with drafts or grammars): step k takes k seconds on the clock."""

    def __init__(self, num_blocks: int, clock: _ManualClock) -> None:
        super().__init__(num_blocks)
        self.clock = clock

    def execute_async(self, out):  # type: ignore[no-untyped-def]
        self.clock.now += out.step_id
        return super().execute_async(out)


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_a_step_done_inside_its_launch_is_timed_there(async_scheduling: bool) -> None:
    """Under async scheduling step N+1 is launched before N is applied; when the launch
    itself runs the step, N's duration must not take N+1's time with it (the varlen
    policy prices draft lengths from these durations)."""
    _assert_each_step_timed_by_its_launch(_TimedSyncExecutor, async_scheduling)


def _assert_each_step_timed_by_its_launch(executor: type, async_scheduling: bool) -> None:
    """A request of 6 tokens through `executor` (its launch of step N advances the clock
    by N seconds): each step's duration is N, its own launch's time."""
    clock = _ManualClock()
    cfg = make_config(num_gpu_blocks=40, async_scheduling=async_scheduling)
    engine = EngineCore(cfg, executor(40, clock), clock=clock)
    engine.add_request(make_request("a", 4, max_tokens=6))
    while engine.has_unfinished():
        engine.step()
    assert [r.finish_reason for r in engine.records] == ["length"]
    assert len(engine.steps) >= 6
    assert [s.duration for s in engine.steps] == [float(s.step_id) for s in engine.steps]


class _Pending(StepHandle):
    """A handle whose step is still running after its launch returned: `result()` waits
    `wait` seconds on the clock. With `has_done` it says so (`done()` False); without,
    it keeps the contract's `done()`, which cannot tell (False: not known)."""

    def __init__(self, value, clock: _ManualClock, wait: float, has_done: bool) -> None:  # type: ignore[no-untyped-def]
        self._value, self._clock, self._wait = value, clock, wait
        if has_done:
            self.done = lambda: False  # type: ignore[method-assign]

    def result(self, timeout: float | None = None):  # type: ignore[no-untyped-def]
        self._clock.now += self._wait
        return self._value


class _HostThenDeviceExecutor(ScriptedExecutor):
    """Each launch takes 0.25 s of host time and returns before step k's k seconds of
    device time, which the handle's result() waits for."""

    def __init__(self, num_blocks: int, clock: _ManualClock, has_done: bool) -> None:
        super().__init__(num_blocks)
        self.clock, self.has_done = clock, has_done

    def execute_async(self, out):  # type: ignore[no-untyped-def]
        self.clock.now += 0.25
        res = self.execute(out)
        return _Pending(res, self.clock, float(out.step_id), self.has_done)


@pytest.mark.parametrize("has_done", [True, False])
def test_a_launch_that_returns_before_its_step_ends_is_timed_at_the_result(has_done) -> None:
    """Time passed in the launch does not make the launch the step's end: unless the
    handle says the step is done, the step ends when its result comes (launch + device)."""
    clock = _ManualClock()
    cfg = make_config(num_gpu_blocks=40)
    engine = EngineCore(cfg, _HostThenDeviceExecutor(40, clock, has_done), clock=clock)
    engine.add_request(make_request("a", 4, max_tokens=6))
    while engine.has_unfinished():
        engine.step()
    assert [r.finish_reason for r in engine.records] == ["length"]
    assert [s.duration for s in engine.steps] == [0.25 + s.step_id for s in engine.steps]


class _RanInLaunchExecutor(ScriptedExecutor):
    """As a CPU runs a step: its launch does step k's k seconds of work and returns a
    handle whose result is still unread (`done()` False) and says the launch ran it;
    reading the result then takes 0.5 s more."""

    def __init__(self, num_blocks: int, clock: _ManualClock) -> None:
        super().__init__(num_blocks)
        self.clock = clock

    def execute_async(self, out):  # type: ignore[no-untyped-def]
        self.clock.now += out.step_id
        handle = _Pending(self.execute(out), self.clock, 0.5, has_done=True)
        handle.ran_in_launch = True
        return handle


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_a_step_its_launch_ran_is_timed_by_the_launch(async_scheduling: bool) -> None:
    """A handle that says its launch ran the step (`ran_in_launch`, the torch executor
    on a CPU) ends the step at the launch's return, though its result is unread: under
    async scheduling N's end was read after N+1's launch, which did N+1's work."""
    _assert_each_step_timed_by_its_launch(_RanInLaunchExecutor, async_scheduling)
