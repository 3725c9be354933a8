"""benchmarks/profile_step.py marks host regions by wrapping named methods of the engine
and the model runner: every name it wraps must exist on its owner (the benchmark runs
only on a GPU, so a renamed method would otherwise fail there alone), and leaving the
profile restores the methods."""

from __future__ import annotations

from types import SimpleNamespace

from benchmarks import host_overhead, profile_step
from deepinfer.engine import EngineCore
from tests.factories import ScriptedExecutor, StepClock, make_config


def test_every_method_the_step_profiler_marks_exists_and_is_restored_after() -> None:
    _, runner, _ = host_overhead.build(2, 4)
    core = EngineCore(make_config(num_gpu_blocks=40), ScriptedExecutor(40), clock=StepClock())
    owners = [core, runner, runner.inputs]
    with profile_step._mark_regions(core, SimpleNamespace(runner=runner)):
        marked = {(type(o).__name__, n) for o in owners for n in vars(o) if callable(vars(o)[n])}
        assert ("EngineCore", "schedule") in marked
        assert ("EngineCore", "apply_results") in marked
        assert ("InputBuilder", "collect") in marked
        assert ("ModelRunner", "launch") in marked
    for o in owners:
        assert not any(callable(v) and hasattr(v, "__wrapped__") for v in vars(o).values())
