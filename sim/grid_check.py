"""The held-out check of a profile's grid, per step kind: fit on part of the grid,
predict the rest (`deepinfer profile --check-grid PROFILE`).

A profile's fit reproduces its own points closely (the decode surface passes through
them), so its residuals there say little of the steps a served run sends, which lie
between the points. Here each point is priced by the profiled cost model fitted on the
other points only: the points are split into folds (leave-one-out: a fold a point;
k-fold: the i-th point of each kind in fold i mod k), and each fold's points are priced
by the fit of the rest; the host samples likewise, by the host fit of the others. A
point is priced as the profile timed it: its median (a step launched on an idle device,
no async overlap), with the drafter after it where it ran one.

The step kinds (`step_kind`; a point's by its shape, a simulated step's the same way):

  decode        every request one token (the CUDA-graph path)
  prefill       several prompts in one step (the grid's short prompts)
  lone_chunk    one prompt chunk with nothing cached before it
  prefix_chunk  one prompt chunk after context already in the cache (a cached prefix,
                or the chunks before it)
  mixed         decodes and prompt chunks together
  verify        requests verifying drafts (a speculating engine; the drafter after)
  draft         a step the MTP drafter follows with no drafts to verify yet
  host          the core's host seconds around a step (the profile's host samples)

Where the points carry the host's launch seconds (`launch_s`, executors/profiler.py), the
launch fit (`ProfiledCostModel.launch_seconds`, async scheduling) is held out the same
way, on a line of its own.

Each kind's figures are the median and p90 of |error| over its held-out points, beside
the targets of the fidelity issue (median <= 3%, p90 <= 8%); a kind with no point is
not covered (the simulator prices such steps by the fit's physics alone), and the ranges
of each kind say how far the grid reaches.
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import numpy as np

from deepinfer.model_config import ModelConfig
from deepinfer.outputs import SchedulerOutput
from sim.hardware import HardwareSpec
from sim.profile_fit import shape_output, step_seconds
from sim.profiled_cost_model import ProfiledCostModel

KINDS = ("decode", "prefill", "lone_chunk", "prefix_chunk", "mixed", "verify", "draft", "host")
TARGET_MEDIAN = 0.03  # the fidelity issue's per-step-kind targets of |error|
TARGET_P90 = 0.08


def step_kind(out: SchedulerOutput, drafter: bool = False) -> str:
    """The kind of a step (one of KINDS but host), in one pass over its requests;
    `drafter`: the MTP drafter runs after it (a speculating engine)."""
    prompts = decodes = 0
    prompt_context = 0
    verifies = False
    for r in out.scheduled:
        if r.draft_token_ids:
            verifies = True
        if r.is_prompt:
            prompts += 1
            if r.num_computed_tokens > prompt_context:
                prompt_context = r.num_computed_tokens
        else:
            decodes += 1
    if verifies:
        return "verify"
    if drafter:
        return "draft"
    if not prompts:
        return "decode"
    if decodes:
        return "mixed"
    if prompts > 1:
        return "prefill"
    return "prefix_chunk" if prompt_context else "lone_chunk"


def point_kind(point: dict[str, Any]) -> str:
    return step_kind(shape_output(point["groups"]), bool(point.get("drafter")))


@dataclass(frozen=True)
class KindCheck:
    """One kind's held-out predictions: the signed relative error of each, (priced -
    measured) / measured, in the profile's order of its points (or host samples), and
    the ranges its points span (requests, tokens, and the
    longest context a request reaches)."""

    kind: str
    errors: tuple[float, ...]
    items: tuple[int, ...]  # each error's point (or host sample): its index in the profile
    reqs: tuple[int, int]
    tokens: tuple[int, int]
    context: tuple[int, int]

    @property
    def median_abs(self) -> float:
        return float(np.median(np.abs(self.errors)))

    @property
    def p90_abs(self) -> float:
        return float(np.quantile(np.abs(self.errors), 0.9))

    @property
    def bias(self) -> float:
        """The median signed error: > 0, the fit prices the kind's steps too slow."""
        return float(np.median(self.errors))

    @property
    def meets_targets(self) -> bool:
        return self.median_abs <= TARGET_MEDIAN and self.p90_abs <= TARGET_P90

    def to_dict(self) -> dict[str, Any]:
        return {
            "points": len(self.errors),
            "median_abs": self.median_abs,
            "p90_abs": self.p90_abs,
            "bias": self.bias,
            "meets_targets": self.meets_targets,
            "reqs": list(self.reqs),
            "tokens": list(self.tokens),
            "context": list(self.context),
            "errors": list(self.errors),
        }


