"""Fidelity: the same requests through the real engine and through the simulator.

    deepinfer bench fidelity --out DIR [--model moonlight-16b-a3b] [--device cuda]
        [--workloads held-out | NAME,...] [--repeats 3] [--add-mtp-layer]
        [--traces azure_code_small.json,mooncake_conversation_small.jsonl]
        [--num-requests 200] [--rates 0.7,1.2] [engine options]

With --workloads: the named recipes of benchmarks/fidelity_workloads.py (`held-out`:
all of them), each a trace slice, its arrival times, and engine options that both sides
run with; a recipe the model cannot run is skipped with the reason printed. Without:
for each bundled trace, offline (every request at t=0), then Poisson arrivals at each
rate times the capacity the real offline run measured (requests per second).

Each workload runs --repeats times through `EngineCore` + the torch executor in
wall-clock time, and once through `simulate()` (deterministic) with the same
EngineConfig and the shipped (or --profile) profile. Reports:

  per step   the cost model's prediction (host + device) of every step of the first
             real run against its measured wall time, signed error p10/p50/p90 by kind
             (decode, prefill, mixed, verify); on CUDA also the device price against the
             device's span of the step
  requests   TTFT, TPOT, E2E: simulated vs the first real run, p50/p90/p99 (signed)
             and per-request |err|; throughput and makespan
  spread     the real runs' spread of each headline figure beside the simulator's
             error against their median, and whether it fell inside their range
             (benchmarks/fidelity_spread.py)
  bands      the simulated 95% band of each headline figure (--bands N replicates with
             step prices drawn from the profile's noise; default 10 where a profile
             prices the hardware, 0: none) and whether each real run fell inside
             (benchmarks/fidelity_bands.py)

Writes DIR/fidelity.json, DIR/fidelity_records.json (every record, step log and
workload's requests: `--real DIR` simulates them again without a GPU) and
DIR/fidelity.png (real vs simulated CDFs), prints the tables. The profile is fitted on
a synthetic step grid; these workloads are held out from it.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from benchmarks.fidelity_bands import (
    DEFAULT_REPLICATES,
    band_check,
    print_band_table,
    replicates_for,
)
from benchmarks.fidelity_spread import METRICS, print_spread_table, request_metrics, spread
from benchmarks.fidelity_workloads import (
    HELD_OUT,
    TraceSlice,
    Workload,
    ideal_hit_rate,
    parse_workloads,
    with_prefix_hit,
)
from benchmarks.replay import (
    ReplayResult,
    add_replay_options,
    offline,
    poisson,
    replay,
    shape_kind,
)
from deepinfer.config import EngineConfig
from deepinfer.entrypoints.cli.engine_options import add_engine_options, engine_config_from_args
from deepinfer.model_config import (
    ModelConfig,
    known_models,
    load_model_config,
    write_config_with_mtp_layer,
)
from deepinfer.outputs import ScheduledRequest, SchedulerOutput
from deepinfer.records import RequestRecord
from sim import load_trace, simulate
from sim.cost_model import device_span
from sim.cost_model_registry import engine_cost_model
from sim.hardware import get_hardware
from sim.traces import Trace, TraceRequest

ROOT = Path(__file__).resolve().parents[1]


def compare_requests(real: list[RequestRecord], sim: list[RequestRecord]) -> dict[str, Any]:
    """Signed errors of the simulated percentiles, and the median per-request |error|."""
    out: dict[str, Any] = {}
    pairs = [(request_metrics(a), request_metrics(b)) for a, b in zip(real, sim)]
    pairs = [(a, b) for a, b in pairs if a is not None and b is not None]
    out["num_compared"] = len(pairs)
    for m in METRICS:
        r = np.array([a[m] for a, b in pairs if np.isfinite(a[m]) and np.isfinite(b[m])])
        s = np.array([b[m] for a, b in pairs if np.isfinite(a[m]) and np.isfinite(b[m])])
        if len(r) == 0:
            continue
        row: dict[str, float] = {}
        for q in (50, 90, 99):
            rp, sp = float(np.percentile(r, q)), float(np.percentile(s, q))
            row[f"real_p{q}"], row[f"sim_p{q}"] = rp, sp
            row[f"err_p{q}"] = (sp - rp) / rp if rp > 0 else float("nan")
        with np.errstate(divide="ignore", invalid="ignore"):
            row["per_request_abs_err_median"] = float(np.nanmedian(np.abs(s - r) / r))
        out[m] = row
    for name, recs in (("real", real), ("sim", sim)):
        done = [x for x in recs if x.finish is not None]
        start = min(x.arrival for x in recs)
        makespan = max(x.finish for x in done) - start if done else float("nan")
        out[f"{name}_makespan_s"] = makespan
        out[f"{name}_throughput_tok_s"] = sum(x.num_output_tokens for x in done) / makespan
        out[f"{name}_statuses"] = sorted({x.status for x in recs})
    out["makespan_err"] = (out["sim_makespan_s"] - out["real_makespan_s"]) / out["real_makespan_s"]
    out["throughput_err"] = (out["sim_throughput_tok_s"] - out["real_throughput_tok_s"]) / out[
        "real_throughput_tok_s"
    ]
    return out


def compare_steps(
    result: ReplayResult,
    cost: Any,
    samples: list[dict[str, Any]] | None = None,
    basis: str = "sequential",
) -> dict[str, Any]:
    """The cost model's prediction of each real step against its real time, on `basis`
    (`step_basis`); `samples` receives one compact row per step (for analysis, and for
    `--real`)."""
    predicted = _predicted(
        [(s.kind, s.requests, s.wall_s, s.execute_s) for s in result.steps], cost, basis
    )
    table = _error_table(predicted)
    if samples is not None:
        for s, (_, _, _, pred) in zip(result.steps, predicted):
            samples.append({
                "kind": s.kind, "reqs": len(s.requests),
                "tokens": sum(q for q, _, _ in s.requests),
                "prompts": sum(p for _, _, p in s.requests),
                "ctx_sum": sum(c for _, c, _ in s.requests),
                "ctx_max": max(c for _, c, _ in s.requests), "wall_s": s.wall_s,
                "execute_s": s.execute_s, "idle_before_s": s.idle_before_s, "pred_s": pred,
                "device_s": s.device_s, "device_idle_before_s": s.device_idle_before_s,
                "launch_s": s.launch_s,
                "shape": [list(r) for r in s.requests],  # (tokens, context, is_prompt) each
            })  # fmt: skip
    return table


# A launch whose device sat idle longer than this before its first work was made after
# the step before had ended: an overlapped launch's first event queues behind that step's
# work and is stamped within microseconds of its end.
IDLE_LAUNCH_GAP_S = 50e-6


def device_errors(
    steps: list[tuple[str, list[Any], float | None, float | None]], cost: Any
) -> dict[str, Any]:
    """The cost model's device price of each real step, (kind, shape, device span, the
    device's idle time before it) each, against the device's span of its work (CUDA
    events, benchmarks/step_events.py), by step kind: the price's own error, apart from
    the host's work between launches. A step launched on an idle device (its idle
    time past IDLE_LAUNCH_GAP_S, or unknown: the first step timed) has its input
    preparation inside the span, and is priced as the simulator prices that launch
    (`launch_cost`: the sequential time); the others behind the step before, as if
    their launch began when that one's device work did (`device_span`: the device price
    and what the step's idle-launch part outlasts the step before; with launches priced
    apart, a launch-bound step's span). Steps without a span (off CUDA) are left out."""
    rows = []
    behind = None  # the device price of the step before
    for kind, shape, span, idle_before in steps:
        priced, idle = cost.launch_cost(_step_output(shape))
        on_idle = idle_before is None or idle_before > IDLE_LAUNCH_GAP_S
        if span:
            rows.append((kind, shape, span, device_span(priced, idle, None if on_idle else behind)))
        behind = priced
    return _error_table(rows)


