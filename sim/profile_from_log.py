"""A profile fitted from step log files alone (`deepinfer profile --from-log`), or a
grid profile refined by them: a deployment keeps its simulator calibrated from the
steps it already serves.

A step log (deepinfer/step_log_file.py) holds every step of a run with its shape, its
duration (the executor's time, what a profile point times) and its host seconds. Served
steps are all different (every decode batch has its own contexts), and the profiled
cost model fits points, so the steps are put into cells and each cell becomes one point:

  decode    (batch, effective context), both in half-octave buckets: the decode
            surface's own coordinates (sim/profile_fit.py StepSurface). A batch bucket
            has one batch and a context bucket one context for all its cells (the
            medians of its steps'), so the points lie on the rectangular grid the
            surface needs; each point is a uniform step there.
  prefill   (requests, tokens, longest cached context) buckets
  mixed     (decodes, prompt tokens, prompt context, longest decode context) buckets:
            the point is the cell's step of median analytic price, as it ran

A point's time is the median over its cell's steps, each moved to the point's shape by
the analytic model's ratio (the roofline's physics across a bucket's width, as the
surface scales beyond its grid), with p10 and p90 of the same. Steps launched while the
step before ran (async scheduling on a GPU) give the point's pipelined time, the others
its sequential time; a point that has only one of the two takes it for both (counted in
the meta). Every step is a host sample (schedule and process seconds).

With a base profile, a logged cell replaces the base's points in the same cell and the
others are kept (the base's speculative points always: a log never separates the MTP
drafter's time from its step's), and its host samples likewise. Without one, the kinds
the cost model cannot price without are required: decode steps over two batch and two
context buckets (the surface), and prompt steps (the physics fit's prefill terms).
"""

from __future__ import annotations

import math
import statistics
import time
from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from deepinfer.model_config import ModelConfig
from deepinfer.outputs import SchedulerOutput
from deepinfer.step_log_file import LoggedStep, StepLogFile, read_step_log, step_groups
from sim.analytic_cost_model import AnalyticCostModel
from sim.cost_coefficients import load_cost_coefficients
from sim.hardware import get_hardware
from sim.profile_fit import ONE_WAVE_BATCH, shape_output

KINDS = ("decode", "prefill", "mixed")
# Header meta fields two logs (or a log and its base) must agree on: each changes the
# step times a profile holds.
_SAME = ("dtype", "kernel_backend", "cuda_graphs", "piecewise_max_tokens", "quantization",
         "batch_invariant")  # fmt: skip
_STEPS_PER_CELL = 64  # a cell's median needs no more (evenly spaced over the cell's steps)
_HOST_SAMPLES = 4096  # host samples kept (evenly spaced): the host fit has three terms

Cell = tuple[str, tuple[int, ...]]


def step_kind(groups: list[list[Any]]) -> str:
    """decode (one token a request: the graph path), prefill (prompt chunks only),
    mixed, or verify (a request verifies drafts: a speculating engine's step)."""
    if any(len(g) > 4 and g[4] for g in groups):
        return "verify"
    if all(g[1] == 1 for g in groups):
        return "decode"
    if all(g[3] for g in groups):
        return "prefill"
    return "mixed"


def bucket(value: float) -> int:
    """Half-octave bucket of a count: 1, 2, 3, 4-5, 6-7, 8-11, 12-15, ...; -1 for 0."""
    return -1 if value < 1 else math.floor(2 * math.log2(value))


@dataclass(frozen=True)
class KindCoverage:
    """What the logs hold of one step kind: steps, cells (points), and the ranges of
    requests, tokens and cached context (the longest) a step."""

    steps: int
    cells: int
    reqs: tuple[int, int]
    tokens: tuple[int, int]
    context: tuple[int, int]


@dataclass
class LogFit:
    """A profile fitted from step logs, and what the logs covered."""

    profile: dict[str, Any]
    coverage: dict[str, KindCoverage]
    missing: list[str]  # step kinds (and the surface) the logs did not cover, why each
    notes: list[str] = field(default_factory=list)

    def summary(self) -> str:
        """The coverage, one line a kind, then what is missing."""
        lines = []
        for kind in KINDS:
            c = self.coverage.get(kind)
            if c is None:
                continue
            lines.append(
                f"  {kind:8s} {c.steps:7d} steps -> {c.cells:4d} points; requests "
                f"{c.reqs[0]}-{c.reqs[1]}, tokens {c.tokens[0]}-{c.tokens[1]}, context "
                f"{c.context[0]}-{c.context[1]}"
            )
        for why in self.missing:
            lines.append(f"  not covered: {why}")
        lines += [f"  {note}" for note in self.notes]
        return "\n".join(lines)


