"""A cost model's prices with drawn noise: one replicate of the simulator's uncertainty
bands (sim/bands.py).

`NoisyCostModel` prices a step as the model it wraps does, times a factor: the
replicate's systematic factor of the step's kind (drawn once, sim/step_noise.py) and
the step's own log-normal factor. Every draw is keyed (sim/keyed_draws.py): the kinds'
factors by (seed, kind), a step's by (seed, step id), so a step costs the same whether
the simulator prices it alone or in a fast-forwarded decode run, and the same seed gives
the same replicate. The host's price gets the host's systematic factor alone. Loads from
lower KV tiers are priced by the engine loop, outside any cost model: not perturbed.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

from sim.cost_model import CostModel, EngineSettings, RunCosts, prices_decode_runs
from sim.grid_check import KINDS, step_kind
from sim.keyed_draws import normal_draw, unit_draw
from sim.step_noise import StepNoise

if TYPE_CHECKING:
    from deepinfer.decode_run import DecodeRun
    from deepinfer.model_config import ModelConfig
    from deepinfer.outputs import SchedulerOutput
    from sim.hardware import HardwareSpec

_RUN, _STEP = 1, 2  # the last key of a kind's draw, the first after the seed of a step's


class NoisyCostModel(CostModel):
    """`inner`'s prices times drawn factors (see the module docstring). speculating: the
    engine's MTP drafter runs after every step (its steps are the profile's drafter
    kinds)."""

    def __init__(
        self, inner: CostModel, noise: StepNoise, seed: int, *, speculating: bool = False
    ) -> None:
        self.inner = inner
        self.noise = noise
        self.seed = seed
        self.speculating = speculating
        self.profile_name = inner.profile_name
        self.meta = inner.meta
        self.run_factors: dict[str, float] = {}
        self._sigma: dict[str, float] = {}
        for i, kind in enumerate(KINDS):
            k = noise.for_kind(kind)
            pick = int(unit_draw((seed, i, _RUN)) * len(k.ratios))
            self.run_factors[kind] = k.ratios[pick]
            self._sigma[kind] = k.sigma
        self._host = self.run_factors["host"]

    def for_engine(
        self, model: ModelConfig, hardware: HardwareSpec, settings: EngineSettings
    ) -> NoisyCostModel:
        """The same draws over `inner.for_engine(...)`'s prices."""
        inner = self.inner.for_engine(model, hardware, settings)
        speculating = bool(settings.num_speculative_tokens)
        if inner is self.inner and speculating == self.speculating:
            return self
        return NoisyCostModel(inner, self.noise, self.seed, speculating=speculating)

    def factor(self, kind: str, step_id: int) -> float:
        """The device price's factor of step `step_id` of `kind`."""
        sigma = self._sigma[kind]
        step = math.exp(sigma * normal_draw((self.seed, _STEP, step_id))) if sigma else 1.0
        return self.run_factors[kind] * step

    def _of(self, out: SchedulerOutput) -> float:
        return self.factor(step_kind(out, self.speculating), out.step_id)

    def step_time(self, out: SchedulerOutput) -> float:
        priced = self.inner.step_time(out)
        return priced * self._of(out) if priced else priced

    def cpu_time(self, out: SchedulerOutput) -> float:
        return self.inner.cpu_time(out) * self._host

    def launch_cost(self, out: SchedulerOutput) -> tuple[float, float]:
        priced, idle = self.inner.launch_cost(out)
        if not priced and not idle:
            return priced, idle
        f = self._of(out)
        return priced * f, idle * f

    def launch_seconds(self, out: SchedulerOutput) -> float:
        return self.inner.launch_seconds(out) * self._host  # (host work)

    def decode_run_costs(self, run: DecodeRun) -> RunCosts | None:
        """The wrapped model's run, each step times its factor (a decode run's step s is
        step `run.first_step_id + s`, so its draw is the single step's)."""
        if not prices_decode_runs(self.inner):
            return None
        costs = self.inner.decode_run_costs(run)
        if costs is None:
            return None
        return self._noisy_run(costs, run.first_step_id)

    def _noisy_run(self, costs: RunCosts, first_step_id: int) -> RunCosts:
        host, factor = self._host, self.factor
        for s, (cpu, priced, idle, launch) in enumerate(costs):
            f = factor("decode", first_step_id + s)
            yield cpu * host, priced * f, idle * f, launch * host

    @property
    def grammar_mask_per_token_s(self) -> float:
        return self.inner.grammar_mask_per_token_s
