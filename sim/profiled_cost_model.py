"""The profiled cost model: the analytic model's physics, calibrated on measured steps.

A profile (`deepinfer profile`, shipped under sim/data/profiles/) holds whole engine
steps of the real executor. A step is predicted as a non-negative combination of
features that follow its physics:

  graph, piecewise,     fixed costs of a step replayed as a CUDA graph (pure decode), as
  eager, mixed          piecewise graphs (any prompt chunk or multi-token query, up to the
                        profile's `piecewise_max_tokens`), run eagerly (larger steps), and
                        of a non-decode step that also carries decodes (the absorbed
                        attention path's launches)
  reqs, prompt_reqs     per-request host work (inputs, block tables, sampler state)
  tokens                per-token work the groups below do not price
  decode_max_context    the longest decode context: split-KV decode attention is bound by
                        its longest request when few requests cannot fill the GPU
  dense ... lm_head     the analytic model's seconds per op group (max of FLOPs over the
                        matmul rate and bytes over the bandwidth: weights, experts touched,
                        prefill and decode attention, logits)

fitted by non-negative least squares on relative error (scipy), so a prediction can only
grow with tokens, context and requests, and extrapolates by the same physics.

Pure-decode steps (CUDA graphs) have regime changes no simple feature captures (the
experts touched saturate, split-KV changes with the batch), and the profile measures
them on a regular batch x context grid. So they are predicted from that grid, made
monotone in both directions and interpolated in log space over the batch and the mean
context; outside the grid, the fit's physics scales the nearest grid value.

The core's host time around a step (schedule, output processing) is fitted from the
profile's host samples as a + b * requests + c * tokens.
"""

from __future__ import annotations

import bisect
import json
import math
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from deepinfer.model_config import ModelConfig
from deepinfer.outputs import ScheduledRequest, SchedulerOutput
from sim.analytic_cost_model import AnalyticCostModel
from sim.cost_coefficients import load_cost_coefficients
from sim.hardware import HardwareSpec

PROFILES_DIR = Path(__file__).parent / "data" / "profiles"
FEATURES = ("graph", "piecewise", "eager", "mixed", "reqs", "prompt_reqs", "tokens",
            "decode_max_context", "dense", "experts", "attn_pre", "attn_dec", "lm_head")  # fmt: skip
_GROUPS = FEATURES[8:]
_EXTRAPOLATION_MARGIN = 1.1
_ONE_WAVE_BATCH = 256  # decode batches up to this many requests run as one wave of splits


def profile_path(model: str, hardware: str, batch_invariant: bool = False) -> Path:
    """Where the shipped profile of (model, hardware) lives; batch-invariant mode's kernels
    are slower, so a profile measured in it is a file of its own."""
    mode = "__batch_invariant" if batch_invariant else ""
    return PROFILES_DIR / f"{model}__{hardware}{mode}.json"


def find_profile(model: str, hardware: str, batch_invariant: bool = False) -> Path | None:
    """The shipped profile for (model, hardware) in that mode, if one exists."""
    path = profile_path(model, hardware, batch_invariant)
    return path if path.is_file() else None


def load_profile(path: str | Path) -> dict[str, Any]:
    path = Path(path)
    try:
        data = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise ValueError(f"{path}: cannot read the profile ({e})") from None
    for key in ("points", "host", "meta"):
        if key not in data:
            raise ValueError(f"{path}: not a deepinfer profile (no {key!r})")
    if not data["points"]:
        raise ValueError(f"{path}: the profile holds no measured steps")
    data["_path"] = str(path)
    return data


def shape_output(groups: list[list[Any]]) -> SchedulerOutput:
    """A SchedulerOutput of a profile point's shape: [count, query, context, is_prompt]."""
    scheduled = []
    for count, q, ctx, is_prompt in groups:
        for i in range(int(count)):
            scheduled.append(ScheduledRequest(
                req_id=f"{len(scheduled)}.{i}", num_tokens=int(q), num_computed_tokens=int(ctx),
                is_prompt=bool(is_prompt), samples=True, new_block_ids=[],
            ))  # fmt: skip
    return SchedulerOutput(step_id=0, scheduled=scheduled)


