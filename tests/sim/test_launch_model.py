"""A step's launch on the host priced apart from its device work (sim/cost_model.py,
`CostModel.launch_seconds`; executors/profiler.py measures both): the fit, the timeline
that takes both, and a profile without them priced as before."""

from __future__ import annotations

import json
import warnings

import pytest

from deepinfer.config import EngineConfig
from deepinfer.model_config import load_model_config
from sim import simulate
from sim.cost_model import device_span
from sim.engine_loop import Clock, Timeline
from sim.hardware import get_hardware
from sim.profiled_cost_model import PROFILES_DIR, ProfiledCostModel, shape_output
from sim.traces import Trace, TraceRequest
from tests.sim.launch_profiles import (
    CHUNK_LAUNCH_S,
    DECODE_BESIDE_S,
    GRAPH_LAUNCH_S,
    with_launch_times,
)

NAME = "moonlight-16b-a3b__h200"


def _cost(async_scheduling: bool = True, launch: bool = True) -> ProfiledCostModel:
    profile = with_launch_times(NAME) if launch else PROFILES_DIR / f"{NAME}.json"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return ProfiledCostModel(
            profile, load_model_config("moonlight-16b-a3b"), get_hardware("h200"),
            async_scheduling=async_scheduling,
        )  # fmt: skip


DECODE = shape_output([[8, 1, 2048, False]])
MIXED = shape_output([[4, 1, 4096, False], [1, 300, 0, True]])
LONE = shape_output([[1, 700, 0, True]])


def test_the_launch_fit_prices_each_forward_path_as_measured() -> None:
    cost = _cost()
    assert cost.launch_seconds(DECODE) == pytest.approx(GRAPH_LAUNCH_S, rel=0.2)
    assert cost.launch_seconds(LONE) == pytest.approx(CHUNK_LAUNCH_S, rel=0.2)
    assert cost.launch_seconds(MIXED) == pytest.approx(CHUNK_LAUNCH_S + DECODE_BESIDE_S, rel=0.2)
    assert cost.launch_seconds(shape_output([])) == 0.0


def test_a_pipelined_step_is_priced_at_its_device_time_and_on_an_idle_device_as_before() -> None:
    """The device's own time is under the pipelined time of a launch-bound step; on an
    idle device the step still costs its sequential time (both figures of launch_cost)."""
    before, after = _cost(launch=False), _cost()
    for out in (MIXED, LONE):
        priced, idle = after.launch_cost(out)
        old_priced, old_idle = before.launch_cost(out)
        assert priced < 0.8 * old_priced
        assert priced + idle == pytest.approx(old_priced + old_idle, rel=1e-9)
    decode, old = after.launch_cost(DECODE), before.launch_cost(DECODE)
    assert decode == pytest.approx(old, rel=0.02)


def test_without_launch_times_or_async_scheduling_a_launch_is_instant() -> None:
    assert _cost(launch=False).launch_seconds(MIXED) == 0.0
    for launch in (False, True):
        assert _cost(async_scheduling=False, launch=launch).launch_seconds(MIXED) == 0.0


def test_a_launch_bound_step_ends_a_sequential_time_after_its_launch_began() -> None:
    """A chunk launched while a decode step runs, as the model prices it: the host issues
    it for its launch, and the device, done with the decode, runs its kernels as they
    come, so it ends its sequential time after its launch began (its device time after
    that would end it sooner), not after the decode plus its pipelined price; the
    decode's results are read once the launch returned."""
    before, cost = _cost(launch=False), _cost()
    decode = cost.launch_cost(DECODE)
    priced, idle = cost.launch_cost(MIXED)
    launch = cost.launch_seconds(MIXED)
    clock = Clock()
    tl = Timeline(clock, on_host=False)
    tl.scheduled(0.0)
    tl.launched(1, 0.0, decode[0], decode[1], cost.launch_seconds(DECODE))
    tl.scheduled(cost.cpu_time(MIXED))  # the chunk scheduled while the decode runs
    start, decode_end = clock.now, tl.device_free
    assert decode_end > start  # (the decode still runs)
    tl.launched(2, 0.0, priced, idle, launch)
    assert tl.device_free == pytest.approx(start + priced + idle)
    assert tl.device_free < decode_end + sum(before.launch_cost(MIXED)) - 0.002
    tl.awaited(1)
    assert clock.now == pytest.approx(start + launch)


def test_the_per_step_span_is_the_timelines() -> None:
    """`device_span` (the fidelity table's and `profile --check`'s price of a real step)
    is the span the timeline gives the step: behind a step with some device time left,
    or on an idle device."""
    cost = _cost()
    for first, second in ((DECODE, MIXED), (MIXED, DECODE), (DECODE, LONE), (LONE, MIXED)):
        clock = Clock()
        tl = Timeline(clock, on_host=False)
        tl.scheduled(0.0)
        tl.launched(1, 0.0, *cost.launch_cost(first), 0.0)  # (its launch: not the span's)
        start, end = clock.now, tl.device_free
        tl.launched(2, 0.0, *cost.launch_cost(second), cost.launch_seconds(second))
        behind = end - start
        priced, idle = cost.launch_cost(second)
        assert tl.device_free - end == pytest.approx(device_span(priced, idle, behind))
        fresh = Timeline(Clock(), on_host=False)  # the same step on an idle device
        fresh.launched(3, 0.0, priced, idle, cost.launch_seconds(second))
        assert fresh.device_free == pytest.approx(device_span(priced, idle, None))


def test_a_device_bound_step_is_priced_as_before() -> None:
    """A launch shorter than the device's work changes nothing but the host's time."""
    clock = Clock()
    tl = Timeline(clock, on_host=False)
    tl.scheduled(0.001)
    tl.launched(1, 0.0, 0.010, 0.002, 0.0004)
    assert tl.device_free == pytest.approx(0.001 + 0.002 + 0.010)
    assert tl.host_free == pytest.approx(0.001 + 0.0004)


def test_launch_times_shorten_a_served_run_of_launch_bound_chunks() -> None:
    """Arrivals whose prompts run beside decodes: priced apart, each chunk's launch
    overlaps the decode before it, so the run is quicker than at the pipelined times
    (which stack the chunk's whole period after the decode)."""
    trace = Trace(
        "arrivals", "python",
        [TraceRequest(f"r{i}", 0.03 * i, 300, 40) for i in range(12)],
    )  # fmt: skip
    engine = EngineConfig(async_scheduling=True)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        before = simulate(trace, "moonlight-16b-a3b", "h200", engine, _cost(launch=False))
        after = simulate(trace, "moonlight-16b-a3b", "h200", engine, _cost())
    assert after.summary["makespan_s"] < before.summary["makespan_s"]


def test_the_grid_check_holds_out_the_launch_fit() -> None:
    """`profile --check-grid` prices each point's launch by the launch fit of the other
    points, on a line of its own; a profile without launch times has none."""
    from sim.grid_check import check_grid

    model, hardware = load_model_config("moonlight-16b-a3b"), get_hardware("h200")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        timed = check_grid(with_launch_times(NAME), model, hardware, folds=4)
        shipped = json.loads((PROFILES_DIR / f"{NAME}.json").read_text())
        plain = check_grid(shipped, model, hardware, folds=4)
    assert timed.launch is not None and len(timed.launch.errors) > 40
    assert timed.launch.median_abs < 0.02  # (the made-up launches are the fit's own form)
    assert "launch" in timed.table() and timed.to_dict()["launch"]["errors"]
    assert plain.launch is None and "launch" not in plain.table()