@dataclass(frozen=True)
class GridCheck:
    """The held-out errors of a profile, by step kind, and the kinds it does not cover."""

    profile: str
    folds: int  # 0: leave-one-out
    kinds: dict[str, KindCheck]
    uncovered: tuple[str, ...]
    too_few: tuple[str, ...] = ()  # kinds of one point: none left to fit it on
    short: tuple[str, ...] = ()  # kinds whose steps stop well short of the grid's reach
    launch: KindCheck | None = None  # the launch fit's, where the points time launches

    def table(self) -> str:
        """One line a kind: points, median and p90 |error|, the median signed error,
        whether the targets are met, and the ranges; then the kinds not covered."""
        how = "leave-one-out" if not self.folds else f"{self.folds}-fold"
        lines = [
            f"{self.profile}: each point priced by the fit of the others ({how}); |error| "
            f"against the targets median <= {TARGET_MEDIAN:.0%}, p90 <= {TARGET_P90:.0%}",
            f"  {'kind':13s} {'points':>6s} {'median':>7s} {'p90':>7s} {'bias':>7s}  "
            f"{'targets':7s}  requests, tokens, longest context",
        ]
        checks = [self.kinds[k] for k in KINDS if k in self.kinds]
        for c in checks + ([self.launch] if self.launch is not None else []):
            context = "-" if c.kind == "host" else _span(c.context)  # (samples hold none)
            lines.append(
                f"  {c.kind:13s} {len(c.errors):6d} {c.median_abs:7.1%} {c.p90_abs:7.1%} "
                f"{c.bias:+7.1%}  {'met' if c.meets_targets else 'missed':7s}  "
                f"{_span(c.reqs)}, {_span(c.tokens)}, {context}"
            )
        for line in self.short:
            lines.append(f"  {line}")
        for kind in self.too_few:
            lines.append(f"  {kind:13s} one point: none left to fit it on, not checked")
        for kind in self.uncovered:
            lines.append(f"  {kind:13s} not covered: the grid has no such step")
        return "\n".join(lines)

    def to_dict(self) -> dict[str, Any]:
        return {
            "profile": self.profile,
            "folds": self.folds,
            "kinds": {k: c.to_dict() for k, c in self.kinds.items()},
            "uncovered": list(self.uncovered),
            "too_few": list(self.too_few),
            "short": list(self.short),
            "launch": None if self.launch is None else self.launch.to_dict(),
        }


def _span(lo_hi: tuple[int, int]) -> str:
    lo, hi = lo_hi
    return str(lo) if lo == hi else f"{lo}-{hi}"


def check_grid(
    profile: dict[str, Any], model: ModelConfig, hardware: HardwareSpec, folds: int = 0
) -> GridCheck:
    """Every point and host sample of `profile` priced by the fit of the rest (`folds`
    0: leave-one-out; else k-fold, each kind spread over the folds in its order). A kind
    needs two points to be checked (one to hold out, one to fit on)."""
    if folds < 0 or folds == 1:
        raise ValueError(f"folds={folds}: 0 (leave-one-out) or at least 2")
    points, host = profile["points"], profile["host"]
    kinds = [point_kind(p) for p in points]
    fold_of = _folds(kinds, folds)
    host_fold = _folds(["host"] * len(host), folds)
    n_folds = max([*fold_of, *host_fold], default=-1) + 1
    drafts = max((int(p.get("drafter", 0)) for p in points), default=0)
    # kind -> item (point or host sample) -> its held-out signed error
    errors: dict[str, dict[int, float]] = {}
    with warnings.catch_warnings():  # (range and coverage warnings: the table says how)
        warnings.simplefilter("ignore")
        for f in range(n_folds):
            _check_fold(f, profile, model, hardware, drafts, kinds, fold_of, host_fold, errors)
    checked = {}
    for kind in KINDS:
        if not errors.get(kind):
            continue
        if kind == "host":
            shapes: Iterable[tuple[int, int, int]] = (
                (h["num_reqs"], h["num_tokens"], 0) for h in host
            )
        else:
            shapes = (_extent(p) for p, k in zip(points, kinds) if k == kind)
        checked[kind] = _kind_check(kind, errors[kind], shapes)
    present = set(kinds) | ({"host"} if host else set())
    uncovered = tuple(k for k in KINDS if k not in present)
    too_few = tuple(k for k in KINDS if k in present and k not in checked)
    name = str(profile.get("_path", profile.get("model", "profile")))
    launch = None
    if errors.get("launch"):
        timed = (_extent(points[i]) for i in sorted(errors["launch"]))
        launch = _kind_check("launch", errors["launch"], timed)
    return GridCheck(
        name.rsplit("/", 1)[-1], folds, checked, uncovered, too_few, _short(checked), launch
    )


def _kind_check(
    kind: str, errors: dict[int, float], shapes: Iterable[tuple[int, int, int]]
) -> KindCheck:
    """A kind's held-out errors (item -> signed error) and the ranges of its items'
    (requests, tokens, longest context)."""
    reqs, tokens, context = zip(*shapes)
    held_out = sorted(errors.items())
    return KindCheck(
        kind,
        tuple(e for _, e in held_out),
        tuple(i for i, _ in held_out),
        (min(reqs), max(reqs)),
        (min(tokens), max(tokens)),
        (min(context), max(context)),
    )