@dataclass
class _Binned:
    """One step of the logs as the fit reads it."""

    kind: str
    cell: Cell
    out: SchedulerOutput
    seconds: float
    pipelined: bool  # its duration is a pipelined step's


def fit_from_logs(
    logs: list[StepLogFile],
    model: ModelConfig,
    base: dict[str, Any] | None = None,
) -> LogFit:
    """The profile of `logs`' steps (refining `base`, a profile dict, where given);
    ValueError naming the file where a log cannot be fitted or the logs disagree, or,
    without a base, where they lack a kind the cost model needs."""
    if not logs:
        raise ValueError("no step logs to fit")
    header = _check_headers(logs)
    hw = get_hardware(header["hardware"])
    if base is not None:
        _check_base(base, logs[0], model)
    analytic = AnalyticCostModel(model, hw, load_cost_coefficients())
    one_wave = 0 if hw.runs_on_host else ONE_WAVE_BATCH
    binned: list[_Binned] = []
    verify = unusable = 0
    for log in logs:
        for step in log.steps:
            kind = step_kind(step.groups)
            if kind == "verify":
                verify += 1
                continue
            if not step.record.duration > 0:
                unusable += 1
                continue
            out = shape_output(step.groups)
            pipelined = step.overlapped and not hw.runs_on_host
            cell = (kind, _cell_key(kind, out, one_wave))
            binned.append(_Binned(kind, cell, out, step.record.duration, pipelined))
    points, ratios = _points(binned, analytic, one_wave)
    fills = _fill_times(points, ratios, any(b.pipelined for b in binned))
    coverage = _coverage(binned, points)
    host = _host_samples([s for log in logs for s in log.steps])
    gaps = _missing(coverage, binned)
    missing = [f"{what}: {cost}" for what, cost, _ in gaps]
    needed = [f"{what}: {cost}" for what, cost, need in gaps if need]
    if base is not None:
        missing = [f"{what}: the base profile's points stand" for what, _, _ in gaps]
    notes = []
    if verify:
        notes.append(
            f"{verify} verify steps left out (a log does not separate the MTP drafter's "
            "time from its step's)"
        )
    if unusable:
        notes.append(f"{unusable} steps of zero duration left out")
    if any(fills.values()):
        notes.append(
            f"points with one time only: {fills['sequential_from_pipelined']} have their "
            f"sequential time from their pipelined one, {fills['pipelined_from_sequential']} "
            "the reverse (by the ratio of their kind's steps that ran both ways)"
        )
    from_log = {
        "logs": [str(log.path) for log in logs],
        "steps": len(binned),
        "kinds": {k: c.steps for k, c in coverage.items()},
        "not_covered": missing,
        **fills,
    }
    if base is None:
        if needed:
            raise ValueError(
                "the logs lack steps the cost model needs: "
                + "; ".join(needed)
                + " (pass --base PROFILE to take them from a grid profile)"
            )
        meta = _meta(header, logs[0])
        meta["from_log"] = from_log
        profile = {"version": 1, "model": model.name, "meta": meta, "points": points, "host": host}
    else:
        profile = _refine(base, points, host, binned, one_wave, from_log)
    return LogFit(profile, coverage, missing, notes)