def _step_output(shape: list[Any]) -> SchedulerOutput:
    """A step of `shape`'s requests, (tokens, context, is_prompt) each, for pricing. A
    decode of q > 1 tokens verifies q - 1 drafts (only a speculating engine schedules
    one), so it is priced as the verify step it was, not as a prompt-like chunk."""
    return SchedulerOutput(0, [
        ScheduledRequest(
            str(i), q, c, p, True, [],
            draft_token_ids=[] if p or q == 1 else list(range(q - 1)),
        )
        for i, (q, c, p) in enumerate(shape)
    ])  # fmt: skip


def _predicted(
    steps: list[tuple[str, list[Any], float, float]], cost: Any, basis: str = "sequential"
) -> list[tuple[str, list[Any], float, float]]:
    """(kind, shape, real time, prediction) per step, from (kind, shape, round wall, the
    step's own execute time), on `basis` (`step_basis`)."""
    out = []
    for kind, shape, wall, execute in steps:
        so = _step_output(shape)
        # (the host's part of a round: its core work and, priced apart, the launch)
        host, device = cost.cpu_time(so) + cost.launch_seconds(so), cost.step_time(so)
        pred = {"launch": device, "overlap": max(host, device)}.get(basis, host + device)
        out.append((kind, shape, execute if basis == "launch" else wall, pred))
    return out


def step_errors(
    steps: list[tuple[str, list[Any], float, float]], cost: Any, basis: str = "sequential"
) -> dict[str, Any]:
    """Signed relative error of the prediction by step kind: p10/p50/p90, median |err|."""
    return _error_table(_predicted(steps, cost, basis))


