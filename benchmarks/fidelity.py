"""Fidelity: the same requests through the real engine and through the simulator.

    deepinfer bench fidelity --out DIR [--model moonlight-16b-a3b] [--device cuda]
        [--traces azure_code_small.json,mooncake_conversation_small.jsonl]
        [--num-requests 200] [--rates 0.7,1.2] [engine options]

For each bundled trace: offline (every request at t=0), then Poisson arrivals at each
rate times the capacity the real offline run measured (requests per second). Each
workload runs through `EngineCore` + the torch executor in wall-clock time and through
`simulate()` with the same EngineConfig and the shipped (or --profile) profile. Reports:

  per step   the cost model's prediction (host + device) of every real step against its
             measured wall time, signed error p10/p50/p90 by kind (decode, prefill, mixed)
  requests   TTFT, TPOT, E2E: simulated vs real p50/p90/p99 (signed) and per-request |err|
  totals     throughput and makespan

Writes DIR/fidelity.json and DIR/fidelity.png (real vs simulated CDFs), prints tables.
The profile is fitted on a synthetic step grid; these workloads are held out from it.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

from benchmarks.replay import ReplayResult, offline, poisson, replay
from deepinfer.config import EngineConfig
from deepinfer.entrypoints.cli.engine_options import add_engine_options, engine_config_from_args
from deepinfer.model_config import known_models, load_model_config
from deepinfer.outputs import ScheduledRequest, SchedulerOutput
from deepinfer.records import RequestRecord
from sim import load_trace, simulate
from sim.cost_model_registry import resolve_cost_model
from sim.hardware import get_hardware
from sim.traces import Trace

ROOT = Path(__file__).resolve().parents[1]
METRICS = ("ttft", "tpot", "e2e")


def request_metrics(rec: RequestRecord) -> dict[str, float] | None:
    if rec.status != "finished" or rec.first_token is None or rec.finish is None:
        return None
    n = rec.num_output_tokens
    return {
        "ttft": rec.first_token - rec.arrival,
        "tpot": (rec.finish - rec.first_token) / (n - 1) if n > 1 else float("nan"),
        "e2e": rec.finish - rec.arrival,
    }


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
                "shape": [list(r) for r in s.requests],  # (tokens, context, is_prompt) each
            })  # fmt: skip
    return table


def device_errors(steps: list[tuple[str, list[Any], float | None]], cost: Any) -> dict[str, Any]:
    """The cost model's device price of each real step, (kind, shape, device span) each,
    against the device's span of its work (CUDA events, benchmarks/step_events.py), by
    step kind: the price's own error, apart from the host's work and how it overlaps.
    Steps without a span (off CUDA) are left out."""
    return _error_table([
        (kind, shape, span, cost.step_time(_step_output(shape)))
        for kind, shape, span in steps
        if span
    ])  # fmt: skip


def _step_output(shape: list[Any]) -> SchedulerOutput:
    """A step of `shape`'s requests, (tokens, context, is_prompt) each, for pricing."""
    return SchedulerOutput(
        0, [ScheduledRequest(str(i), q, c, p, True, []) for i, (q, c, p) in enumerate(shape)]
    )


def _predicted(
    steps: list[tuple[str, list[Any], float, float]], cost: Any, basis: str = "sequential"
) -> list[tuple[str, list[Any], float, float]]:
    """(kind, shape, real time, prediction) per step, from (kind, shape, round wall, the
    step's own execute time), on `basis` (`step_basis`)."""
    out = []
    for kind, shape, wall, execute in steps:
        so = _step_output(shape)
        host, device = cost.cpu_time(so), cost.step_time(so)
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
      round's wall.
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


