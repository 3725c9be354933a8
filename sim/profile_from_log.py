"""A profile fitted from step log files alone (`deepinfer profile --from-log`), or a
grid profile refined by them: a deployment keeps its simulator calibrated from the
steps it already serves.

A step log (deepinfer/step_log_file.py) holds every step of a run with its shape, its
duration (the executor's time, what a profile point times), its device span where the
run timed it (`device_s`: preferred for pipelined steps, it holds no host work of the
next step's launch), its launch's host seconds likewise (`launch_s`) and its host
seconds. Served steps are all different (every decode batch has its own contexts), and
the profiled cost model fits points, so the steps are put into cells and each cell
becomes one point:

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
the meta). Where the log timed every launch of a cell (and its pipelined steps by their
device spans), its point carries their median as a profiler's point does (`launch_s`),
so the cost model prices launches apart, as served, when every plain point has one.
Every step is a host sample (schedule and process seconds).

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
import warnings
from collections import defaultdict
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import numpy as np

from deepinfer.model_config import ModelConfig
from deepinfer.outputs import SchedulerOutput
from deepinfer.step_log_file import LoggedStep, StepLogFile, read_step_log, step_groups
from sim.analytic_cost_model import AnalyticCostModel
from sim.cost_coefficients import load_cost_coefficients
from sim.hardware import HardwareSpec, get_hardware
from sim.profile_fit import (
    ONE_WAVE_BATCH,
    decode_splits,
    graph_batch,
    one_wave_decode,
    shape_output,
)
from sim.profiled_cost_model import ProfiledCostModel

KINDS = ("decode", "prefill", "mixed")
# Header meta fields two logs (or a log and its base) must agree on: each changes the
# step times a profile holds.
_SAME = ("dtype", "kernel_backend", "cuda_graphs", "piecewise_max_tokens", "quantization",
         "batch_invariant")  # fmt: skip
_STEPS_PER_CELL = 64  # a cell's median needs no more (evenly spaced over the cell's steps)
_HOST_SAMPLES = 4096  # host samples kept (evenly spaced): the host fit has three terms

# A step whose time over its analytic price lies this many scaled MADs (1.4826 MAD:
# one standard deviation of a normal spread) from its peers' median, in log, is an
# outlier: a compile, a stall, a launch held behind another.
_OUTLIER_MADS = 5.0
# ... and never within these factors of it: decode steps of one shape spread by under
# 1% while a batch bucket's shapes differ by more from the analytic model; a prompt
# step's peers are its whole kind, whose time over analytic price varies with the shape.
_OUTLIER_WITHIN = {"decode": math.log(1.25), "prefill": math.log(3.0), "mixed": math.log(3.0)}
_SHORT_CONTEXT = 1024  # decode logs whose shortest context is longer miss short requests

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
    price: float  # its analytic price (_Prices.of), what its time is read against
    holds_next: bool = False  # its duration holds the next step's launch (_reattribute)
    device: bool = False  # its time is the device's span (`LoggedStep.device_s`)
    launch: float | None = None  # its launch's host seconds, where the log has them
    batch: int = 0  # a decode step's surface batch (`one_wave_decode`; past a wave, its own)
    pieces: int = 0  # a one-wave decode step on a GPU: its pieces a context, else 0


class _Prices:
    """The analytic price a step's time is read against: a decode step's is that of the
    uniform step at its (batch, mean context), the surface's coordinates, kept per pair
    (a log repeats them); another step's is its own shape's."""

    def __init__(self, analytic: AnalyticCostModel) -> None:
        self.analytic = analytic
        self._uniform: dict[tuple[int, int], float] = {}  # (batch, context) -> seconds

    def uniform(self, batch: int, context: float) -> float:
        key = (batch, round(context))
        if key not in self._uniform:
            self._uniform[key] = self.analytic.step_time(shape_output([[batch, 1, key[1], False]]))
        return self._uniform[key]

    def of(self, kind: str, out: SchedulerOutput, batch: int) -> float:
        """batch: a decode step's surface batch (`one_wave_decode`)."""
        if kind == "decode":
            return self.uniform(batch, _mean_context(out))
        return self.analytic.step_time(out)


