"""One point of a sweep: a config at a rate, simulated, reduced to one row.

This is what a worker runs, in this process, a pool process or a Ray task. It never
raises for a simulation that goes wrong: a stall, rejected requests or an error become
the row's `status` and `reason`, so one bad point cannot end a sweep.
"""

from __future__ import annotations

import functools
import traceback
import warnings
from dataclasses import dataclass
from typing import Any

from sim.sweep.grid import SweepConfig
from sim.sweep.slo import SweepSLO, good_fraction
from sim.traces import Trace, poisson

# Per-point figures kept in the results (summary keys of deepinfer.metrics).
METRICS = (
    "request_throughput",
    "output_throughput",
    "ttft_ms_p50",
    "ttft_ms_p99",
    "tpot_ms_p50",
    "tpot_ms_p99",
    "e2el_ms_p99",
    "kv_usage_mean",
    "kv_usage_max",
    "num_completed",
    "num_rejected",
    "total_preemptions",
    "duration_s",
    "num_steps",
)
# A cluster's plan at each point (sim/cluster/cluster_report.py, plan_cost).
COST_METRICS = ("gpus", "dollars_per_hour", "per_million_output_tokens", "per_million_input_tokens")


@dataclass(frozen=True)
class SweepContext:
    """What every point of one sweep shares (sent to each worker once)."""

    trace: Trace
    slo: SweepSLO
    seed: int


@dataclass(frozen=True)
class PointTask:
    config: SweepConfig
    rate: float


def run_point(task: PointTask, ctx: SweepContext) -> dict[str, Any]:
    """Simulate `task.config` on the trace re-timed as Poisson arrivals at `task.rate`."""
    from deepinfer.errors import SchedulerStalled
    from sim.simulator import simulate

    cfg = task.config
    if cfg.cluster is not None:
        return _run_cluster_point(task, ctx)
    row: dict[str, Any] = {"config_key": cfg.key, "rate": task.rate}
    try:
        engine = cfg.engine_config()
        cost, cost_meta = _cost_model(
            cfg.model,
            cfg.hardware,
            cfg.cost_model,
            engine.num_speculative_tokens,
            engine.async_scheduling,
            engine.max_num_seqs,
            engine.max_num_batched_tokens,
        )
    except Exception as e:  # e.g. cost_model 'profiled' where no profile exists
        return row | {"status": "invalid", "meets_slo": False, "reason": _one_line(e)}
    row |= {"cost_model": cost_meta["cost_model"], "calibrated": cost_meta["calibrated"]}
    trace = poisson(ctx.trace, task.rate, seed=ctx.seed)
    slo = ctx.slo.per_request if ctx.slo.goodput is not None else None
    with warnings.catch_warnings(record=True) as caught:
        # "always": the first warning of a kind must not depend on which points a worker
        # ran before, or the rows would differ between worker counts.
        warnings.simplefilter("always")
        try:
            result = simulate(
                trace,
                _model(cfg.model),
                cfg.hardware,
                engine,
                cost,
                slo=slo,
                acceptance_rate=cfg.acceptance_rate,
            )
        except SchedulerStalled as e:
            return row | _failed("stalled", e, caught)
        except Exception as e:  # a bug must become a row, not end the sweep
            detail = traceback.format_exception_only(type(e), e)[-1]
            return row | _failed("error", detail, caught)
    summary = result.summary
    row |= {k: summary.get(k) for k in METRICS}
    return _judged(row, summary, ctx, caught)


