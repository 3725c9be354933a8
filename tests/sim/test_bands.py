"""Uncertainty bands: replicates of a run with step prices drawn from a profile's noise
(sim/bands.py, sim/noisy_cost_model.py, sim/step_noise.py)."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from deepinfer.config import EngineConfig
from deepinfer.entrypoints.cli import main as cli_main
from sim import load_trace, simulate
from sim.bands import band_of, simulate_bands
from sim.cost_model_registry import engine_cost_model
from sim.hardware import get_hardware
from sim.noisy_cost_model import NoisyCostModel
from sim.step_noise import KindNoise, StepNoise
from sim.traces.retime import poisson

TRACES = Path(__file__).resolve().parents[2] / "traces"
MODEL = "moonlight-16b-a3b"
ENGINE = EngineConfig(num_gpu_blocks=2000, max_num_seqs=32)


def _trace(n: int = 40):  # type: ignore[no-untyped-def]
    return poisson(load_trace(TRACES / "azure_code_small.json", max_requests=n), 4.0, seed=1)


def _noise(ratio: float, sigma: float) -> StepNoise:
    """Every kind's run factor 1/ratio or ratio, its steps' sigma `sigma`."""
    return StepNoise({"decode": KindNoise((1 / ratio, ratio), sigma)}, "planted")


def _records(result):  # type: ignore[no-untyped-def]
    return [(r.first_token, r.finish, r.token_times) for r in result.requests]


def test_a_noisy_model_without_noise_prices_every_step_as_the_model_it_wraps() -> None:
    """Run factors of exactly 1 and no per-step spread: the same run to the bit."""
    trace = _trace()
    cost, _ = engine_cost_model(None, _spec(), get_hardware("h200"), None, ENGINE)
    silent = StepNoise({"decode": KindNoise((1.0,), 0.0)}, "none")
    plain = simulate(trace, MODEL, engine=ENGINE)
    noisy = simulate(trace, MODEL, engine=ENGINE, cost_model=NoisyCostModel(cost, silent, 7))
    assert _records(noisy) == _records(plain)


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_a_step_draws_the_same_factor_alone_and_in_a_fast_forwarded_run(
    async_scheduling: bool,
) -> None:
    """Draws are keyed by (seed, step id), not taken in call order: fast-forwarding
    decode runs leaves a noisy run the same to the bit, as it does a plain one."""
    trace = _trace()
    engine = ENGINE.replace(async_scheduling=async_scheduling)
    cost, _ = engine_cost_model(None, _spec(), get_hardware("h200"), None, engine)
    noisy = NoisyCostModel(cost, _noise(1.1, 0.05), seed=3)
    fast = simulate(trace, MODEL, engine=engine, cost_model=noisy)
    slow = simulate(trace, MODEL, engine=engine, cost_model=noisy, fast_forward=False)
    assert fast.meta["fast_forward"]["steps"] > 0
    assert _records(fast) == _records(slow)


def test_the_band_holds_the_point_estimate_and_widens_with_the_noise() -> None:
    trace = _trace()
    point = simulate(trace, MODEL, engine=ENGINE)
    narrow = simulate_bands(
        trace, MODEL, "h200", ENGINE, point, replicates=8, noise=_noise(1.01, 0.001)
    )
    wide = simulate_bands(trace, MODEL, "h200", ENGINE, point, replicates=8, noise=_noise(1.3, 0.1))
    for key in ("ttft_ms_p50", "tpot_ms_p50", "e2el_ms_p99", "makespan_s"):
        for bands in (narrow, wide):
            band = bands.figures[key]
            assert band.low <= band.point <= band.high
            assert band.point == point.summary[key]
        narrow_width, wide_width = (
            b.figures[key].high - b.figures[key].low for b in (narrow, wide)
        )
        assert wide_width > 3 * narrow_width > 0, key
    text = "\n".join(wide.lines())
    assert "TTFT p99" in text and "95% band" in text


def test_the_same_seed_gives_the_same_band_and_another_seed_another() -> None:
    trace = _trace()
    point = simulate(trace, MODEL, engine=ENGINE)

    def bands(seed: int):  # type: ignore[no-untyped-def]
        return simulate_bands(
            trace, MODEL, "h200", ENGINE, point, replicates=4, seed=seed, noise=_noise(1.2, 0.05)
        ).figures

    assert bands(5) == bands(5)
    assert bands(5) != bands(6)


def test_a_sampled_workload_is_drawn_again_in_each_replicate() -> None:
    """Poisson re-timing: replicate i runs its own arrivals; with no step noise at all
    the band is the workload's alone."""
    sized = load_trace(TRACES / "azure_code_small.json", max_requests=40)
    trace = poisson(sized, 4.0, seed=0)
    point = simulate(trace, MODEL, engine=ENGINE)
    silent = StepNoise({"decode": KindNoise((1.0,), 0.0)}, "none")
    seen: list[int] = []

    def workload(i: int):  # type: ignore[no-untyped-def]
        seen.append(i)
        return poisson(sized, 4.0, seed=1 + i)

    bands = simulate_bands(
        trace, MODEL, "h200", ENGINE, point, replicates=5, noise=silent, workload=workload
    )
    assert seen == [0, 1, 2, 3, 4] and bands.workload_resampled
    ttft = bands.figures["ttft_ms_p50"]
    assert ttft.high > ttft.low