def _short(checked: dict[str, KindCheck]) -> tuple[str, ...]:
    """The kinds whose longest context is under half the grid's longest, and a host
    sample of fewer requests than the largest step: steps beyond are priced by the fit's
    physics alone (the check cannot say how well)."""
    # (a lone chunk's context is its own length, bounded by the token budget)
    steps = [c for k, c in checked.items() if k not in ("host", "prefill", "lone_chunk")]
    if not steps:
        return ()
    reach = max(c.context[1] for c in steps)
    out = [
        f"{c.kind}: contexts up to {c.context[1]}, the grid's steps reach {reach}; "
        "longer ones are priced by the fit's physics"
        for c in steps
        if c.context[1] < reach / 2
    ]
    host = checked.get("host")
    most = max(c.reqs[1] for c in steps)
    if host is not None and host.reqs[1] < most:
        out.append(f"host: samples up to {host.reqs[1]} requests, the grid's steps reach {most}")
    return tuple(out)


def _check_fold(
    f: int,
    profile: dict[str, Any],
    model: ModelConfig,
    hardware: HardwareSpec,
    drafts: int,
    kinds: list[str],
    fold_of: list[int],
    host_fold: list[int],
    errors: dict[str, dict[int, float]],
) -> None:
    """Fold `f`'s points and host samples priced by the fit of the others, into `errors`
    (a speculative point by a fit whose engine drafts as the profile's did)."""
    points, host = profile["points"], profile["host"]
    held = [i for i, g in enumerate(fold_of) if g == f]
    held_host = [i for i, g in enumerate(host_fold) if g == f]
    rest = [p for i, p in enumerate(points) if fold_of[i] != f]
    rest_host = [h for i, h in enumerate(host) if host_fold[i] != f]
    plain_held = [i for i in held if not points[i].get("drafter")]
    spec_held = [i for i in held if points[i].get("drafter")]
    fitted = dict(profile, points=rest, host=rest_host)
    engine = profile["meta"].get("engine", {})  # the points' runner's graphs
    limits = {
        "max_num_seqs": int(engine.get("max_num_seqs") or 256),
        "max_num_batched_tokens": int(engine.get("max_num_batched_tokens") or 8192),
    }
    if plain_held or held_host:
        cost = ProfiledCostModel(fitted, model, hardware, 0, **limits)
        for i in plain_held:
            priced = cost.price_point(shape_output(points[i]["groups"]))
            _add(errors, kinds[i], i, priced, step_seconds(points[i], pipelined=False))
        for i in held_host:
            h = host[i]
            priced = cost.cpu_time(_host_shape(h["num_reqs"], h["num_tokens"]))
            _add(errors, "host", i, priced, h["schedule_s"] + h["process_s"])
    timed = [i for i in plain_held if points[i].get("launch_s") is not None]
    if timed:  # the launch fit (async scheduling), where the fold's fit has one
        cost = ProfiledCostModel(fitted, model, hardware, 0, async_scheduling=True, **limits)
        if cost.prices_launches:
            for i in timed:
                priced = cost.launch_seconds(shape_output(points[i]["groups"]))
                _add(errors, "launch", i, priced, float(points[i]["launch_s"]))
    if spec_held:
        cost = ProfiledCostModel(fitted, model, hardware, drafts, **limits)
        for i in spec_held:
            priced = cost.price_point(shape_output(points[i]["groups"]), drafts)
            _add(errors, kinds[i], i, priced, step_seconds(points[i], pipelined=False))


def _folds(kinds: list[str], folds: int) -> list[int]:
    """The fold of each item: its own (leave-one-out), or its place among its kind's
    items modulo `folds`. A kind with one item is not held out (-1): nothing of its kind
    would be left to fit it."""
    count = {k: kinds.count(k) for k in set(kinds)}
    seen: dict[str, int] = {}
    out = []
    for i, k in enumerate(kinds):
        j = seen.get(k, 0)
        seen[k] = j + 1
        if count[k] < 2:
            out.append(-1)
        else:
            out.append(i if not folds else j % folds)
    return out


def _add(
    errors: dict[str, dict[int, float]], kind: str, item: int, priced: float, real: float
) -> None:
    if real > 0 and math.isfinite(priced):
        errors.setdefault(kind, {})[item] = (priced - real) / real


def _host_shape(num_reqs: int, num_tokens: int) -> SchedulerOutput:
    """A step of `num_reqs` requests and `num_tokens` tokens: all the host fit reads."""
    first = num_tokens - (num_reqs - 1)
    return shape_output([[num_reqs - 1, 1, 0, False], [1, max(first, 1), 0, True]])


def _extent(point: dict[str, Any]) -> tuple[int, int, int]:
    """(requests, tokens, the longest context a request reaches) of a point."""
    groups = point["groups"]
    reqs = sum(int(g[0]) for g in groups)
    tokens = sum(int(g[0]) * int(g[1]) for g in groups)
    return reqs, tokens, max(int(g[1]) + int(g[2]) for g in groups)