def run_workload(
    executor: Any,
    cfg: EngineConfig,
    trace: Trace,
    model: str,
    hardware: str,
    profile: Path | None,
    model_max_len: int,
    step_log: Path | None = None,
) -> dict[str, Any]:
    """One workload through the real engine and the simulator, compared; step_log: the
    real run's step log goes there (`deepinfer profile --from-log` fits it)."""
    writer = None
    if step_log is not None:
        from executors.profile_env import step_log_writer

        writer = step_log_writer(step_log, executor, cfg, model)
    t0 = time.perf_counter()
    real = replay(executor, cfg, trace, model_max_len=model_max_len, step_writer=writer)
    t1 = time.perf_counter()
    sim = simulate(trace, model, hardware, cfg, None, profile=profile)
    spec = load_model_config(model)
    cost, meta = resolve_cost_model(
        None,
        spec,
        get_hardware(hardware),
        profile,
        cfg.num_speculative_tokens,
        batch_invariant=cfg.batch_invariant,
        async_scheduling=cfg.async_scheduling,
    )
    res = {
        "workload": trace.name,
        "num_requests": len(trace),
        "real_wall_s": t1 - t0,
        "real_steps": len(real.steps),
        "sim_steps": sim.meta["num_steps"],
        "cost_model": meta,
        "requests": compare_requests(real.records, sim.requests),
        "steps": compare_steps(real, cost, samples := [], step_basis(cfg, hardware)),
        "steps_device": device_errors([(x.kind, x.requests, x.device_s) for x in real.steps], cost),
        "step_samples": samples,
    }
    res["_records"] = {
        "real": [r.to_dict() for r in real.records],
        "sim": [r.to_dict() for r in sim.requests],
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


def workloads(base: Trace, limit: int, num_requests: int) -> Trace:
    """The trace's first `num_requests` requests that fit `limit` tokens."""
    reqs = [r for r in base.requests if r.prompt_len + r.output_len <= limit]
    return Trace(base.name, base.source, reqs[:num_requests])


def resimulate(real_dir: Path, profile: Path | None, out: Path) -> int:
    """The simulated side again, against the real records of an earlier run: what a
    cost-model change does to the request-level errors, without a GPU."""
    doc = json.loads((real_dir / "fidelity.json").read_text())
    recorded = json.loads((real_dir / "fidelity_records.json").read_text())
    meta = doc["meta"]
    engine = {k: v for k, v in meta["engine"].items() if k != "role"}
    cfg = EngineConfig(**engine)
    model = meta.get("sim_model", meta["model"])
    spec = load_model_config(model)
    limit = meta.get("max_prompt") or min(
        spec.max_position_embeddings, (cfg.num_gpu_blocks or 1 << 40) * cfg.block_size
    )
    real = {w["workload"]: [RequestRecord(**r) for r in w["real"]] for w in recorded}
    # Step shapes are recorded since the piecewise-graph change; older runs have none.
    recorded_steps = {w["workload"]: w.get("step_samples", []) for w in doc["workloads"]}
    results = []
    traces = meta.get("traces", "azure_code_small.json").split(",")
    for name in traces:
        trace = workloads(load_trace(ROOT / "traces" / name), limit, meta.get("num_requests", 200))
        first = real[f"{trace.name} offline"]
        capacity = len(trace) / compare_requests(first, first)["real_makespan_s"]
        for wname, load in [(f"{trace.name} offline", offline(trace))] + [
            (w, poisson(trace, float(w.split()[-3].rstrip("%")) / 100 * capacity, cfg.seed))
            for w in real
            if w.startswith(trace.name) and w.endswith("of capacity")
        ]:
            sim = simulate(load, model, meta["hardware"], cfg, None, profile=profile)
            q = compare_requests(real[wname], sim.requests)
            cost, _ = resolve_cost_model(
                None,
                spec,
                get_hardware(meta["hardware"]),
                profile,
                cfg.num_speculative_tokens,
                batch_invariant=cfg.batch_invariant,
                async_scheduling=cfg.async_scheduling,
            )
            samples = recorded_steps.get(wname, [])
            steps = step_errors(
                [
                    (x["kind"], x["shape"], x["wall_s"], x["execute_s"])
                    for x in samples
                    if "shape" in x
                ],
                cost,
                step_basis(cfg, meta["hardware"]),
            )
            on_device = [
                (x["kind"], x["shape"], x.get("device_s")) for x in samples if "shape" in x
            ]
            results.append({
                "workload": wname, "requests": q, "steps": steps,
                "steps_device": device_errors(on_device, cost),
            })  # fmt: skip
    print_tables(results)
    out.mkdir(parents=True, exist_ok=True)
    (out / "resimulated.json").write_text(json.dumps(results, indent=1, default=str) + "\n")
    return 0


def _log_path(folder: Path | None, workload: str) -> Path | None:
    """Where a workload's step log goes under `folder` (None: none is written)."""
    if folder is None:
        return None
    return folder / ("".join(c if c.isalnum() or c in "-_." else "_" for c in workload) + ".jsonl")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--model", default="moonlight-16b-a3b")
    p.add_argument("--device", default=None)
    p.add_argument("--dtype", default=None)
    p.add_argument("--hardware", default=None, help="simulator hardware (default: detected)")
    p.add_argument("--profile", type=Path, default=None, help="profile for the simulator")
    p.add_argument("--traces", default="azure_code_small.json,mooncake_conversation_small.jsonl")
    p.add_argument("--num-requests", type=int, default=200)
    p.add_argument("--rates", default="0.7,1.2", help="fractions of the offline capacity")
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
    add_engine_options(p)
    args = p.parse_args(argv)
    if args.real is not None:
        return resimulate(args.real, args.profile, args.out)
    cfg = engine_config_from_args(args)

    from executors.profile_env import hardware_name
    from executors.torch_executor import TorchExecutor

    load_format = "dummy" if args.model in known_models() else "auto"
    executor = TorchExecutor(
        cfg, args.model, device=args.device, dtype=args.dtype, load_format=load_format
    )
    hardware = args.hardware or hardware_name(executor.device)
    sim_model = args.model if args.model in known_models() else str(executor.model_dir)
    max_len = min(executor.max_model_len, executor.num_kv_blocks() * cfg.block_size)
    limit = args.max_prompt or max_len
    results = []
    for name in args.traces.split(","):
        trace = workloads(load_trace(ROOT / "traces" / name), limit, args.num_requests)
        first = run_workload(
            executor, cfg, offline(trace), sim_model, hardware, args.profile,
            executor.max_model_len, _log_path(args.step_log, f"{trace.name} offline"),
        )  # fmt: skip
        results.append(first)
        capacity = len(trace) / first["requests"]["real_makespan_s"]
        for frac in (float(x) for x in args.rates.split(",") if x):
            load = poisson(trace, frac * capacity, seed=cfg.seed)
            load.name = f"{trace.name} {frac:.0%} of capacity"
            results.append(
                run_workload(
                    executor,
                    cfg,
                    load,
                    sim_model,
                    hardware,
                    args.profile,
                    executor.max_model_len,
                    _log_path(args.step_log, load.name),
                )  # fmt: skip
            )
        print(f"{name}: capacity {capacity:.2f} req/s", flush=True)
    print_tables(results)
    args.out.mkdir(parents=True, exist_ok=True)
    plot(results, args.out / "fidelity.png")
    meta = {
        "model": args.model,
        "sim_model": sim_model,
        "max_prompt": limit,
        "num_requests": args.num_requests,
        "traces": args.traces,
        "hardware": hardware,
        "engine": {k: getattr(cfg, k) for k in cfg.field_names()} | {"role": cfg.role.value},
        "startup_s": executor.startup_seconds,
        "date": time.strftime("%Y-%m-%d %H:%M"),
    }
    (args.out / "fidelity.json").write_text(
        json.dumps(
            {
                "meta": meta,
                "workloads": [{k: v for k, v in r.items() if k[0] != "_"} for r in results],
            },
            indent=1,
            default=str,
        )
        + "\n"
    )
    # For analysis beside fidelity.json: every request record and both step logs.
    (args.out / "fidelity_records.json").write_text(
        json.dumps(
            [
                {"workload": r["workload"]} | r["_records"] | {"timelines": r["_timelines"]}
                for r in results
            ]
        )  # fmt: skip
        + "\n"
    )
    executor.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())