@dataclass(frozen=True)
class FitReport:
    """How well the fit reproduces its own points (signed relative errors)."""

    median_abs_err: float
    p90_abs_err: float
    max_abs_err: float


class ProfiledCostModel:
    """step_time and cpu_time from a profile; see the module docstring."""

    def __init__(
        self, profile: dict[str, Any] | str | Path, model: ModelConfig, hardware: HardwareSpec
    ) -> None:
        data = profile if isinstance(profile, dict) else load_profile(profile)
        self.profile_name = Path(data.get("_path", "profile")).name
        self.meta = data["meta"]
        # Profiles measured before piecewise graphs ran every non-decode step eagerly.
        self._piecewise_max = int(self.meta.get("piecewise_max_tokens", 0))
        self._analytic = AnalyticCostModel(model, hardware, load_cost_coefficients())
        outs = [shape_output(p["groups"]) for p in data["points"]]
        y = np.array([p["median_s"] for p in data["points"]], dtype=float)
        x = np.array([self.features(o) for o in outs])
        self.coef = _nnls_relative(x, y)
        self._coef = [float(c) for c in self.coef]  # plain floats: the per-step path
        graph = [i for i, o in enumerate(outs) if not self._eager(o)]
        self._decode = _DecodeSurface([outs[i] for i in graph], y[graph], self._physics)
        self._limits = {"tokens": 1 << 62, "reqs": 1 << 62, "context": 1 << 62}
        self._warned: set[str] = set()
        pred = np.array([self.step_time(o) for o in outs])
        err = np.abs(pred - y) / y
        self.fit = FitReport(float(np.median(err)), float(np.quantile(err, 0.9)), float(err.max()))
        self.point_errors = ((pred - y) / y).tolist()
        host = data["host"]
        hx = np.array([[1.0, h["num_reqs"], h["num_tokens"]] for h in host], dtype=float)
        hy = np.array([h["schedule_s"] + h["process_s"] for h in host], dtype=float)
        self.host_coef = _nnls_relative(hx, hy) if len(host) else np.zeros(3)
        self._host = tuple(float(c) for c in self.host_coef)
        self._limits = {
            "tokens": max(o.num_batched_tokens for o in outs),
            "reqs": max(len(o.scheduled) for o in outs),
            "context": max(r.num_computed_tokens + r.num_tokens for o in outs
                           for r in o.scheduled),
        }  # fmt: skip
        self._warned: set[str] = set()

    # --- the CostModel protocol -------------------------------------------------

    def step_time(self, out: SchedulerOutput) -> float:
        scheduled = out.scheduled
        if not scheduled:
            return 0.0
        # One pass for what the range check and the decode surface read (this runs for
        # every simulated step): tokens, the longest context, decode contexts.
        tokens = longest = ctx_max = ctx_sum = 0
        eager = False
        for r in scheduled:
            q, c = r.num_tokens, r.num_computed_tokens
            tokens += q
            if q > 1:
                eager = True
            if c + q > longest:
                longest = c + q
            if c > ctx_max:
                ctx_max = c
            ctx_sum += c
        lim = self._limits
        m = _EXTRAPOLATION_MARGIN
        n = len(scheduled)
        if tokens > lim["tokens"] * m or n > lim["reqs"] * m or longest > lim["context"] * m:
            self._warn_range(tokens, n, longest)
        if not eager and self._decode.ready:
            effective = ctx_max if n <= _ONE_WAVE_BATCH else ctx_sum / n
            return self._decode.predict_at(float(n), max(1.0, float(effective)), out)
        return self._physics(out)

    def _physics(self, out: SchedulerOutput) -> float:
        return sum(f * c for f, c in zip(self.features(out), self._coef))

    @staticmethod
    def _eager(out: SchedulerOutput) -> bool:
        """The real runner replays a graph only for pure decode (one token per request)."""
        return any(r.num_tokens > 1 for r in out.scheduled)

    def cpu_time(self, out: SchedulerOutput) -> float:
        if not out.scheduled:
            return 0.0
        a, b, c = self._host
        return a + b * len(out.scheduled) + c * out.num_batched_tokens

    @property
    def grammar_mask_per_token_s(self) -> float:
        """The profile's steps had no grammars: their masks cost what the coefficients say."""
        return self._analytic.grammar_mask_per_token_s

    # --- features ----------------------------------------------------------------

    def features(self, out: SchedulerOutput) -> list[float]:
        """The FEATURES of a step, in order (one pass over its requests: this runs for
        every simulated step)."""
        eager = has_decode = False
        prompts = tokens = dec_ctx = 0
        for r in out.scheduled:
            q = r.num_tokens
            tokens += q
            if q > 1:
                eager = True
            else:
                has_decode = True
                if r.num_computed_tokens > dec_ctx:
                    dec_ctx = r.num_computed_tokens
            if r.is_prompt:
                prompts += 1
        piecewise = eager and tokens <= self._piecewise_max
        head = [
            0.0 if eager else 1.0,
            1.0 if piecewise else 0.0,
            1.0 if eager and not piecewise else 0.0,
            1.0 if eager and has_decode else 0.0,
            float(len(out.scheduled)),
            float(prompts),
            float(tokens),
            float(dec_ctx),
        ]
        return head + self._analytic.group_seconds(out)

    def _check_range(self, out: SchedulerOutput) -> None:
        lim, m = self._limits, _EXTRAPOLATION_MARGIN
        tokens, reqs = out.num_batched_tokens, len(out.scheduled)
        ctx = max(r.num_computed_tokens + r.num_tokens for r in out.scheduled)
        if tokens <= lim["tokens"] * m and reqs <= lim["reqs"] * m and ctx <= lim["context"] * m:
            return
        self._warn_range(tokens, reqs, ctx)

    def _warn_range(self, tokens: int, reqs: int, ctx: int) -> None:
        seen = {"tokens": tokens, "reqs": reqs, "context": ctx}
        for key, value in seen.items():
            limit = self._limits[key]
            if value > limit * _EXTRAPOLATION_MARGIN and key not in self._warned:
                self._warned.add(key)
                warnings.warn(
                    f"profiled cost model ({self.profile_name}): a step with {value} {key} "
                    f"extrapolates beyond the profile (largest measured: {limit})",
                    stacklevel=3,
                )


