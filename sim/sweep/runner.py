"""run_sweep: every config's rate search, its points run on a backend, rows collected.

Points already in the results file are taken from it (resume); the others go to the
backend as soon as their search asks for them, so the workers stay busy across configs.
The outcome (rows, ranking) depends only on each search's own points, which makes it the
same whatever the backend, the worker count or the order points finish in.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from sim.sweep.backends import Backend
from sim.sweep.grid import DEFAULTS, Grid, SweepConfig
from sim.sweep.point import COST_METRICS, METRICS, PointTask, SweepContext
from sim.sweep.results import ResultStore
from sim.sweep.search import RateSearch

# Figures a config row repeats from its best point.
_AT_MAX = (
    "request_throughput",
    "output_throughput",
    "ttft_ms_p50",
    "ttft_ms_p99",
    "tpot_ms_p50",
    "tpot_ms_p99",
    "kv_usage_max",
)


@dataclass
class SweepOutcome:
    configs: list[dict[str, Any]]  # ranked, best first
    points: list[dict[str, Any]]  # by config (grid order), then rate
    num_simulated: int  # points run now (the others came from the results file)
    num_resumed: int


def run_sweep(
    grid: Grid,
    ctx: SweepContext,
    backend: Backend,
    store: ResultStore,
    on_progress: Callable[[int, int], None] | None = None,
) -> SweepOutcome:
    """Run every config's search; `on_progress(done, estimated_total)` after each point."""
    cached = store.load()
    start = _mean_rate(ctx)
    searches = {c.key: RateSearch(grid.rate, start) for c in grid.configs}
    by_key = {c.key: c for c in grid.configs}
    done = resumed = 0

    def feed(cfg: SweepConfig) -> None:
        """Ask `cfg`'s search for rates; answer from the file while it can."""
        nonlocal done, resumed
        search = searches[cfg.key]
        while rates := search.next_rates():
            fresh = []
            for rate in rates:
                row = cached.get((cfg.key, rate))
                if row is None:
                    fresh.append(rate)
                    continue
                search.record(rate, row)
                done, resumed = done + 1, resumed + 1
            for rate in fresh:
                backend.submit(PointTask(cfg, rate))
            if fresh:
                return

    def progress() -> None:
        if on_progress is not None:
            on_progress(done, done + sum(s.remaining_estimate() for s in searches.values()))

    for cfg in grid.configs:
        feed(cfg)
    progress()
    while backend.in_flight():
        row = backend.next_done()
        store.append(row)
        done += 1
        searches[row["config_key"]].record(row["rate"], row)
        feed(by_key[row["config_key"]])
        progress()
    store.close()

    points = []
    for cfg in grid.configs:
        for rate in sorted(searches[cfg.key].rows):
            points.append(_point_row(cfg, searches[cfg.key].rows[rate]))
    configs = [_config_row(c, searches[c.key]) for c in grid.configs]
    configs += [_invalid_row(combo, why, grid) for combo, why in grid.invalid]
    return SweepOutcome(rank(configs), points, done - resumed, resumed)


def rank(configs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Best first: the highest max rate; ties by throughput there, then by grid order
    (a stable sort). Cluster plans: the lowest cost per million output tokens at their
    max rate first. Configs with no rate meeting the SLO come last, in grid order."""

    def key(r: dict[str, Any]) -> tuple[Any, ...]:
        cost = r.get("per_million_output_tokens")
        return (
            r["max_rate"] is None,
            cost if cost is not None else 0.0,
            -(r["max_rate"] or 0.0),
            -(r.get("request_throughput") or 0.0),
        )

    ranked = sorted(configs, key=key)
    for i, row in enumerate(ranked, 1):
        row["rank"] = i
    return [{"rank": r.pop("rank"), **r} for r in ranked]


def _knobs(cfg: SweepConfig) -> dict[str, Any]:
    out = {"config": cfg.label, "model": cfg.model, "hardware": cfg.hardware}
    return out | {k: cfg.value(k) for k in cfg.varied if k not in out}


def _point_row(cfg: SweepConfig, row: dict[str, Any]) -> dict[str, Any]:
    head = _knobs(cfg) | {"rate": row["rate"], "status": row["status"]}
    head |= {"meets_slo": row["meets_slo"], "reason": row.get("reason", "")}
    tail = {k: row.get(k) for k in (*METRICS, "good_fraction")}
    if cfg.cluster is not None:
        tail |= {k: row.get(k) for k in COST_METRICS}
    tail |= {k: row.get(k) for k in ("cost_model", "calibrated", "warnings")}
    return head | tail | {"config_key": cfg.key}


def _config_row(cfg: SweepConfig, search: RateSearch) -> dict[str, Any]:
    best = search.rows.get(search.max_rate) if search.max_rate is not None else None
    any_row = next(iter(search.rows.values()), {})
    statuses = {r["status"] for r in search.rows.values()}
    fatal = next((s for s in ("invalid", "rejected", "error") if s in statuses), None)
    status = fatal or ("ok" if best is not None else "no rate meets the SLO")
    if best is None and fatal is None and "stalled" in statuses:
        status = "stalled"
    note = search.note
    if best is None and fatal is None:  # say why the lowest rate tried missed
        low = search.rows[min(search.rows)] if search.rows else {}
        note = f"at {low.get('rate', 0):g} req/s: {low.get('reason', '')}"
    row = _knobs(cfg) | {"max_rate": search.max_rate, "status": status, "note": note}
    row |= {k: (best or {}).get(k) for k in _AT_MAX}
    if cfg.cluster is not None:
        row |= {k: (best or {}).get(k) for k in COST_METRICS}
    row |= {
        "cost_model": any_row.get("cost_model"),
        "calibrated": any_row.get("calibrated"),
        "points": len(search.rows),
        "config_key": cfg.key,
        "engine": cfg.engine,
    }
    if cfg.cluster is not None:
        row["cluster"] = cfg.cluster
    return row


def _invalid_row(combo: dict[str, Any], why: str, grid: Grid) -> dict[str, Any]:
    label = " ".join(f"{k}={combo[k]}" for k in grid.varied if k in combo)
    return {
        "config": label,
        "model": combo.get("model", DEFAULTS["model"]),
        "hardware": combo.get("hardware", DEFAULTS["hardware"]),
        **{k: combo.get(k) for k in grid.varied if k not in ("model", "hardware")},
        "max_rate": None,
        "status": "invalid",
        "note": why,
        "points": 0,
    }


def _mean_rate(ctx: SweepContext) -> float:
    """The trace's own request rate: where a bisection starts unless told otherwise."""
    n, span = len(ctx.trace), ctx.trace.duration
    return (n - 1) / span if n > 1 and span > 0 else 1.0
