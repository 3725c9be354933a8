"""Uncertainty bands of a simulation's headline figures: the same run again with its step
prices drawn from the profile's noise, and (where the workload is sampled) its workload
drawn again.

`simulate_bands` runs `replicates` simulations, each pricing steps through a
`NoisyCostModel` (sim/noisy_cost_model.py) of its own seed: the profile's held-out
errors per step kind drawn once a run, and each step's measured spread drawn every step
(sim/step_noise.py). Where the caller gives `workload`, replicate i runs
`workload(i)` (a Poisson re-timing of its own seed, say) instead of the trace. A
figure's band is the 2.5% to 97.5% quantiles of the replicates' values (interpolated:
with few replicates the band is coarse), widened where needed to hold the point
estimate, the run without noise (the run of every factor's median). Replicate seeds are
derived from `seed`, so a band is reproducible; the run without `--bands` never
reaches this module and is unchanged.
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from deepinfer.config import EngineConfig
from deepinfer.model_config import ModelConfig, load_model_config
from sim.cost_model import CostModel
from sim.cost_model_registry import engine_cost_model
from sim.hardware import HardwareSpec, get_hardware
from sim.keyed_draws import unit_draw
from sim.noisy_cost_model import NoisyCostModel
from sim.profiled_cost_model import ProfiledCostModel, load_profile
from sim.simulator import SimResult, simulate
from sim.step_noise import StepNoise
from sim.traces import Trace

LEVEL = 0.95
# The summary's headline figures (deepinfer/metrics.py keys): label and unit each.
HEADLINE: Mapping[str, tuple[str, str]] = {
    "ttft_ms_p50": ("TTFT p50", "ms"),
    "ttft_ms_p99": ("TTFT p99", "ms"),
    "tpot_ms_p50": ("TPOT p50", "ms"),
    "tpot_ms_p99": ("TPOT p99", "ms"),
    "e2el_ms_p50": ("E2E p50", "ms"),
    "e2el_ms_p99": ("E2E p99", "ms"),
    "makespan_s": ("makespan", "s"),
    "output_throughput": ("throughput", "tok/s"),
}
_REPLICATE = 0x0BA2D  # folded with the seed and the replicate's index: its noise seed


def headline_figures(result: SimResult) -> dict[str, float]:
    """The HEADLINE figures of a run's summary (NaN where the summary has none)."""
    s = result.summary
    return {k: float(s[k]) if s.get(k) is not None else math.nan for k in HEADLINE}


@dataclass(frozen=True)
class Band:
    """A figure: the point estimate and its band [low, high]."""

    point: float
    low: float
    high: float

    def contains(self, value: float) -> bool:
        return self.low <= value <= self.high

    def to_dict(self) -> dict[str, float]:
        return {"point": self.point, "low": self.low, "high": self.high}


@dataclass(frozen=True)
class Bands:
    """The bands of a run's figures over `replicates` noisy replicates."""

    replicates: int
    seed: int
    noise: str  # where the step noise came from
    workload_resampled: bool
    figures: dict[str, Band]

    def lines(self) -> list[str]:
        """The report's lines: a heading, then each figure as `TTFT p99 612 ms (95% band
        570-660)`."""
        drawn = "; the workload drawn again each replicate" if self.workload_resampled else ""
        out = [
            f"{LEVEL:.0%} bands over {self.replicates} replicates (seed {self.seed}): step "
            f"prices drawn from {self.noise}{drawn}"
        ]
        for key, band in self.figures.items():
            label, unit = HEADLINE.get(key, (key, ""))
            if not math.isfinite(band.point):
                continue
            out.append(
                f"  {label:12s} {_num(band.point)} {unit} ({LEVEL:.0%} band "
                f"{_num(band.low)}-{_num(band.high)})"
            )
        return out

    def to_dict(self) -> dict[str, Any]:
        return {
            "level": LEVEL,
            "replicates": self.replicates,
            "seed": self.seed,
            "noise": self.noise,
            "workload_resampled": self.workload_resampled,
            "figures": {k: b.to_dict() for k, b in self.figures.items()},
        }