def _error_table(predicted: list[tuple[str, list[Any], float, float]]) -> dict[str, Any]:
    """By step kind: the signed error's p10/p50/p90 and median |err| over the steps, and
    the kind's summed real and priced seconds with their error (`sum_err`). Under async
    scheduling a round's wall goes to the step it applied, so part of one step's time
    lands in the rounds around it: the per-step errors scatter, the sums do not."""
    by_kind: dict[str, list[tuple[float, float]]] = {}
    for kind, _, wall, pred in predicted:
        by_kind.setdefault(kind, []).append((wall, pred))
    table = {}
    for kind, pairs in sorted(by_kind.items()):
        real = np.array([w for w, _ in pairs])
        priced = np.array([p for _, p in pairs])
        e = (priced - real) / real
        table[kind] = {
            "steps": len(e),
            "p10": float(np.percentile(e, 10)),
            "p50": float(np.percentile(e, 50)),
            "p90": float(np.percentile(e, 90)),
            "median_abs": float(np.median(np.abs(e))),
            "p90_abs": float(np.percentile(np.abs(e), 90)),
            "real_sum_s": float(real.sum()),
            "pred_sum_s": float(priced.sum()),
            "sum_err": float(priced.sum() / real.sum() - 1),
        }
    return table


def step_basis(cfg: EngineConfig, hardware: str) -> str:
    """What a real step's time is compared with:
    - "overlap": async scheduling on a device that is not the host's CPU, without
      speculation (this per-step table prices steps by their shapes without drafts;
      speculating runs are compared by benchmarks/speculative.py). A round's host work
      runs beside the device's, so the prediction is the longer of the two, against the
      round's wall. The host's work counts the step's launch where the cost model
      prices it apart (`launch_seconds`).
    - "launch": async scheduling where the launch runs the step (the host's CPU). A round
      applies one step and then runs the next inside its launch, so its wall is not the
      applied step's; the step's own launch time (the engine's step duration) is compared
      with the device price.
    - "sequential": otherwise, host + device against the round's wall."""
    if not cfg.async_scheduling:
        return "sequential"
    if get_hardware(hardware).runs_on_host:
        return "launch"
    return "sequential" if cfg.num_speculative_tokens else "overlap"


def step_cost_model(
    model: str | ModelConfig, hardware: str, profile: Path | None, cfg: EngineConfig
) -> tuple[Any, dict[str, Any]]:
    """The cost model `simulate` prices this engine's steps with (its quantization picks
    the profile), for the per-step tables and the label beside the simulated figures."""
    spec = model if isinstance(model, ModelConfig) else load_model_config(model)
    return engine_cost_model(None, spec, get_hardware(hardware), profile, cfg)


def run_workload(
    executor: Any,
    cfg: EngineConfig,
    trace: Trace,
    model: str | ModelConfig,
    hardware: str,
    profile: Path | None,
    model_max_len: int,
    repeats: int = 1,
    acceptance: float | None = None,
    step_log: Path | None = None,
    bands: int = 0,
) -> dict[str, Any]:
    """`trace` through the real engine `repeats` times and through the simulator once
    (it is deterministic), with the same EngineConfig; `acceptance`: the simulator's
    draft acceptance (the caller makes the real engine's match it). The first real run
    gives the per-step and per-request tables; all of them give the spread. step_log:
    the first real run's step log goes there (`deepinfer profile --from-log` fits it).
    bands: replicates of the simulation with drawn step prices (0: none), the band each
    real run's figures are read against."""
    if repeats < 1:
        raise ValueError(f"repeats={repeats}: must be >= 1")
    writer = None
    if step_log is not None:
        from executors.profile_env import step_log_writer

        name = model if isinstance(model, str) else str(executor.model_dir)
        writer = step_log_writer(step_log, executor, cfg, name)
    t0 = time.perf_counter()
    reals = [
        replay(
            executor,
            cfg,
            trace,
            model_max_len=model_max_len,
            step_writer=writer if i == 0 else None,
        )
        for i in range(repeats)
    ]
    t1 = time.perf_counter()
    rate = 0.7 if acceptance is None else acceptance
    sim = simulate(trace, model, hardware, cfg, None, profile=profile, acceptance_rate=rate)
    cost, meta = step_cost_model(model, hardware, profile, cfg)
    real = reals[0]
    samples: list[dict[str, Any]] = []
    res = {
        "workload": trace.name,
        "num_requests": len(trace),
        "real_wall_s": (t1 - t0) / repeats,
        "real_steps": len(real.steps),
        "sim_steps": sim.meta["num_steps"],
        "cost_model": meta,
        # The engine both sides ran, and the KV blocks each had.
        "engine": cfg.to_dict(),
        "real_kv_blocks": executor.num_kv_blocks(),
        "sim_kv_blocks": sim.meta["num_gpu_blocks"],
        "sim_engine": sim.meta["engine"],
        "requests": compare_requests(real.records, sim.requests),
        "steps": compare_steps(real, cost, samples, step_basis(cfg, hardware)),
        "steps_device": device_errors(
            [(x.kind, x.requests, x.device_s, x.device_idle_before_s) for x in real.steps], cost
        ),
        "step_samples": samples,
        "repeats": repeats,
        # Each real run against the simulator, and the real runs' spread beside its error.
        "repeat_requests": [compare_requests(r.records, sim.requests) for r in reals],
        "spread": spread([r.records for r in reals], sim.requests),
    }
    if bands:
        res["bands"] = band_check(
            trace, model, hardware, cfg, sim, profile, bands, rate, [r.records for r in reals]
        )
    if cfg.num_speculative_tokens:
        res["draft_acceptance"] = {
            "real": [r.draft_acceptance for r in reals],
            "sim": sim.meta.get("draft_acceptance_rate"),
        }
    res["_records"] = {
        "real": [r.to_dict() for r in real.records],
        "sim": [r.to_dict() for r in sim.requests],
        # The second and later real runs (the first is "real").
        "real_repeats": [[r.to_dict() for r in x.records] for x in reals[1:]],
    }
    # Both step logs, one row each: (time, duration, tokens, prompt tokens, requests).
    res["_timelines"] = {
        side: [
            (s.time, s.duration, s.num_batched_tokens, s.num_prompt_tokens, s.num_scheduled_reqs)
            for s in steps
        ]
        for side, steps in (("real", real.engine_steps), ("sim", sim.steps))
    }
    return res


