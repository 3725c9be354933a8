"""A step's launch on the host priced apart from its device work (sim/cost_model.py,
`CostModel.launch_seconds`; executors/profiler.py measures both): the fit, the timeline
that takes both, and a profile without them priced as before."""

from __future__ import annotations

import warnings

import pytest

from deepinfer.config import EngineConfig
from deepinfer.model_config import load_model_config
from sim import simulate
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


@pytest.mark.parametrize("launch", [False, True])
def test_without_launch_times_or_async_scheduling_a_launch_is_instant(launch: bool) -> None:
    assert _cost(launch=False).launch_seconds(MIXED) == 0.0
    assert _cost(async_scheduling=False, launch=launch).launch_seconds(MIXED) == 0.0


def test_a_launch_bound_step_ends_with_its_launch_not_after_the_step_before() -> None:
    """A chunk launched while a decode step runs: the host issues it for `launch` seconds,
    the device ends the decode and then the chunk's kernels as they come, so the chunk
    ends when its launch does (its own work shorter), not the decode's end plus its
    price; the decode's results wait for the host to finish the launch."""
    clock = Clock()
    tl = Timeline(clock, on_host=False)
    tl.scheduled(0.0)
    tl.launched(1, 0.0, 0.004, 0.0, 0.0003)  # a decode: 4 ms on the device
    tl.scheduled(0.0005)  # the chunk scheduled while it runs
    start = clock.now
    tl.launched(2, 0.0, 0.005, 0.0, 0.016)  # 5 ms of device work, 16 ms to launch
    assert tl.device_free == start + 0.016
    assert tl.host_free == start + 0.016
    tl.awaited(1)  # the decode's results: read once the launch returned
    assert clock.now == start + 0.016
    tl.scheduled(0.0)
    tl.launched(3, 0.0, 0.006, 0.0, 0.0)  # device-bound: after the chunk
    assert tl.device_free == start + 0.016 + 0.006


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
    (which stack the chunk's whole period after the decode), and slower than with the
    launches free: the launch is the chunk's floor."""
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
    assert len(after.requests) == len(before.requests) == 12