def _num(x: float) -> str:
    return f"{x:,.0f}" if abs(x) >= 100 else f"{x:.3g}"


def band_of(point: float, values: list[float]) -> Band:
    """The LEVEL band of `values` (the finite ones), widened to hold `point`."""
    finite = [v for v in values if math.isfinite(v)]
    if not finite or not math.isfinite(point):
        return Band(point, math.nan, math.nan)
    tail = (1 - LEVEL) / 2
    low, high = (float(q) for q in np.quantile(finite, [tail, 1 - tail]))
    return Band(point, min(low, point), max(high, point))


def simulate_bands(
    trace: Trace,
    model: str | ModelConfig,
    hardware: str | HardwareSpec,
    engine: EngineConfig,
    point: SimResult,
    *,
    replicates: int,
    seed: int = 0,
    cost_model: str | CostModel | None = None,
    profile: str | Path | None = None,
    workload: Callable[[int], Trace] | None = None,
    figures: Callable[[SimResult], dict[str, float]] = headline_figures,
    noise: StepNoise | None = None,
    on_replicate: Callable[[], None] | None = None,
    **simulate_options: Any,
) -> Bands:
    """The bands of `point`'s figures (`point`: `simulate` of the same arguments without
    noise) over `replicates` replicates; see the module docstring.

    The cost model must be the profiled one (`cost_model` and `profile` as `simulate`
    takes them): the noise comes from its profile (`noise` None: `StepNoise.from_profile`)
    unless `noise` is given. workload: replicate i's trace (None: `trace` each time).
    figures: what a run's figures are (default: the summary's HEADLINE ones).
    on_replicate: called after each replicate (a progress bar).
    simulate_options: passed to each `simulate` (slo, acceptance_rate, ...)."""
    if replicates < 1:
        raise ValueError(f"bands: replicates={replicates}, must be >= 1")
    if simulate_options.get("step_log") is not None:
        raise ValueError("bands: step_log is the run's own; its replicates write none")
    if engine.data_parallel_size > 1:
        raise ValueError(
            f"bands with data_parallel_size={engine.data_parallel_size}: the ranks' lock-step "
            "rounds would share each step's draw; simulate one rank"
        )
    spec = model if isinstance(model, ModelConfig) else load_model_config(model)
    hw = hardware if isinstance(hardware, HardwareSpec) else get_hardware(hardware)
    inner, cost_meta = engine_cost_model(cost_model, spec, hw, profile, engine)
    if noise is None:
        if not isinstance(inner, ProfiledCostModel) or not cost_meta.get("profile"):
            raise ValueError(
                f"bands: the step noise comes from a profile's held-out errors, and cost "
                f"model {cost_meta.get('cost_model')!r} has no profile; use the profiled "
                "cost model (--profile, or a model with a shipped one) or give the noise"
            )
        data = load_profile(cost_meta["profile"])
        noise = StepNoise.from_profile(data, spec.with_quantization(engine.quantization), hw)
    values: dict[str, list[float]] = {}
    for i in range(replicates):
        run_seed = int(unit_draw((seed, i, _REPLICATE)) * (1 << 53))
        noisy = NoisyCostModel(
            inner, noise, run_seed, speculating=engine.num_speculative_tokens > 0
        )
        load = workload(i) if workload is not None else trace
        with warnings.catch_warnings():  # (the run without noise warned already)
            warnings.simplefilter("ignore")
            result = simulate(load, spec, hw, engine, noisy, **simulate_options)
        for key, value in figures(result).items():
            values.setdefault(key, []).append(value)
        if on_replicate is not None:
            on_replicate()
    center = figures(point)
    return Bands(
        replicates,
        seed,
        noise.source,
        workload is not None,
        {k: band_of(center[k], values.get(k, [])) for k in center},
    )