def _check_headers(logs: list[StepLogFile]) -> dict[str, Any]:
    """The first log's header, once every log was checked fit to fit and alike."""
    first = logs[0]
    for log in logs:
        h, engine = log.header, log.engine
        if engine.get("num_speculative_tokens"):
            raise ValueError(
                f"{log.path}: a speculating engine's log (num_speculative_tokens="
                f"{engine['num_speculative_tokens']}): each step's time includes the MTP "
                "drafter's, which the log does not separate; fit from a run without "
                "speculation, and take verify steps from a grid profile (--base)"
            )
        hw = get_hardware(h["hardware"])
        if h.get("executor") == "sim" and hw.runs_on_host and engine.get("async_scheduling"):
            raise ValueError(
                f"{log.path}: a simulated run on {hw.name} under async scheduling: its "
                "durations are not each step's own"
            )
        for key in ("model", "hardware"):
            if h[key] != first.header[key]:
                raise ValueError(
                    f"{log.path}: {key} {h[key]!r}, but {first.path} has {first.header[key]!r}: "
                    "a profile is of one model on one GPU"
                )
        if engine.get("block_size") != first.engine.get("block_size"):
            raise ValueError(
                f"{log.path}: block_size {engine.get('block_size')}, but {first.path} has "
                f"{first.engine.get('block_size')}"
            )
        for key in _SAME:
            if h["meta"].get(key) != first.header["meta"].get(key):
                raise ValueError(
                    f"{log.path}: {key} {h['meta'].get(key)!r}, but {first.path} has "
                    f"{first.header['meta'].get(key)!r}: their steps ran other code"
                )
    return first.header


def _check_base(base: dict[str, Any], log: StepLogFile, model: ModelConfig) -> None:
    where = base.get("_path", "the base profile")
    meta = base["meta"]
    if meta.get("hardware") != log.header["hardware"]:
        raise ValueError(
            f"{where}: measured on {meta.get('hardware')!r}, and {log.path} ran on "
            f"{log.header['hardware']!r}"
        )
    if base.get("model") not in (None, model.name):
        raise ValueError(f"{where}: a profile of {base.get('model')!r}, not of {model.name!r}")
    blocks = meta.get("engine", {}).get("block_size")
    if blocks is not None and blocks != log.engine.get("block_size"):
        raise ValueError(
            f"{where}: measured with block_size {blocks}, and {log.path} ran with "
            f"{log.engine.get('block_size')}"
        )
    for key in _SAME:
        if key in meta and meta[key] != log.header["meta"].get(key):
            raise ValueError(
                f"{where}: {key} {meta[key]!r}, and {log.path} ran with "
                f"{log.header['meta'].get(key)!r}"
            )


def _cell_key(kind: str, out: SchedulerOutput, one_wave: int) -> tuple[int, ...]:
    reqs = out.scheduled
    if kind == "decode":
        return (bucket(len(reqs)), bucket(_effective(out, one_wave)))
    prompts = [r for r in reqs if r.is_prompt and r.num_tokens > 1]
    decodes = [r for r in reqs if not (r.is_prompt and r.num_tokens > 1)]
    prompt_tokens = sum(r.num_tokens for r in prompts)
    prompt_ctx = max((r.num_computed_tokens for r in prompts), default=0)
    if kind == "prefill":
        return (bucket(len(reqs)), bucket(prompt_tokens), bucket(prompt_ctx))
    decode_ctx = max((r.num_computed_tokens for r in decodes), default=0)
    return (bucket(len(decodes)), bucket(prompt_tokens), bucket(prompt_ctx), bucket(decode_ctx))


def _effective(out: SchedulerOutput, one_wave: int) -> float:
    """The decode surface's context of a step (StepSurface._coords)."""
    ctx = [r.num_computed_tokens for r in out.scheduled]
    return max(1.0, float(max(ctx) if len(ctx) <= one_wave else sum(ctx) / len(ctx)))