@contextlib.contextmanager
def forced_acceptance(executor: Any, rate: float, seed: int) -> Iterator[None]:
    """The executor's MTP drafter's drafts accepted at `rate` a position (dummy weights
    draft nothing a target accepts): benchmarks/speculative.py's BENCHMARK-ONLY
    ForcedAcceptance, its drafter and verification given back after."""
    from benchmarks.speculative import ForcedAcceptance  # (torch)

    speculator = executor.runner.speculator
    if speculator is None:
        raise ValueError("forced acceptance: the executor does not speculate")
    inner = speculator.drafter
    ForcedAcceptance(inner, rate, seed=seed).install(executor.runner)
    try:
        yield
    finally:
        speculator.drafter = inner
        ForcedAcceptance.uninstall()


def _error_row(workload: str, kind: str, row: dict[str, Any]) -> str:
    return (
        f"  {workload[:44]:44s} {kind:8s} n={row['steps']:5d}  "
        f"{row['p10']:+.1%} / {row['p50']:+.1%} / {row['p90']:+.1%}; "
        f"sum {1e3 * row['pred_sum_s']:,.0f} ms priced, {1e3 * row['real_sum_s']:,.0f} real "
        f"({row['sum_err']:+.1%})"
    )


def print_tables(results: list[dict[str, Any]]) -> None:
    print(
        "\nper-step signed error of the cost model on the real steps (p10 / p50 / p90; "
        "the kind's summed time)"
    )
    for r in results:
        for kind, row in r["steps"].items():
            print(_error_row(r["workload"], kind, row))
    if any(r.get("steps_device") for r in results):
        print(
            "\nper-step signed error of the device price on the device's span (p10 / p50 / "
            "p90; the kind's summed time)"
        )
        for r in results:
            for kind, row in r.get("steps_device", {}).items():
                print(_error_row(r["workload"], kind, row))
    print("\nrequests: simulated vs real, signed error at p50 / p99; per-request median |err|")
    for r in results:
        q = r["requests"]
        cells = []
        for m in METRICS:
            if m in q:
                cells.append(
                    f"{m} {q[m]['err_p50']:+.0%}/{q[m]['err_p99']:+.0%} "
                    f"({q[m]['per_request_abs_err_median']:.0%})"
                )
        print(
            f"  {r['workload'][:44]:44s} "
            + "  ".join(cells)
            + f"  makespan {q['makespan_err']:+.1%}  throughput {q['throughput_err']:+.1%}"
        )