def _run_cluster_point(task: PointTask, ctx: SweepContext) -> dict[str, Any]:
    """A cluster config's point: simulate_cluster, and the plan's cost at this rate."""
    from deepinfer.errors import SchedulerStalled
    from sim.cluster import simulate_cluster
    from sim.cluster.description import cluster_from_dict

    cfg = task.config
    row: dict[str, Any] = {"config_key": cfg.key, "rate": task.rate}
    try:
        spec = cluster_from_dict(
            cfg.cluster,
            source="cluster",
            base_engine=cfg.engine_config(),
            hardware=cfg.hardware,
            model=cfg.model,
        )
    except Exception as e:
        return row | {"status": "invalid", "meets_slo": False, "reason": _one_line(e)}
    trace = poisson(ctx.trace, task.rate, seed=ctx.seed)
    slo = ctx.slo.per_request if ctx.slo.goodput is not None else None
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            result = simulate_cluster(
                trace, spec, cfg.cost_model, slo=slo, acceptance_rate=cfg.acceptance_rate
            )
        except SchedulerStalled as e:
            return row | _failed("stalled", e, caught)
        except Exception as e:  # a bug must become a row, not end the sweep
            detail = traceback.format_exception_only(type(e), e)[-1]
            return row | _failed("error", detail, caught)
    summary = result.summary
    pools = result.meta["pools"]
    row["cost_model"] = pools[0].get("cost_model")
    row["calibrated"] = all(p.get("profile") for p in pools)
    row |= {k: summary.get(k) for k in METRICS if k != "num_steps"}
    row["num_steps"] = result.meta["num_steps"]
    cost = result.meta["cost"]
    row["gpus"] = cost["gpus"]
    hours = cost["gpu_hours"] / cost["gpus"] if cost["gpus"] else 0.0
    row["dollars_per_hour"] = cost["dollars"] / hours if hours else None
    row["per_million_output_tokens"] = cost["per_million_output_tokens"]
    row["per_million_input_tokens"] = cost["per_million_input_tokens"]
    return _judged(row, summary, ctx, caught)


def _judged(
    row: dict[str, Any], summary: dict[str, Any], ctx: SweepContext, caught: list[Any]
) -> dict[str, Any]:
    """A simulated point's row completed: its goodput, warnings, and its status against
    the SLO (any rejected request fails the point, naming why)."""
    row["good_fraction"] = good_fraction(summary) if ctx.slo.goodput is not None else None
    row["warnings"] = _warnings(caught)
    if summary["num_rejected"]:
        reasons = "; ".join(summary["rejected_reasons"])
        row |= {"status": "rejected", "meets_slo": False}
        row["reason"] = f"{summary['num_rejected']} requests rejected: {reasons}"
        return row
    ok, why = ctx.slo.check(summary)
    return row | {"status": "ok", "meets_slo": ok, "reason": why}


def _failed(status: str, err: BaseException | str, caught: list[Any]) -> dict[str, Any]:
    return {
        "status": status,
        "meets_slo": False,
        "reason": _one_line(err),
        "warnings": _warnings(caught),
    }


def _one_line(err: BaseException | str) -> str:
    text = str(err).strip()
    return text.splitlines()[0] if text else type(err).__name__


def _warnings(caught: list[Any]) -> str:
    return "; ".join(sorted({str(w.message) for w in caught}))


@functools.lru_cache(maxsize=16)
def _model(name: str) -> Any:
    from deepinfer.model_config import load_model_config

    return load_model_config(name)


@functools.lru_cache(maxsize=16)
def _cost_model(
    model: str,
    hardware: str,
    name: str | None,
    num_speculative_tokens: int,
    async_scheduling: bool = False,
    max_num_seqs: int = 256,
    max_num_batched_tokens: int = 8192,
) -> tuple[Any, dict[str, Any]]:
    """Resolved once per worker process: fitting a profile costs more than a short run,
    and a cost model is pure (the same step always costs the same)."""
    from sim.cost_model_registry import resolve_cost_model
    from sim.hardware import get_hardware

    return resolve_cost_model(
        name,
        _model(model),
        get_hardware(hardware),
        num_speculative_tokens=num_speculative_tokens,
        async_scheduling=async_scheduling,
        max_num_seqs=max_num_seqs,
        max_num_batched_tokens=max_num_batched_tokens,
    )
