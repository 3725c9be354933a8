"""benchmarks/step_events.py's bookkeeping, with a stand-in clock for CUDA events (the
device run checks the numbers): the gap before a step is taken from the step launched
before it, whatever its id, and leaving restores the executor's own launch."""

from __future__ import annotations

import contextlib
from types import SimpleNamespace

import pytest
import torch


class _Clock:
    now = 0.0


class _Event:
    """Stamped with the stand-in clock (ms) when recorded."""

    def __init__(self, enable_timing: bool = False) -> None:
        self.t = None

    def record(self) -> None:
        self.t = _Clock.now

    def elapsed_time(self, other: _Event) -> float:
        return other.t - self.t


@pytest.fixture
def bench(monkeypatch):  # type: ignore[no-untyped-def]
    """The benchmark module, with the stand-in events in torch.cuda."""
    monkeypatch.setattr(torch.cuda, "Event", _Event)
    monkeypatch.setattr(torch.cuda, "device", lambda d: contextlib.nullcontext())
    monkeypatch.setattr(torch.cuda, "synchronize", lambda d=None: None)
    from benchmarks import step_events

    return step_events


class _Executor:
    device = torch.device("cuda")

    def execute_async(self, out):  # type: ignore[no-untyped-def]
        _Clock.now += out.work_ms  # the device work the launch queues
        return out.step_id


def test_gaps_follow_the_launch_order_and_leaving_restores_the_launch(bench) -> None:
    ex = _Executor()
    _Clock.now = 0.0
    with bench.StepEvents(ex) as ev:
        for sid, work, idle_after in ((0, 5.0, 2.0), (1, 4.0, 0.0), (3, 6.0, 1.0), (4, 3.0, 0.0)):
            assert ex.execute_async(SimpleNamespace(step_id=sid, work_ms=work)) == sid
            _Clock.now += idle_after  # (step 2 was empty: never launched)
    assert "execute_async" not in vars(ex)  # the class's method again
    assert ev.step(0) == (5e-3, None)
    assert ev.step(1) == (4e-3, 2e-3)
    assert ev.step(3) == (6e-3, 0.0)  # after step 1, not "step 2"
    assert ev.step(2) is None
    s = ev.summary([1, 3, 4])
    assert s["steps"] == 3 and s["span_ms"] == 4.0 and s["mean_gap_ms"] == 1.0
    assert ", " not in ev.line([1, 3, 4])


def test_an_instance_launch_shadowed_on_entry_comes_back(bench) -> None:
    ex = _Executor()
    own = lambda out: "spy"  # noqa: E731
    ex.execute_async = own  # type: ignore[method-assign]
    with bench.StepEvents(ex):
        assert ex.execute_async(SimpleNamespace(step_id=0, work_ms=1.0)) == "spy"
    assert ex.execute_async is own


def test_the_host_seconds_inside_each_launch_are_kept_by_step(bench) -> None:
    import time

    class _Slow(_Executor):
        def execute_async(self, out):  # type: ignore[no-untyped-def]
            time.sleep(out.host_s)
            return super().execute_async(out)

    ex = _Slow()
    with bench.StepEvents(ex) as ev:
        for sid, host_s in ((0, 0.0), (1, 0.02)):
            ex.execute_async(SimpleNamespace(step_id=sid, work_ms=1.0, host_s=host_s))
    assert set(ev.launch_seconds) == {0, 1}
    assert ev.launch_seconds[0] < 0.02 <= ev.launch_seconds[1]