class _DecodeSurface:
    """Measured pure-decode step times on a batch x context grid: monotone, interpolated
    in (log2 batch, log2 mean context); the physics model scales beyond the grid."""

    def __init__(
        self,
        outs: list[SchedulerOutput],
        times: np.ndarray,
        physics: Callable[[SchedulerOutput], float],
    ) -> None:
        self._physics = physics
        coords = [self._coords(o) for o in outs]
        self.batches = np.array(sorted({b for b, _ in coords}), dtype=float)
        self.contexts = np.array(sorted({c for _, c in coords}), dtype=float)
        self.ready = len(self.batches) >= 2 and len(self.contexts) >= 2
        if not self.ready:
            return
        grid = np.full((len(self.batches), len(self.contexts)), np.nan)
        for (b, c), t in zip(coords, times):
            grid[np.searchsorted(self.batches, b), np.searchsorted(self.contexts, c)] = t
        for i, b in enumerate(self.batches):  # an unmeasured node: physics from a neighbour
            for j, c in enumerate(self.contexts):
                if np.isnan(grid[i, j]):
                    grid[i, j] = self._scaled(grid, i, j, b, c)
        self.grid = _monotone(_monotone(grid, axis=0), axis=1)
        self._grid = self.grid.tolist()
        self._log_batches = [math.log2(b) for b in self.batches]
        self._log_contexts = [math.log2(c) for c in self.contexts]
        self._bounds = (
            float(self.batches[0]),
            float(self.batches[-1]),
            float(self.contexts[0]),
            float(self.contexts[-1]),
        )

    @staticmethod
    def _coords(out: SchedulerOutput) -> tuple[float, float]:
        """(batch, effective context). Split-KV decode cuts every request into as many
        pieces as fill one wave of the GPU, so while the batch fits one wave the step
        waits for the longest request: its context counts. Beyond, the mean does."""
        n = len(out.scheduled)
        ctx = [r.num_computed_tokens for r in out.scheduled]
        effective = max(ctx) if n <= _ONE_WAVE_BATCH else sum(ctx) / n
        return float(n), max(1.0, float(effective))

    def _synthetic(self, batch: float, context: float) -> SchedulerOutput:
        return shape_output([[round(batch), 1, round(context), False]])

    def _scaled(self, grid: np.ndarray, i: int, j: int, b: float, c: float) -> float:
        present = [
            (abs(i - ii) + abs(j - jj), ii, jj)
            for ii in range(grid.shape[0])
            for jj in range(grid.shape[1])
            if not np.isnan(grid[ii, jj])
        ]
        _, ii, jj = min(present)
        ref = self._physics(self._synthetic(self.batches[ii], self.contexts[jj]))
        return float(grid[ii, jj] * self._physics(self._synthetic(b, c)) / ref)

    def predict(self, out: SchedulerOutput) -> float:
        b, c = self._coords(out)
        return self.predict_at(b, c, out)

    def predict_at(self, b: float, c: float, out: SchedulerOutput) -> float:
        """`predict` with the step's (batch, effective context) already known."""
        b_lo, b_hi, c_lo, c_hi = self._bounds
        bc = b_lo if b < b_lo else b_hi if b > b_hi else b
        cc = c_lo if c < c_lo else c_hi if c > c_hi else c
        value = self._interpolate(bc, cc)
        if (bc, cc) != (b, c):  # beyond the grid: the physics of the excess
            value *= self._physics(out) / self._physics(self._synthetic(bc, cc))
        return value

    def _interpolate(self, b: float, c: float) -> float:
        xb, xc = self._log_batches, self._log_contexts
        lb, lc = math.log2(b), math.log2(c)
        i = min(max(bisect.bisect_left(xb, lb) - 1, 0), len(xb) - 2)
        j = min(max(bisect.bisect_left(xc, lc) - 1, 0), len(xc) - 2)
        u = (lb - xb[i]) / (xb[i + 1] - xb[i])
        v = (lc - xc[j]) / (xc[j + 1] - xc[j])
        g = self._grid
        return (
            (1 - u) * (1 - v) * g[i][j]
            + u * (1 - v) * g[i + 1][j]
            + (1 - u) * v * g[i][j + 1]
            + u * v * g[i + 1][j + 1]
        )


def _monotone(values: np.ndarray, axis: int) -> np.ndarray:
    """Non-decreasing along `axis`, as close to the measurements as two envelopes allow:
    the mean of the running maximum and the running minimum from the far end (both
    monotone), so noise is split rather than always rounded up."""
    up = np.maximum.accumulate(values, axis=axis)
    flipped = np.flip(values, axis=axis)
    down = np.flip(np.minimum.accumulate(flipped, axis=axis), axis=axis)
    return (up + down) / 2


def _nnls_relative(x: np.ndarray, y: np.ndarray) -> np.ndarray:
    """Non-negative coefficients minimising the squared relative error of x @ c to y.
    Columns are scaled to unit norm first so that their units do not matter."""
    from scipy.optimize import nnls

    w = 1.0 / y
    xw = x * w[:, None]
    scale = np.linalg.norm(xw, axis=0)
    scale[scale == 0] = 1.0
    coef, _ = nnls(xw / scale, y * w, maxiter=50 * x.shape[1])
    return coef / scale
