"""`deepinfer sweep [TRACE] --grid FILE --slo SPEC`: per config, the highest rate meeting an SLO.

The work is in `sim.sweep`; this module only reads the command line and prints.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path
from typing import Any

from deepinfer.config import EngineConfig
from deepinfer.entrypoints.cli.engine_options import ENGINE_HELP

_SIM_FLAGS = ("model", "hardware", "cost_model", "acceptance_rate")
_RATE_FLAGS = {"rate_min": "min", "rate_max": "max", "rate_start": "start", "rate_tol": "rel_tol"}


def add_sweep_parser(sub: Any) -> None:
    p = sub.add_parser(
        "sweep",
        help="find, per engine config of a grid, the highest request rate meeting an SLO",
        description="For every config of a grid (engine knobs, model, hardware), find the "
        "highest Poisson request rate at which the trace's requests meet the SLO, by "
        "bisection on the rate; points run in parallel (local processes, or Ray with "
        "--ray). Writes configs.csv (ranked), points.csv, sweep.json and sweep.png to "
        "--out; a sweep started again on the same --out resumes. Exit code 2: bad input.",
        allow_abbrev=False,  # --rate would silently mean --rate-min, --max-num-seq --max-num-seqs
    )
    p.add_argument("trace", nargs="?", default=None, help="trace file (default: the bundled one)")
    p.add_argument("--format", default=None, help="force the trace format")
    p.add_argument("--max-requests", type=int, default=None, help="only the first N requests")
    p.add_argument("--grid", type=Path, default=None, help="YAML/JSON: knob -> list of values")
    p.add_argument(
        "--slo",
        required=True,
        help="e.g. ttft_p99:2000,tpot_p99:50 (ms; METRIC_STAT with stat mean|p50|p90|p99|max) "
        "or ttft:2000,tpot:50,goodput:0.9 (fraction of requests meeting per-request limits)",
    )
    p.add_argument("--workers", type=int, default=None, help="parallel points (default: all cores)")
    p.add_argument("--out", type=Path, default=Path("sweep-out"), help="results folder")
    p.add_argument(
        "--ray",
        nargs="?",
        const="auto",
        default=None,
        metavar="auto|local|ADDRESS",
        help="run points as Ray tasks: 'auto' joins the running cluster, 'local' starts Ray "
        "here, or a cluster address (needs `pip install deepinfer[sweep]`)",
    )
    p.add_argument(
        "--arrival-seed", type=int, default=0, help="seed of the Poisson arrivals (default 0)"
    )
    p.add_argument("--fresh", action="store_true", help="ignore results already in --out")
    p.add_argument("--no-plot", action="store_true", help="write no PNG")
    p.add_argument("--no-progress", action="store_true", help="hide the progress bar")
    rates = p.add_argument_group("rates (default: bisection from the trace's own rate)")
    rates.add_argument("--rates", default=None, help="fixed rates instead, e.g. 1,2,4,8")
    for flag, key in _RATE_FLAGS.items():
        rates.add_argument(
            "--" + flag.replace("_", "-"), dest=flag, default=None, help=f"rate.{key}"
        )
    rates.add_argument("--max-points", default=None, help="most rates simulated per config")
    grid = p.add_argument_group("grid knobs (comma-separated values; they override --grid)")
    for name in (*_SIM_FLAGS, *EngineConfig.field_names()):
        what = ENGINE_HELP.get(name, name.replace("_", " "))
        grid.add_argument(
            "--" + name.replace("_", "-"),
            dest=f"grid_{name}",
            default=None,
            metavar="V,...",
            help=what,
        )
    p.set_defaults(func=run_sweep_command)


def grid_from_args(args: argparse.Namespace) -> Any:
    from sim.sweep.grid import build_grid, check_value, load_grid_file

    raw: dict[str, Any] = dict(load_grid_file(args.grid)) if args.grid else {}
    for name in (*_SIM_FLAGS, *EngineConfig.field_names()):
        text = getattr(args, f"grid_{name}")
        if text is not None:
            flag = "--" + name.replace("_", "-")
            raw[name] = [check_value(name, v.strip(), flag) for v in text.split(",")]
    if args.rates is not None:
        raw["rate"] = [v.strip() for v in args.rates.split(",") if v.strip()]
    bounds = {key: getattr(args, flag) for flag, key in _RATE_FLAGS.items()}
    bounds["max_points"] = args.max_points
    given = {k: v for k, v in bounds.items() if v is not None}
    if given:
        if isinstance(raw.get("rate"), list):
            raise ValueError(
                "--rates (fixed rates) and rate bounds (--rate-min ...) exclude each other"
            )
        raw["rate"] = dict(raw.get("rate") or {}) | given
    base_dir = args.grid.parent if args.grid else None
    return build_grid(raw, str(args.grid) if args.grid else "grid", base_dir)


def run_sweep_command(args: argparse.Namespace) -> int:
    from tqdm import tqdm

    from deepinfer.entrypoints.cli.simulate import default_trace
    from sim.sweep import (
        ResultStore,
        SweepContext,
        parse_sweep_slo,
        run_sweep,
        sweep_header,
        write_outputs,
    )
    from sim.sweep.report import plot_pareto, plot_sweep, print_table
    from sim.traces import load_trace

    slo = parse_sweep_slo(args.slo)
    grid = grid_from_args(args)
    if args.workers is not None and args.workers < 1:
        raise ValueError(f"--workers {args.workers}: must be >= 1")
    path = Path(args.trace) if args.trace else default_trace()
    trace = load_trace(path, args.format, max_requests=args.max_requests)
    ctx = SweepContext(trace, slo, args.arrival_seed)
    header = sweep_header(ctx)
    store = ResultStore(args.out, header, fresh=args.fresh)
    store.load()  # a results file of another sweep is an error before any work starts
    workers = args.workers or os.cpu_count() or 1
    t0 = time.perf_counter()
    backend = _backend(ctx, workers, args.ray)
    with tqdm(
        desc="sweep", unit="point", file=sys.stderr, disable=args.no_progress or None, leave=False
    ) as bar:

        def progress(done: int, total: int) -> None:
            bar.total = total
            bar.n = done
            bar.refresh()

        try:
            outcome = run_sweep(grid, ctx, backend, store, progress)
        finally:
            backend.close()
    wall = time.perf_counter() - t0
    paths = write_outputs(args.out, header, outcome.configs, outcome.points)
    order = (
        "cost per million output tokens"
        if grid.configs and grid.configs[0].cluster
        else "max request rate"
    )
    title = f"{trace.name} ({len(trace)} requests), SLO {slo.text}: configs by {order}"
    print_table(outcome.configs, title)
    if not args.no_plot:
        paths["plot"] = args.out / "sweep.png"
        plot_sweep(paths["plot"], outcome.configs, outcome.points, slo)
        if any(c.get("gpus") is not None for c in outcome.configs):
            paths["pareto"] = args.out / "pareto.png"
            plot_pareto(paths["pareto"], outcome.configs)
    print(
        f"{len(outcome.configs)} configs, {outcome.num_simulated} points simulated "
        f"({outcome.num_resumed} from {store.path.name}) in {wall:.1f} s on "
        f"{backend.name} x {backend.workers}"
    )
    print("wrote " + ", ".join(str(p) for p in paths.values()))
    return 0


def _backend(ctx: Any, workers: int, ray: str | None) -> Any:
    from sim.sweep import make_backend

    if ray is None:
        return make_backend(ctx, workers, None)
    try:
        return make_backend(ctx, workers, ray)
    except ImportError:
        raise ValueError("--ray needs Ray: pip install 'deepinfer[sweep]'") from None
    except ConnectionError as e:
        raise ValueError(
            f"--ray {ray}: {e}; start one (`ray start --head`) or use --ray local"
        ) from None