def _piece_key_seconds(
    logged: list[_Binned],
    prices: _Prices,
    base: dict[str, Any] | None,
    model: ModelConfig,
    hw: HardwareSpec,
) -> float:
    """A lone decode piece's seconds a key of its context (the profiled cost model's
    `_piece_key_s`): the slope of the logs' batch-1 decode times over their contexts
    where those span at least a doubling, else the base profile's, else the analytic
    batch-1 row's (a guess: a tail it under-states comes out short, the same in the fit
    and in the prices, which store and read this one rate)."""
    ones = [
        (float(b.out.scheduled[0].num_computed_tokens), b.seconds)
        for b in logged
        if b.kind == "decode" and len(b.out.scheduled) == 1
    ]
    pieces = decode_splits(graph_batch(1), model.num_attention_heads, hw.num_sms)
    contexts = [c for c, _ in ones]
    if contexts and max(contexts) >= 2 * min(contexts):
        slope = float(np.polyfit(contexts, [t for _, t in ones], 1)[0])
        return max(slope, 0.0) * pieces
    if base is not None:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            return ProfiledCostModel(base, model, hw)._piece_key_s
    slope = (prices.uniform(1, 2048) - prices.uniform(1, 1024)) / 1024
    return max(slope, 0.0) * pieces


def _without_tails(binned: list[_Binned], key_s: float) -> list[_Binned]:
    """`binned` with each one-wave ragged decode step's time less the time its longest
    request's pieces run on past the mean at `key_s` seconds a key of a lone piece (the
    profiled cost model's `_longest_pieces`, which it adds back to the surface at the
    mean)."""
    kept = []
    for b in binned:
        if b.pieces:
            longest = float(max(r.num_computed_tokens for r in b.out.scheduled))
            mean = _mean_context(b.out)
            if longest > mean:
                tail = key_s * (longest - mean) / b.pieces
                # (a tail the rate over-states must not make a step free)
                b = replace(b, seconds=max(b.seconds - tail, 0.1 * b.seconds))
        kept.append(b)
    return kept


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
    prices = _Prices(analytic)
    binned: list[_Binned] = []
    runs: list[list[_Binned | None]] = []  # each log's steps in order (None: left out)
    verify = unusable = 0
    one_wave = 0 if hw.runs_on_host else ONE_WAVE_BATCH  # (a CPU replays no graph)
    heads = model.num_attention_heads
    for log in logs:
        run: list[_Binned | None] = []
        # (the graphs its runner captured; 0: it ran without graphs)
        graphs = log.header["meta"].get("cuda_graphs", True)
        max_num_seqs = int(log.engine.get("max_num_seqs") or 256) if graphs else 0
        for step in log.steps:
            kind = step_kind(step.groups)
            if kind == "verify" or not step.seconds > 0:
                verify += kind == "verify"
                unusable += kind != "verify"
                run.append(None)
                continue
            out = shape_output(step.groups)
            pipelined = step.overlapped and not hw.runs_on_host
            batch, pieces = len(out.scheduled), 0
            if kind == "decode" and batch <= one_wave:
                batch, pieces = one_wave_decode(batch, max_num_seqs, heads, hw.num_sms)
            cell = (kind, _cell_key(kind, out, batch))
            price = prices.of(kind, out, batch)
            timed = step.device_s is not None and step.overlapped  # (LoggedStep.seconds)
            run.append(_Binned(kind, cell, out, step.seconds, pipelined, price, device=timed,
                               launch=step.launch_s, batch=batch, pieces=pieces))  # fmt: skip
        runs.append(run)
        binned += [b for b in run if b is not None]
    # (a simulated log's durations are its cost model's prices, split as it priced them)
    real = [run for run, log in zip(runs, logs) if log.header.get("executor") != "sim"]
    held, moved = _reattribute(real)
    binned = [b for b in binned if not b.holds_next]
    key_s = None
    if not hw.runs_on_host:  # (a CPU's decode costs its contexts' sum: the mean's)
        key_s = _piece_key_seconds(binned, prices, base, model, hw)
        binned = _without_tails(binned, key_s)
    binned, outliers = _without_outliers(binned)
    points, ratios = _points(binned, prices)
    fills = _fill_times(points, ratios, any(b.pipelined for b in binned))
    coverage = _coverage(binned, points)
    host = _host_samples([s for log in logs for s in log.steps])
    gaps = _missing(coverage, binned) + _beyond(coverage, binned, logs, model)
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
    timed = sum(b.device for b in binned)
    if timed:
        notes.append(f"{timed} of {len(binned)} steps timed by their device span (device_s)")
    launched = sum("launch_s" in p for p in points)
    if launched:
        notes.append(
            f"{launched} of {len(points)} points with their steps' launch times (launch_s): "
            "launches are priced apart only where every point the engine overlaps has one"
        )
    if held:
        notes.append(
            f"{held} steps left out: the next step's launch (prompt chunks, beside them) "
            f"held their results; {moved:.3f} s of theirs given to those steps"
        )
    if outliers:
        notes.append(
            f"{outliers} outlier steps left out (time over analytic price beyond "
            f"{_OUTLIER_MADS} scaled MADs of their peers')"
        )
    if any(fills.values()):
        notes.append(
            f"points with one time only: {fills['sequential_from_pipelined']} have their "
            f"sequential time from their pipelined one, {fills['pipelined_from_sequential']} "
            "the reverse (by the ratio of their kind's steps that ran both ways)"
        )
        launched = [
            f"{kind} {sum(b.kind == kind and not b.pipelined for b in binned)} of "
            f"{sum(b.kind == kind for b in binned)} (ratio "
            + (
                f"{max(1.0, ratios[kind]):.3f})"
                if kind in ratios
                else "of the other kinds)"
                if ratios
                else "none ran both ways: 1)"
            )
            for kind in KINDS
            if kind in coverage
        ]
        notes.append(
            "steps launched on an idle device (async scheduling off, or after the engine "
            "idled), whose sequential times price a run without async scheduling: "
            + ", ".join(launched)
        )
    from_log = {
        "logs": [str(log.path) for log in logs],
        "steps": len(binned),  # (fitted; read: these and the two below)
        "held_by_next_launch": held,
        "device_timed": timed,
        "outliers": outliers,
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
        profile = _refine(base, points, host, binned, from_log)
    if key_s is not None:  # (the rate the tails were taken off at: the prices add them)
        profile["meta"]["decode_piece_key_s"] = key_s
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


def _cell_key(kind: str, out: SchedulerOutput, batch: int) -> tuple[int, ...]:
    """batch: a decode step's surface batch (`one_wave_decode`)."""
    reqs = out.scheduled
    if kind == "decode":
        return (bucket(batch), bucket(_mean_context(out)))
    prompts = [r for r in reqs if r.is_prompt and r.num_tokens > 1]
    decodes = [r for r in reqs if not (r.is_prompt and r.num_tokens > 1)]
    prompt_tokens = sum(r.num_tokens for r in prompts)
    prompt_ctx = max((r.num_computed_tokens for r in prompts), default=0)
    if kind == "prefill":
        return (bucket(len(reqs)), bucket(prompt_tokens), bucket(prompt_ctx))
    decode_ctx = max((r.num_computed_tokens for r in decodes), default=0)
    return (bucket(len(decodes)), bucket(prompt_tokens), bucket(prompt_ctx), bucket(decode_ctx))


def _mean_context(out: SchedulerOutput) -> float:
    """The decode surface's context of a step: its requests' mean (the profiled cost
    model reads the surface there and prices a one-wave batch's longest request apart)."""
    ctx = [r.num_computed_tokens for r in out.scheduled]
    return max(1.0, sum(ctx) / len(ctx))


def _points(
    binned: list[_Binned], prices: _Prices
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
    batch_of = _medians((b.cell[1][0], b.batch) for b in decode)
    context_of = _medians((b.cell[1][1], _mean_context(b.out)) for b in decode)
    points = []
    per_price: dict[tuple[str, bool], list[float]] = defaultdict(list)
    for cell, members in sorted(cells.items()):
        kind, steps = cell[0], _spaced(members, _STEPS_PER_CELL)
        priced = [b.price for b in steps]
        if kind == "decode":
            batch, context = batch_of[cell[1][0]], context_of[cell[1][1]]
            rep = shape_output([[batch, 1, context, False]])
            target = prices.uniform(batch, context)
        else:
            middle = sorted(range(len(steps)), key=priced.__getitem__)[len(steps) // 2]
            rep, target = steps[middle].out, priced[middle]
        moved = [(b.seconds * target / price, b.pipelined) for b, price in zip(steps, priced)]
        for b, price in zip(steps, priced):
            per_price[kind, b.pipelined].append(b.seconds / price)
        seq = sorted(t for t, pipelined in moved if not pipelined)
        pip = sorted(t for t, pipelined in moved if pipelined)
        times = seq or pip
        # Launches priced apart (the profiler's `launch_s`) where the log timed every
        # step's launch and every pipelined step by its device span (a pipelined step's
        # duration can hold the next step's launch, which would then count twice): the
        # launches' median, the pipelined steps' where any ran so (host work, not moved
        # by the analytic price). The point's pipelined time is already those spans, the
        # device's time as served (a profiler's `device_s` is not: it queues a step's
        # kernels before the device starts them, which serving never does).
        launched: dict[str, float] = {}
        piped = [b for b in steps if b.pipelined]
        if all(b.launch is not None for b in steps) and all(b.device for b in piped):
            among = piped or steps
            launched["launch_s"] = statistics.median(
                [b.launch for b in among if b.launch is not None]
            )
        points.append({
            "kind": kind, "groups": step_groups(rep), "num_reqs": len(rep.scheduled),
            "num_tokens": rep.num_batched_tokens,
            "median_s": statistics.median(times),
            "p10_s": times[int(0.1 * (len(times) - 1))],
            "p90_s": times[round(0.9 * (len(times) - 1))],
            "reps": len(times), "compiled": 0, "logged_steps": len(members),
            "_sequential": statistics.median(seq) if seq else None,
            "_pipelined": statistics.median(pip) if pip else None,
            **launched,
        })  # fmt: skip
    ratios = {
        kind: statistics.median(per_price[kind, False]) / statistics.median(per_price[kind, True])
        for kind in KINDS
        if per_price[kind, False] and per_price[kind, True]
    }
    return points, ratios


def _without_outliers(binned: list[_Binned]) -> tuple[list[_Binned], int]:
    """`binned` without its outlier steps, and how many there were. A step's peers are
    the steps of its kind launched the same way (pipelined or not) and, for a decode
    step, of its batch bucket (the analytic model's error varies with the batch more
    than the context); log ratios of time to price within
    _OUTLIER_MADS scaled MADs of the peers' median are kept. So one odd step cannot set
    a cell's price, however few steps the cell has."""
    peers: dict[tuple[Any, ...], list[float]] = defaultdict(list)

    def key(b: _Binned) -> tuple[Any, ...]:
        return (b.kind, b.pipelined, b.cell[1][0] if b.kind == "decode" else None)

    for b in binned:
        peers[key(b)].append(math.log(b.seconds / b.price))
    medians = {k: statistics.median(v) for k, v in peers.items()}
    deviation: dict[tuple[Any, ...], list[float]] = defaultdict(list)
    for b in binned:  # (a kind's spread: a batch bucket's steps may be few)
        k = key(b)
        deviation[k[:2]].append(abs(math.log(b.seconds / b.price) - medians[k]))
    band = {
        k: max(_OUTLIER_MADS * 1.4826 * statistics.median(v), _OUTLIER_WITHIN[k[0]])
        for k, v in deviation.items()
    }
    kept = [
        b for b in binned
        if abs(math.log(b.seconds / b.price) - medians[key(b)])
        <= band[key(b)[:2]]
    ]  # fmt: skip
    return kept, len(binned) - len(kept)


def _reattribute(runs: list[list[_Binned | None]]) -> tuple[int, float]:
    """Give back to each step launched beside the step before it the time that step's
    duration holds of it; (how many steps held some, the seconds moved).

    A step's duration ends when the host reads its results, and under async scheduling
    the host first launches the next step. The launch of a step with prompt chunks
    (eager or piecewise, its inputs built on the host) can outlast the step before it
    on the device, and the device waits for it: that step's duration then holds the
    next one's launch (a graph-replayed decode step several times its own time), and
    the next step's holds only what ran after it. The pair's sum is right. So a step
    followed by such a launch whose time (with what it was given) lies beyond the
    spread of its peers' (p90 of their time over their analytic price; a decode step's
    peers: its cell's steps, an eager step's: its kind's) is left out of its cell, and
    its time beyond its peers' median goes to the next step, whose launch it held.
    Decode steps first: eager steps' peers are read with what decode steps gave them."""
    held = 0
    moved = 0.0
    for kinds in (("decode",), ("prefill", "mixed")):
        peers = _peer_ratios(runs, kinds)
        for run in runs:
            for b, after in zip(run, [*run[1:], None]):
                if b is None or b.kind not in kinds or not _launch_held(b, after):
                    continue
                assert after is not None
                if b.device or after.device:  # (device spans hold no launch's host work)
                    continue
                ratio, spread = peers.get((b.cell, b.pipelined)) or peers.get(
                    (b.kind, b.pipelined), (math.inf, 1.0)
                )
                own = ratio * b.price
                if b.seconds > own * spread and (kinds == ("decode",) or _short(after, peers)):
                    b.holds_next = True
                    held += 1
                    moved += b.seconds - own
                    after.seconds += b.seconds - own
                    b.seconds = own
    return held, moved


def _short(b: _Binned, peers: dict[tuple[Any, bool], tuple[float, float]]) -> bool:
    """`b` took less than its kind's spread allows below its peers' median."""
    ratio, spread = peers.get((b.kind, b.pipelined), (0.0, 1.0))
    return b.seconds < ratio * b.price / spread


def _launch_held(b: _Binned, after: _Binned | None) -> bool:
    """`after` was launched beside `b` with prompt chunks: its launch may hold `b`'s
    results."""
    return after is not None and after.pipelined and after.kind != "decode"


def _peer_ratios(
    runs: list[list[_Binned | None]], kinds: tuple[str, ...]
) -> dict[tuple[Any, bool], tuple[float, float]]:
    """(decode cell or kind, pipelined) -> the median time over analytic price of the
    steps of `kinds` whose next launch could not hold their results, and its spread
    (p90 over median: of each step's ratio over its cell's for decode, whose cells are
    full, over its kind's for the others, whose cells hold a step or two)."""
    ratios: dict[tuple[Any, bool], list[float]] = defaultdict(list)
    for run in runs:
        for b, after in zip(run, [*run[1:], None]):
            if b is not None and b.kind in kinds and not _launch_held(b, after):
                r = b.seconds / b.price
                ratios[b.kind, b.pipelined].append(r)
                if b.kind == "decode":
                    ratios[b.cell, b.pipelined].append(r)
    medians = {key: statistics.median(values) for key, values in ratios.items()}
    out = {}
    for (kind, pipelined), values in ratios.items():
        if not isinstance(kind, str):
            continue
        if kind == "decode":
            rel = [
                b.seconds / b.price / medians[b.cell, b.pipelined]
                for run in runs for b, after in zip(run, [*run[1:], None])
                if b is not None and b.kind == kind and b.pipelined == pipelined
                and not _launch_held(b, after)
            ]  # fmt: skip
        else:
            rel = [v / medians[kind, pipelined] for v in values]
        spread = max(1.0, float(np.quantile(rel, 0.9)))
        out[kind, pipelined] = (medians[kind, pipelined], spread)
        if kind == "decode":
            out.update({
                key: (m, spread) for key, m in medians.items()
                if not isinstance(key[0], str) and key[1] == pipelined
            })  # fmt: skip
    return out


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
    missing.append((
        "verify steps (a speculating engine's: its logs are refused)",
        "a speculating simulation prices them by physics (take them from a grid profile: "
        "--base)", False,
    ))  # fmt: skip
    return missing


def _beyond(
    coverage: dict[str, KindCoverage],
    binned: list[_Binned],
    logs: list[StepLogFile],
    model: ModelConfig,
) -> list[tuple[str, str, bool]]:
    """What the logged engines could run and their steps never did: decode batches up
    to max_num_seqs, contexts up to the longest request, prompt chunks up to the token
    budget and after cached prefixes as long; each with how the profile prices it."""
    engines = [log.engine for log in logs]
    seqs = max(int(e.get("max_num_seqs") or 0) for e in engines)
    budget = max(int(e.get("max_num_batched_tokens") or 0) for e in engines)
    longest = max(_max_model_len(e, model) for e in engines)
    edge = "the nearest logged shape scaled by the fit's physics"
    gaps = []
    decode = coverage.get("decode")
    if decode is not None and decode.reqs[1] < seqs:
        what = f"decode batches above {decode.reqs[1]} (max_num_seqs {seqs})"
        gaps.append((what, edge, False))
    if decode is not None and decode.context[1] < longest // 2:
        what = f"decode contexts above {decode.context[1]} (requests may reach {longest})"
        gaps.append((what, edge, False))
    if decode is not None and decode.context[0] > _SHORT_CONTEXT:
        what = f"decode contexts below {decode.context[0]} (short requests, fresh conversations)"
        gaps.append((what, edge, False))
    prompts = [r for b in binned if b.kind != "decode" for r in b.out.scheduled if r.is_prompt]
    if prompts:
        tokens = max(b.out.num_batched_tokens for b in binned if b.kind != "decode")
        if tokens < budget:
            what = f"prompt steps above {tokens} tokens (max_num_batched_tokens {budget})"
            gaps.append((what, "the fit's physics", False))
        cached = max(r.num_computed_tokens for r in prompts)
        if cached < longest // 2:
            what = (
                f"prompt chunks after cached prefixes above {cached} tokens (prefix "
                f"caching, a long prompt's later chunks; requests may reach {longest})"
            )
            gaps.append((what, "the fit's physics", False))
    return gaps


def _max_model_len(engine: dict[str, Any], model: ModelConfig) -> int:
    """The longest request a logged engine ran: its max_model_len, or the model's limit
    capped by its cache (EngineConfig's rule)."""
    if engine.get("max_model_len"):
        return int(engine["max_model_len"])
    limit = model.max_position_embeddings
    blocks, size = engine.get("num_gpu_blocks"), engine.get("block_size")
    return min(limit, int(blocks) * int(size)) if blocks and size else limit


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
        # (its decode points: uniform batches of the surface's batch)
        if (kind, _cell_key(kind, out, len(out.scheduled))) not in logged:
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