def plot(results: list[dict[str, Any]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(len(results), 3, figsize=(13, 2.6 * len(results)), squeeze=False)
    for row, r in zip(axes, results):
        for ax, m in zip(row, METRICS):
            for side, style in (("real", "-"), ("sim", "--")):
                vals = [
                    x
                    for x in (request_metrics(RequestRecord(**rec)) for rec in r["_records"][side])
                    if x is not None
                ]
                v = np.sort([x[m] for x in vals if np.isfinite(x[m])])
                if len(v):
                    ax.plot(v * 1e3, np.linspace(0, 1, len(v)), style, label=side)
            ax.set_title(f"{r['workload'][:40]}: {m}", fontsize=8)
            ax.set_xlabel("ms", fontsize=7)
            ax.tick_params(labelsize=7)
            ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)


# EngineConfig fields that only the scheduler reads: workloads that differ in no other
# field share one executor (building one takes tens of seconds on a GPU).
SCHEDULER_ONLY = frozenset({
    "async_scheduling", "policy", "prefill_watermark", "enable_prefix_caching",
    "enable_chunked_prefill", "enable_mtp_varlen",
})  # fmt: skip


@dataclass(frozen=True)
class Planned:
    """A workload ready to run: its slice cut for the model, the engine both sides run,
    and whether the real side's model needs an MTP layer added."""

    workload: Workload
    trace: Trace
    cfg: EngineConfig
    mtp_added: bool
    capacity_source: bool  # its real runs give the slice's offline capacity

    @property
    def executor_key(self) -> tuple[Any, ...]:
        fields = self.cfg.to_dict()
        return (
            self.mtp_added,
            *sorted((k, str(v)) for k, v in fields.items() if k not in SCHEDULER_ONLY),
        )


def legacy_workloads(traces: str, rates: str, num_requests: int) -> list[Workload]:
    """The default run: per trace, its first requests offline (the capacity), then
    Poisson at each rate (a fraction of that capacity)."""
    out = []
    for name in (x for x in traces.split(",") if x):
        trace_name = load_trace(ROOT / "traces" / name).name
        cut = TraceSlice(name, name, num_requests)
        out.append(Workload(f"{trace_name} offline", "every request at t = 0", cut))
        for frac in (float(x) for x in rates.split(",") if x):
            out.append(
                Workload(
                    f"{trace_name} {frac:.0%} of capacity",
                    f"Poisson at {frac:.0%} of the offline capacity",
                    cut,
                    "poisson",
                    of_capacity=frac,
                )
            )
    return out


def _is_capacity_source(w: Workload) -> bool:
    return (
        w.arrivals == "offline" and not w.overrides and w.kv_fraction is None
        and w.num_requests is None and w.prefix_hit is None
    )  # fmt: skip


def plan(
    recipes: list[Workload],
    spec: ModelConfig,
    base: EngineConfig,
    limit: int,
    num_requests: int | None,
    add_mtp_layer: bool,
    dummy_weights: bool,
) -> tuple[list[Planned], list[dict[str, str]]]:
    """The workloads to run, in order, and those skipped with the reason. A load that is
    a fraction of a slice's capacity gets the slice's offline run before it (added
    where not asked for). Workloads sharing an executor run together, those that give
    a capacity first."""
    recipes = list(recipes)
    for w in list(recipes):
        if w.needs_capacity and not any(
            _is_capacity_source(x) and x.slice == w.slice for x in recipes
        ):
            source = next(
                (x for x in HELD_OUT if _is_capacity_source(x) and x.slice == w.slice),
                Workload(
                    f"offline ({w.slice.name})", "the capacity the loads are fractions of", w.slice
                ),
            )
            recipes.insert(recipes.index(w), source)
            print(f"{w.name}: {source.name} runs first (its capacity sets the rate)")
    planned: list[Planned] = []
    skipped: list[dict[str, str]] = []
    for w in recipes:
        reason = _unrunnable(w, spec, limit, add_mtp_layer, dummy_weights)
        trace = None
        if reason is None:
            trace = w.slice.cut(
                limit, min(num_requests or 1 << 30, w.num_requests or w.slice.num_requests)
            )
            if len(trace) < 2:
                reason = f"fewer than two requests of {w.slice.name} fit {limit:,} tokens"
            elif w.prefix_hit is not None:
                try:
                    with_prefix_hit(trace, w.prefix_hit)
                except ValueError as e:
                    reason = str(e)
        if reason is not None or trace is None:
            skipped.append({"workload": w.name, "reason": reason or ""})
            print(f"skipping {w.name}: {reason}", flush=True)
            continue
        mtp = w.speculates and not spec.num_nextn_predict_layers
        planned.append(Planned(w, trace, w.engine(base, trace), mtp, _is_capacity_source(w)))
    measured = {p.workload.slice for p in planned if p.capacity_source}
    for p in [p for p in planned if p.workload.needs_capacity]:
        if p.workload.slice not in measured:
            planned.remove(p)
            reason = f"the offline run of {p.workload.slice.name} (its capacity) was skipped"
            skipped.append({"workload": p.workload.name, "reason": reason})
            print(f"skipping {p.workload.name}: {reason}", flush=True)
    groups: dict[tuple[Any, ...], list[Planned]] = {}
    for p in planned:
        groups.setdefault(p.executor_key, []).append(p)
    ordered = sorted(groups.values(), key=lambda g: not any(p.capacity_source for p in g))
    return [p for g in ordered for p in sorted(g, key=lambda p: not p.capacity_source)], skipped


def _unrunnable(
    w: Workload, spec: ModelConfig, limit: int, add_mtp_layer: bool, dummy_weights: bool
) -> str | None:
    """Why the model cannot run `w` as its recipe means it, or None."""
    need = w.slice.longest_needed()
    if need > limit:
        return (
            f"its requests need up to {need:,} tokens (prompts {w.slice.min_prompt:,}-"
            f"{w.slice.max_prompt:,}) and {spec.name} holds {limit:,}; run it with a model of "
            "a longer context (deepseek-v2-lite)"
        )
    if w.speculates and not spec.num_nextn_predict_layers:
        if not add_mtp_layer:
            return (
                f"{spec.name} has no MTP layer to draft with; --add-mtp-layer gives it one "
                "in its own shapes (dummy weights, as `deepinfer profile --add-mtp-layer` "
                "measures it)"
            )
        if not dummy_weights:
            return (
                f"the checkpoint of {spec.name} has no MTP weights; --add-mtp-layer needs "
                "a preset's dummy weights"
            )
    return None


def run_planned(
    planned: list[Planned],
    build: Callable[[EngineConfig, bool], Any],
    sim_model: Callable[[bool], str | ModelConfig],
    hardware: str,
    profile: Path | None,
    repeats: int,
    step_log: Path | None = None,
    bands: int = 0,
) -> list[dict[str, Any]]:
    """Each planned workload through `run_workload`, one executor at a time (`build`:
    (engine, MTP layer added) -> executor); a slice's capacity comes from its offline
    run, the median over its real runs. step_log: a folder for each workload's step log
    (its first real run's). bands: `run_workload`'s."""
    capacity: dict[str, float] = {}
    results: list[dict[str, Any]] = []
    executor: Any = None
    key: tuple[Any, ...] | None = None
    try:
        for p in planned:
            if p.executor_key != key:
                if executor is not None:
                    executor.shutdown()
                    executor = None
                executor, key = build(p.cfg, p.mtp_added), p.executor_key
            w = p.workload
            load = w.load(p.trace, capacity.get(w.slice.name), p.cfg.seed)
            forced = (
                forced_acceptance(executor, w.acceptance, p.cfg.seed)
                if w.acceptance is not None and p.cfg.num_speculative_tokens
                else contextlib.nullcontext()
            )
            with forced:
                res = run_workload(
                    executor, p.cfg, load, sim_model(p.mtp_added), hardware, profile,
                    executor.max_model_len, repeats, w.acceptance,
                    _log_path(step_log, load.name), bands,
                )  # fmt: skip
            res["recipe"] = _recipe(w, p, load)
            res["_trace"] = [dataclasses.asdict(r) for r in load.requests]
            results.append(res)
            if p.capacity_source:
                runs = [len(p.trace) / m for m in res["spread"]["makespan"]["real"]]
                capacity[w.slice.name] = float(np.median(runs))
                print(f"{w.slice.name}: capacity {capacity[w.slice.name]:.2f} req/s", flush=True)
    finally:
        if executor is not None:
            executor.shutdown()
    return results


def _recipe(w: Workload, p: Planned, load: Trace) -> dict[str, Any]:
    """What a workload was, for the JSON and for `--real` re-simulation."""
    return {
        "name": w.name,
        "what": w.what,
        "slice": dataclasses.asdict(w.slice),
        "arrivals": w.arrivals,
        "speed": w.speed,
        "of_capacity": w.of_capacity,
        "prefix_hit": w.prefix_hit,
        "ideal_hit_rate": ideal_hit_rate(load),
        "kv_fraction": w.kv_fraction,
        "overrides": dict(w.overrides),
        "acceptance": w.acceptance,
        "mtp_layer_added": p.mtp_added,
        "arrival_span_s": load.duration,
    }


def resimulate(real_dir: Path, profile: Path | None, out: Path, bands: int = 0) -> int:
    """The simulated side again, against the real records of an earlier run: what a
    cost-model change does to the request-level errors, without a GPU; with `bands`
    replicates, the simulated bands and whether each recorded real run fell inside."""
    doc = json.loads((real_dir / "fidelity.json").read_text())
    recorded = json.loads((real_dir / "fidelity_records.json").read_text())
    meta = doc["meta"]
    real = {w["workload"]: w for w in recorded}
    # Step shapes are recorded since the piecewise-graph change; older runs have none.
    recorded_steps = {w["workload"]: w.get("step_samples", []) for w in doc["workloads"]}
    recorded_acceptance = {w["workload"]: w.get("draft_acceptance", {}) for w in doc["workloads"]}
    if all("recipe" in w for w in doc["workloads"]):
        loads = _recorded_loads(doc, real)
    else:
        loads = _rebuilt_loads(meta, real)
    results = []
    for wname, load, cfg, model, acceptance in loads:
        rate = 0.7 if acceptance is None else acceptance
        sim = simulate(
            load, model, meta["hardware"], cfg, None, profile=profile, acceptance_rate=rate
        )
        records = [RequestRecord(**r) for r in real[wname]["real"]]
        runs = [records] + [
            [RequestRecord(**r) for r in run] for run in real[wname].get("real_repeats", [])
        ]
        cost, _ = step_cost_model(model, meta["hardware"], profile, cfg)
        samples = [x for x in recorded_steps.get(wname, []) if "shape" in x]
        basis = step_basis(cfg, meta["hardware"])
        # (kinds from the shapes: runs recorded before verify was a kind of its own
        # called verify steps mixed)
        steps = step_errors(
            [(shape_kind(x["shape"]), x["shape"], x["wall_s"], x["execute_s"]) for x in samples],
            cost,
            basis,
        )
        on_device = [
            (
                shape_kind(x["shape"]),
                x["shape"],
                x.get("device_s"),
                x.get("device_idle_before_s", 0.0),
            )
            for x in samples
        ]
        results.append({
            "workload": wname, "requests": compare_requests(records, sim.requests),
            "steps": steps, "steps_device": device_errors(on_device, cost),
            "spread": spread(runs, sim.requests),
        })  # fmt: skip
        if bands:
            results[-1]["bands"] = band_check(
                load, model, meta["hardware"], cfg, sim, profile, bands, rate, runs
            )
        if cfg.num_speculative_tokens:
            results[-1]["draft_acceptance"] = {
                "real": recorded_acceptance.get(wname, {}).get("real", []),
                "sim": sim.meta.get("draft_acceptance_rate"),
            }
    print_tables(results)
    print_spread_table(results, doc.get("skipped", []))
    print_band_table(results)
    out.mkdir(parents=True, exist_ok=True)
    (out / "resimulated.json").write_text(json.dumps(results, indent=1, default=str) + "\n")
    return 0


Load = tuple[str, Trace, EngineConfig, "str | ModelConfig", "float | None"]


def _recorded_loads(doc: dict[str, Any], real: dict[str, Any]) -> list[Load]:
    """Each workload of a run that recorded its requests and engine (recipes)."""
    meta = doc["meta"]
    out: list[Load] = []
    for w in doc["workloads"]:
        name, recipe = w["workload"], w["recipe"]
        reqs = [
            TraceRequest(**(r | {"prefix_blocks": tuple(r["prefix_blocks"])}))
            for r in real[name]["trace"]
        ]
        name_or_dir: str = meta["sim_model"]
        model: str | ModelConfig = name_or_dir
        if recipe["mtp_layer_added"]:
            model = load_model_config(name_or_dir).replace(num_nextn_predict_layers=1)
        cfg = EngineConfig.from_dict(w["engine"])
        out.append((name, Trace(name, "recorded", reqs), cfg, model, recipe["acceptance"]))
    return out


def _rebuilt_loads(meta: dict[str, Any], real: dict[str, Any]) -> list[Load]:
    """Each workload of a run that recorded only the traces and rates: rebuilt from the
    bundled traces, the capacity from its recorded offline run."""
    engine = {k: v for k, v in meta["engine"].items() if k != "role"}
    cfg = EngineConfig(**engine)
    model = meta.get("sim_model", meta["model"])
    spec = load_model_config(model)
    limit = meta.get("max_prompt") or min(
        spec.max_position_embeddings, (cfg.num_gpu_blocks or 1 << 40) * cfg.block_size
    )
    out: list[Load] = []
    for name in meta.get("traces", "azure_code_small.json").split(","):
        trace = TraceSlice(name, name, meta.get("num_requests", 200)).cut(limit)
        first = [RequestRecord(**r) for r in real[f"{trace.name} offline"]["real"]]
        capacity = len(trace) / compare_requests(first, first)["real_makespan_s"]
        out.append((f"{trace.name} offline", offline(trace), cfg, model, None))
        for w in real:
            if w.startswith(trace.name) and w.endswith("of capacity"):
                rate = float(w.split()[-3].rstrip("%")) / 100 * capacity
                out.append((w, poisson(trace, rate, cfg.seed), cfg, model, None))
    return out


def _log_path(folder: Path | None, workload: str) -> Path | None:
    """Where a workload's step log goes under `folder` (None: none is written)."""
    if folder is None:
        return None
    return folder / ("".join(c if c.isalnum() or c in "-_." else "_" for c in workload) + ".jsonl")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_replay_options(p)
    p.add_argument(
        "--workloads",
        default=None,
        help="named workloads (benchmarks/fidelity_workloads.py), comma-separated, or "
        "'held-out' for all of them: " + ", ".join(w.name for w in HELD_OUT),
    )
    p.add_argument(
        "--traces",
        default=None,
        help="without --workloads: bundled traces, each offline then at --rates "
        "(default: azure_code_small.json,mooncake_conversation_small.jsonl)",
    )
    p.add_argument(
        "--num-requests",
        type=int,
        default=None,
        help="requests per trace (default 200); with --workloads, at most this many each",
    )
    p.add_argument(
        "--rates", default=None, help="without --workloads: fractions of the offline capacity "
        "(default: 0.7,1.2)"
    )  # fmt: skip
    p.add_argument(
        "--repeats",
        type=int,
        default=None,
        help="real runs of each workload, for the engine's own run-to-run spread (default: "
        "3 on CUDA, else 1)",
    )
    p.add_argument(
        "--add-mtp-layer",
        action="store_true",
        help="give a model with no MTP layer one in its own shapes for the speculating "
        "workloads (dummy weights only), on both sides",
    )
    p.add_argument(
        "--max-prompt",
        type=int,
        default=None,
        help="drop requests whose prompt + output exceed this (default: the model's)",
    )
    p.add_argument(
        "--real",
        type=Path,
        default=None,
        help="no GPU: simulate again against the real runs recorded in DIR (its "
        "fidelity.json and fidelity_records.json), with the current cost model",
    )
    p.add_argument(
        "--step-log",
        type=Path,
        default=None,
        metavar="DIR",
        help="write each workload's real run as a step log, DIR/<workload>.jsonl (for "
        "`deepinfer profile --from-log`: a profile fitted from some workloads' logs, "
        "checked on the others')",
    )
    p.add_argument(
        "--bands",
        type=int,
        default=None,
        metavar="N",
        help="simulate each workload N more times with step prices drawn from the "
        "profile's noise: the 95%% band of each headline figure, and whether each real run "
        "fell inside (default: 10 where a profile prices the hardware, else none; 0: none)",
    )
    add_engine_options(p)
    args = p.parse_args(argv)
    if args.bands is not None and args.bands < 0:
        p.error(f"--bands {args.bands}: the replicates, 0 (none) or more")
    if args.real is not None:
        if args.step_log is not None:
            p.error("--step-log: --real runs no real engine (it re-simulates recorded runs)")
        bands = DEFAULT_REPLICATES if args.bands is None else args.bands
        return resimulate(args.real, args.profile, args.out, bands)
    cfg = engine_config_from_args(args)
    if args.workloads is not None:
        if args.traces is not None or args.rates is not None:
            raise ValueError(
                "--traces and --rates choose the default run; --workloads names its own"
            )
        recipes = parse_workloads(args.workloads)
    else:
        recipes = legacy_workloads(
            args.traces or "azure_code_small.json,mooncake_conversation_small.jsonl",
            args.rates if args.rates is not None else "0.7,1.2",
            args.num_requests or 200,
        )

    import torch

    from executors.loader import resolve_model_dir
    from executors.profile_env import hardware_name
    from executors.torch_executor import TorchExecutor

    dummy = args.model in known_models()
    load_format = "dummy" if dummy else "auto"
    spec = load_model_config(resolve_model_dir(args.model, weights=not dummy))
    if args.add_mtp_layer:
        if spec.num_nextn_predict_layers:
            raise ValueError(
                f"--add-mtp-layer: {spec.name} ships {spec.num_nextn_predict_layers} MTP "
                "layer(s) already; drop the flag"
            )
        if not any(w.speculates for w in recipes):
            raise ValueError("--add-mtp-layer: no workload named speculates")
    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    hardware = args.hardware or hardware_name(device)
    bands = replicates_for(args.bands, spec, hardware, cfg, args.profile)
    repeats = args.repeats or (3 if device.type == "cuda" else 1)
    cache = cfg.num_gpu_blocks * cfg.block_size if cfg.num_gpu_blocks else 1 << 62
    limit = args.max_prompt or min(cfg.max_model_len or spec.max_position_embeddings, cache)
    planned, skipped = plan(
        recipes, spec, cfg, limit, args.num_requests if args.workloads else None,
        args.add_mtp_layer, dummy,
    )  # fmt: skip
    if not planned:
        print("no workload to run", file=sys.stderr)
        return 2
    sim_name = args.model if dummy else str(resolve_model_dir(args.model, weights=True))
    startup: list[float] = []

    def build(engine: EngineConfig, mtp_added: bool) -> Any:
        model = args.model
        if mtp_added:
            model = str(
                write_config_with_mtp_layer(args.model, tempfile.mkdtemp(prefix="fidelity-"))
            )
        executor = TorchExecutor(
            engine, model, device=str(device), dtype=args.dtype, load_format=load_format
        )
        startup.append(executor.startup_seconds)
        return executor

    def sim_model(mtp_added: bool) -> str | ModelConfig:
        if mtp_added:
            return load_model_config(sim_name).replace(num_nextn_predict_layers=1)
        return sim_name

    results = run_planned(
        planned, build, sim_model, hardware, args.profile, repeats, args.step_log, bands
    )
    print_tables(results)
    print_spread_table(results, skipped)
    print_band_table(results)
    args.out.mkdir(parents=True, exist_ok=True)
    plot(results, args.out / "fidelity.png")
    meta = {
        "model": args.model,
        "sim_model": sim_name,
        "max_prompt": limit,
        "num_requests": args.num_requests or 200,
        "traces": args.traces or "azure_code_small.json,mooncake_conversation_small.jsonl",
        "workloads": [r["workload"] for r in results],
        "repeats": repeats,
        "hardware": hardware,
        "engine": {k: getattr(cfg, k) for k in cfg.field_names()} | {"role": cfg.role.value},
        "startup_s": startup[0] if startup else None,
        "date": time.strftime("%Y-%m-%d %H:%M"),
    }
    (args.out / "fidelity.json").write_text(
        json.dumps(
            {
                "meta": meta,
                "workloads": [{k: v for k, v in r.items() if k[0] != "_"} for r in results],
                "skipped": skipped,
            },
            indent=1,
            default=str,
        )
        + "\n"
    )
    # For analysis beside fidelity.json: every request record, both step logs, and the
    # requests each workload ran (what `--real` simulates again).
    (args.out / "fidelity_records.json").write_text(
        json.dumps(
            [
                {"workload": r["workload"]}
                | r["_records"]
                | {"timelines": r["_timelines"]}
                | {"trace": r["_trace"]}
                for r in results
            ]
        )  # fmt: skip
        + "\n"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