def test_band_quantiles_and_the_point_outside_them() -> None:
    values = [float(v) for v in range(101)]
    band = band_of(50.0, values)
    assert (band.low, band.high) == pytest.approx((2.5, 97.5))
    assert band_of(200.0, values).high == 200.0  # widened to hold the point
    assert math.isnan(band_of(1.0, [float("nan")]).low)  # no finite replicate: no band


def test_bands_refuse_what_they_cannot_draw_or_would_overwrite() -> None:
    trace = _trace(5)
    point = simulate(trace, MODEL, engine=ENGINE, cost_model="unit")
    with pytest.raises(ValueError, match="no profile"):
        simulate_bands(trace, MODEL, "h200", ENGINE, point, replicates=2, cost_model="unit")
    with pytest.raises(ValueError, match="step_log"):
        simulate_bands(trace, MODEL, "h200", ENGINE, point, replicates=2, step_log="x.jsonl")
    with pytest.raises(ValueError, match="data_parallel_size"):
        simulate_bands(
            trace, MODEL, "h200", ENGINE.replace(data_parallel_size=2), point, replicates=2
        )


def test_a_kind_the_profile_does_not_cover_takes_the_widest_noise() -> None:
    noise = StepNoise(
        {"decode": KindNoise((0.99, 1.01), 0.01), "mixed": KindNoise((0.8, 1.2), 0.03)}, "two"
    )
    assert noise.for_kind("verify") == KindNoise((0.8, 1.2), 0.03)
    assert noise.for_kind("decode") == KindNoise((0.99, 1.01), 0.01)
    with pytest.raises(ValueError, match="ratios must be > 0"):
        StepNoise({"decode": KindNoise((0.0,), 0.01)}, "bad")


def test_simulate_gives_bands_only_when_asked(tmp_path: Path, capsys) -> None:  # type: ignore[no-untyped-def]
    """The default run prints and writes no band (it is the exact run); --bands N adds
    them, from the shipped profile's held-out errors, to the table and the report."""
    args = ["simulate", str(TRACES / "azure_code_small.json"), "--no-progress",
            "--max-requests", "30", "--request-rate", "3"]  # fmt: skip
    assert cli_main([*args, "--out", str(tmp_path / "plain.json")]) == 0
    plain = capsys.readouterr().out
    assert cli_main([*args, "--out", str(tmp_path / "bands.json"), "--bands", "3"]) == 0
    banded = capsys.readouterr().out
    assert "95% band" not in plain
    assert banded.startswith(plain.split("report:")[0])  # the same run, then its bands
    assert "95% bands over 3 replicates" in banded
    assert "the workload drawn again" in banded
    report = json.loads((tmp_path / "bands.json").read_text())
    assert "bands" not in json.loads((tmp_path / "plain.json").read_text())["meta"]
    band = report["meta"]["bands"]["figures"]["ttft_ms_p99"]
    assert band["low"] <= band["point"] <= band["high"]
    assert cli_main([*args, "--bands", "0"]) == 2
    assert "--bands 0" in capsys.readouterr().err


def _spec():  # type: ignore[no-untyped-def]
    from deepinfer.model_config import load_model_config

    return load_model_config(MODEL)


def test_a_noisy_model_built_for_another_engine_wraps_the_model_fitted_for_this_one() -> None:
    """A NoisyCostModel over a profiled model built for other settings passes
    `for_engine` to it: the same draws over the prices of the engine it is given to."""
    trace = _trace()
    hw = get_hardware("h200")
    engine = ENGINE.replace(async_scheduling=True, max_num_seqs=32)
    built, _ = engine_cost_model(None, _spec(), hw, None, ENGINE.replace(async_scheduling=False))
    fitted, _ = engine_cost_model(None, _spec(), hw, None, engine)
    noise = _noise(1.1, 0.05)
    given = simulate(trace, MODEL, engine=engine, cost_model=NoisyCostModel(built, noise, 3))
    want = simulate(trace, MODEL, engine=engine, cost_model=NoisyCostModel(fitted, noise, 3))
    assert _records(given) == _records(want)
