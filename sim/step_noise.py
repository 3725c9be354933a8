"""How far a profiled step price may be from the real step: the noise model of the
simulator's uncertainty bands (sim/bands.py).

Two parts, by step kind (sim/grid_check.py's kinds):

  systematic  the fit's own error on steps it never saw: the held-out errors of the
              profile's grid (`check_grid`), as ratios real / priced. A replicate draws
              one of them per kind and multiplies every step of that kind by it: an
              error of the fit is shared by all the steps of a shape's neighbourhood,
              so it does not average out over a run the way step-to-step noise does.
  per step    the measured spread of a step's repeats: each point's p10 and p90 read as
              a log-normal's (log(p90 / p10) spans 2 x 1.2816 sigma), the kind's median
              sigma; every step draws its own factor around 1 (the median the profile
              prices).

The host samples are single steps, each measured once: their held-out errors hold both
parts. Each sample's systematic part is the median log error of its neighbours by
requests (a window of HOST_WINDOW samples: an error the host fit makes at a batch size
is shared by the samples around it), and the host's per-step sigma is the robust spread
(1.4826 x the median absolute deviation) of what is left.

The held-out errors are those of the points' medians (steps launched on an idle
device); under async scheduling the simulator prices pipelined times, and the same
relative errors stand for them (the profile holds no held-out check of its own for
those).

A kind the grid does not cover (or has too few points to check) takes the widest
systematic errors and per-step sigma of the kinds it does cover (`for_kind`): a step
the profile never measured is no better known than the worst it did.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from types import MappingProxyType
from typing import Any

import numpy as np

from deepinfer.model_config import ModelConfig
from sim.grid_check import GridCheck, KindCheck, check_grid, point_kind
from sim.hardware import HardwareSpec

_P10_TO_P90 = 2 * 1.2815515655446004  # standard normal quantiles 0.1 to 0.9
NOISE_FOLDS = 10  # the held-out check the bands' systematic part comes from
HOST_WINDOW = 9  # host samples (by requests) whose errors a sample's systematic part shares


@dataclass(frozen=True)
class KindNoise:
    """One kind's noise: the ratios real / priced a run draws its systematic factor
    from, and the sigma of log(step time) around the median of one step."""

    ratios: tuple[float, ...]
    sigma: float

    @property
    def spread(self) -> float:
        """How far the ratios reach from 1, in log space (the widest kind's wins)."""
        return max(abs(math.log(r)) for r in self.ratios)


@dataclass(frozen=True)
class StepNoise:
    """The noise of a profile's step prices by step kind (see the module docstring);
    `source` says where it came from, for the report."""

    kinds: Mapping[str, KindNoise]
    source: str

    def __post_init__(self) -> None:
        if not self.kinds:
            raise ValueError(f"step noise from {self.source}: no step kind to draw from")
        for kind, k in self.kinds.items():
            if not k.ratios or min(k.ratios) <= 0 or k.sigma < 0:
                raise ValueError(f"step noise of {kind}: ratios must be > 0 and sigma >= 0 ({k})")
        object.__setattr__(self, "kinds", MappingProxyType(dict(self.kinds)))

    def for_kind(self, kind: str) -> KindNoise:
        """The kind's noise, or for a kind not covered the widest of those covered."""
        found = self.kinds.get(kind)
        if found is not None:
            return found
        return self._widest

    @property
    def _widest(self) -> KindNoise:
        measured = [k for name, k in self.kinds.items() if name != "host"] or list(
            self.kinds.values()
        )
        ratios = max(measured, key=lambda k: k.spread).ratios
        return KindNoise(ratios, max(k.sigma for k in measured))

    @classmethod
    def from_profile(
        cls,
        profile: dict[str, Any],
        model: ModelConfig,
        hardware: HardwareSpec,
        folds: int = NOISE_FOLDS,
    ) -> StepNoise:
        """The noise of `profile`: its grid's held-out errors (`check_grid` with
        `folds`) and its points' measured spread."""
        return cls.from_check(check_grid(profile, model, hardware, folds), profile)

    @classmethod
    def from_check(cls, check: GridCheck, profile: dict[str, Any]) -> StepNoise:
        sigmas: dict[str, list[float]] = {}
        for p in profile["points"]:
            lo, hi = p.get("p10_s"), p.get("p90_s")
            if lo and hi and hi >= lo > 0:
                sigmas.setdefault(point_kind(p), []).append(math.log(hi / lo) / _P10_TO_P90)
        kinds = {
            kind: KindNoise(
                tuple(1.0 / (1.0 + e) for e in c.errors if e > -1.0),
                float(np.median(sigmas[kind])) if sigmas.get(kind) else 0.0,
            )
            for kind, c in check.kinds.items()
            if kind != "host"
        }
        host = check.kinds.get("host")
        if host is not None:
            kinds["host"] = _host_noise(host, profile["host"])
        how = "leave-one-out" if not check.folds else f"{check.folds}-fold"
        return cls(kinds, f"{check.profile} (held-out errors, {how}; repeats' spread)")

    def describe(self) -> str:
        """One line a kind: the systematic ratios' 2.5-97.5% range and the per-step sigma."""
        lines = []
        for kind, k in self.kinds.items():
            lo, hi = np.quantile(k.ratios, [0.025, 0.975])
            lines.append(
                f"  {kind:13s} run x{lo:.3f}-{hi:.3f} ({len(k.ratios)} held-out points), "
                f"step sigma {k.sigma:.1%}"
            )
        return "\n".join(lines)


def _host_noise(check: KindCheck, samples: list[dict[str, Any]]) -> KindNoise:
    """The host's held-out errors split into the part shared by a sample's neighbours by
    requests (systematic) and the spread left (per step); see the module docstring."""
    pairs = sorted(
        (samples[i]["num_reqs"], samples[i]["num_tokens"], -math.log1p(e))
        for i, e in zip(check.items, check.errors)
        if e > -1.0
    )
    logs = np.array([x for _, _, x in pairs])
    half = HOST_WINDOW // 2
    local = np.array([np.median(logs[max(0, j - half) : j + half + 1]) for j in range(len(logs))])
    left = logs - local
    sigma = float(1.4826 * np.median(np.abs(left - np.median(left))))
    return KindNoise(tuple(float(r) for r in np.exp(local)), sigma)