def _points(
    binned: list[_Binned], analytic: AnalyticCostModel, one_wave: int
) -> tuple[list[dict[str, Any]], dict[str, float]]:
    """One point per cell, its sequential and pipelined medians under `_sequential` and
    `_pipelined` (None: none of its steps ran so); and by step kind whose steps ran both
    ways, the ratio of the two (each step's time over its analytic price, the medians'
    ratio: the cells of one kind seldom hold both)."""
    cells: dict[Cell, list[_Binned]] = defaultdict(list)
    for b in binned:
        cells[b.cell].append(b)
    # Decode: one batch per batch bucket and one context per context bucket (a grid).
    decode = [b for b in binned if b.kind == "decode"]
    batch_of = _medians((b.cell[1][0], len(b.out.scheduled)) for b in decode)
    context_of = _medians((b.cell[1][1], _effective(b.out, one_wave)) for b in decode)
    uniform: dict[tuple[int, int], float] = {}  # (batch, context) -> analytic seconds

    def uniform_price(batch: int, context: float) -> float:
        key = (batch, round(context))
        if key not in uniform:
            uniform[key] = analytic.step_time(shape_output([[batch, 1, key[1], False]]))
        return uniform[key]

    points = []
    per_price: dict[tuple[str, bool], list[float]] = defaultdict(list)
    for cell, members in sorted(cells.items()):
        kind, steps = cell[0], _spaced(members, _STEPS_PER_CELL)
        if kind == "decode":
            batch, context = batch_of[cell[1][0]], context_of[cell[1][1]]
            rep = shape_output([[batch, 1, context, False]])
            target = uniform_price(batch, context)
            prices = [uniform_price(len(b.out.scheduled), _effective(b.out, one_wave))
                      for b in steps]  # fmt: skip
        else:
            prices = [analytic.step_time(b.out) for b in steps]
            middle = sorted(range(len(steps)), key=prices.__getitem__)[len(steps) // 2]
            rep, target = steps[middle].out, prices[middle]
        moved = [(b.seconds * target / price, b.pipelined) for b, price in zip(steps, prices)]
        for b, price in zip(steps, prices):
            per_price[kind, b.pipelined].append(b.seconds / price)
        seq = sorted(t for t, pipelined in moved if not pipelined)
        pip = sorted(t for t, pipelined in moved if pipelined)
        times = seq or pip
        points.append({
            "kind": kind, "groups": step_groups(rep), "num_reqs": len(rep.scheduled),
            "num_tokens": rep.num_batched_tokens,
            "median_s": statistics.median(times),
            "p10_s": times[int(0.1 * (len(times) - 1))],
            "p90_s": times[round(0.9 * (len(times) - 1))],
            "reps": len(times), "compiled": 0, "logged_steps": len(members),
            "_sequential": statistics.median(seq) if seq else None,
            "_pipelined": statistics.median(pip) if pip else None,
        })  # fmt: skip
    ratios = {
        kind: statistics.median(per_price[kind, False]) / statistics.median(per_price[kind, True])
        for kind in KINDS
        if per_price[kind, False] and per_price[kind, True]
    }
    return points, ratios


def _fill_times(
    points: list[dict[str, Any]], ratios: dict[str, float], any_pipelined: bool
) -> dict[str, int]:
    """Each point's sequential time (median_s) and, where any logged step ran pipelined,
    its pipelined time (pipelined_s); how many were filled. A point whose cell holds one
    of the two takes the other by its kind's ratio sequential / pipelined (`ratios`; at
    least 1: the launch's host part a pipelined step hides), or the median of the other
    kinds' where its own ran one way only, or 1 where every kind did."""
    everywhere = statistics.median(ratios.values()) if ratios else 1.0
    fills = {"sequential_from_pipelined": 0, "pipelined_from_sequential": 0}
    for p in points:
        seq, pip = p.pop("_sequential"), p.pop("_pipelined")
        ratio = max(1.0, ratios.get(p["kind"], everywhere))
        if seq is None:
            fills["sequential_from_pipelined"] += 1
            p["median_s"] = pip * ratio
        if any_pipelined:  # (else the logs ran without overlap: no pipelined times)
            if pip is None:
                fills["pipelined_from_sequential"] += 1
            p["pipelined_s"] = seq / ratio if pip is None else pip
    return fills


def _medians(pairs: Any) -> dict[int, int]:
    """bucket -> the median value of its members, rounded."""
    by: dict[int, list[float]] = defaultdict(list)
    for key, value in pairs:
        by[key].append(value)
    return {k: max(1, round(statistics.median(v))) for k, v in by.items()}


def _spaced(items: list[_Binned], most: int) -> list[_Binned]:
    """At most `most` of `items`, evenly spaced (all of them when fewer)."""
    if len(items) <= most:
        return items
    step = len(items) / most
    return [items[int(i * step)] for i in range(most)]


def _host_samples(steps: list[LoggedStep]) -> list[dict[str, Any]]:
    """Each step's host seconds as a profile's host sample (at most _HOST_SAMPLES,
    evenly spaced over the run)."""
    stride = max(1, math.ceil(len(steps) / _HOST_SAMPLES))
    return [
        {
            "num_reqs": s.record.num_scheduled_reqs,
            "num_tokens": s.record.num_batched_tokens,
            "schedule_s": s.schedule_s,
            "process_s": s.process_s,
            "execute_s": s.record.duration,
        }
        for s in steps[::stride]
    ]


def _coverage(binned: list[_Binned], points: list[dict[str, Any]]) -> dict[str, KindCoverage]:
    out = {}
    for kind in KINDS:
        steps = [b.out for b in binned if b.kind == kind]
        if not steps:
            continue
        reqs = [len(o.scheduled) for o in steps]
        tokens = [o.num_batched_tokens for o in steps]
        ctx = [max(r.num_computed_tokens for r in o.scheduled) for o in steps]
        out[kind] = KindCoverage(
            len(steps), sum(p["kind"] == kind for p in points),
            (min(reqs), max(reqs)), (min(tokens), max(tokens)), (min(ctx), max(ctx)),
        )  # fmt: skip
    return out


def _missing(
    coverage: dict[str, KindCoverage], binned: list[_Binned]
) -> list[tuple[str, str, bool]]:
    """The step kinds the logs did not cover: each, what its absence costs, and whether
    the cost model needs it (without a base profile to take it from)."""
    missing = []
    decode = {b.cell[1] for b in binned if b.kind == "decode"}
    batches, contexts = {k[0] for k in decode}, {k[1] for k in decode}
    if len(batches) < 2 or len(contexts) < 2:
        what = (
            f"decode steps over 2 batch and 2 context buckets (the logs have "
            f"{len(batches)} and {len(contexts)})"
        )
        missing.append((what, "the decode surface", True))
    if "prefill" not in coverage:
        missing.append(("prefill steps (prompt chunks alone)", "the fit's prefill terms", True))
    if "mixed" not in coverage:
        cost = "priced by the fit's physics of the other kinds"
        missing.append(("mixed steps (decodes beside a prompt chunk)", cost, False))
    return missing


def _meta(header: dict[str, Any], log: StepLogFile) -> dict[str, Any]:
    """The profile's meta: the executor's, as the log's header gives it."""
    meta = {k: v for k, v in header["meta"].items() if k not in ("cost_model", "engine", "date")}
    engine = log.engine
    meta.update(
        hardware=header["hardware"],
        num_speculative_tokens=0,
        date=time.strftime("%Y-%m-%d %H:%M:%S", time.gmtime()),
        engine={k: engine.get(k) for k in ("block_size", "max_num_seqs",
                "max_num_batched_tokens", "num_gpu_blocks", "max_model_len")},
    )  # fmt: skip
    return meta


def _refine(
    base: dict[str, Any],
    points: list[dict[str, Any]],
    host: list[dict[str, Any]],
    binned: list[_Binned],
    one_wave: int,
    from_log: dict[str, Any],
) -> dict[str, Any]:
    """`base` with the logged cells in place of its points in the same cells, and the
    logged host samples in place of its own of the same (requests, tokens) buckets."""
    logged = {b.cell for b in binned}
    kept = []
    for p in base["points"]:
        if p.get("drafter"):
            kept.append(p)
            continue
        out = shape_output(p["groups"])
        kind = step_kind(p["groups"])
        if (kind, _cell_key(kind, out, one_wave)) not in logged:
            kept.append(p)
    host_cells = {(bucket(h["num_reqs"]), bucket(h["num_tokens"])) for h in host}
    base_host = [
        h
        for h in base["host"]
        if (bucket(h["num_reqs"]), bucket(h["num_tokens"])) not in host_cells
    ]
    replaced = len(base["points"]) - len(kept)
    meta = dict(base["meta"])
    meta["from_log"] = from_log | {
        "base": str(base.get("_path", "base")),
        "base_points_replaced": replaced,
        "base_points_kept": len(kept),
    }
    if any("pipelined_s" in p for p in points):  # base points without it would stop its use
        kept = [p if "pipelined_s" in p else p | {"pipelined_s": p["median_s"]} for p in kept]
    profile = {k: v for k, v in base.items() if k not in ("_path", "points", "host", "meta")}
    return profile | {"meta": meta, "points": kept + points, "host": base_host + host}


def load_logs(paths: list[str | Path]) -> list[StepLogFile]:
    """Read step log files (errors name the file and line)."""
    logs = [read_step_log(p) for p in paths]
    for log in logs:
        if not log.steps:
            raise ValueError(f"{log.path}: the step log holds no steps")
    return logs
