"""`deepinfer simulate TRACE`: replay a trace in the simulator and report."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

from deepinfer.entrypoints.cli.engine_options import add_engine_options, engine_config_from_args


def add_simulate_parser(sub: Any) -> None:
    p = sub.add_parser(
        "simulate",
        help="replay a request trace through the scheduler in simulated time",
        description="Replay a request trace through the deepinfer scheduler with a simulated "
        "executor and a cost model (profiled where a profile exists, else analytic); print a summary, optionally write a JSON report "
        "and PNG plots. Exit code 2: bad input; 3: the engine stalled.",
    )
    p.add_argument(
        "trace",
        nargs="?",
        default=None,
        help="trace file: native JSON/JSONL, Azure CSV, Mooncake JSONL, BurstGPT CSV "
        "or Vidur CSV (default: the bundled traces/azure_code_small.json)",
    )
    p.add_argument(
        "--format",
        choices=["native", "azure", "mooncake", "burstgpt", "vidur"],
        default=None,
        help="force the trace format (default: detected from content)",
    )
    p.add_argument(
        "--model",
        default="moonlight-16b-a3b",
        help="preset (moonlight-16b-a3b, deepseek-v2-lite, deepseek-v3) or a path to "
        "an HF config.json (default: %(default)s)",
    )
    p.add_argument(
        "--add-mtp-layer",
        action="store_true",
        help="give the model one MTP layer in its own shapes where it ships none, so that "
        "--num-speculative-tokens can draft (as `deepinfer profile --add-mtp-layer` measures it)",
    )
    p.add_argument(
        "--hardware", default="h200", help="GPU: h200, h100, h800 or b200 (default: %(default)s)"
    )
    p.add_argument(
        "--cost-model",
        choices=["profiled", "analytic", "unit"],
        default=None,
        help="profiled (measured steps of the real executor; the default where a profile "
        "of the model on the hardware is shipped), analytic (FLOPs and bytes, uncalibrated; "
        "the default elsewhere) or unit (1 ms a step)",
    )
    p.add_argument(
        "--profile",
        type=Path,
        default=None,
        help="a profile JSON from `deepinfer profile` (implies --cost-model profiled)",
    )
    p.add_argument(
        "--time-scale",
        type=float,
        default=1.0,
        help="multiply arrival times (0.5 replays twice as fast)",
    )
    p.add_argument(
        "--request-rate",
        type=float,
        default=None,
        metavar="R",
        help="replace the trace's arrival times with a Poisson process of R requests/s "
        "seeded by --seed, keeping its sizes (inf: all at time 0, an offline batch)",
    )
    p.add_argument(
        "--max-requests",
        "--num-requests",
        dest="max_requests",
        type=int,
        default=None,
        help="take only the first N requests",
    )
    p.add_argument(
        "--start", type=float, default=None, help="keep requests arriving at or after START seconds"
    )
    p.add_argument(
        "--end", type=float, default=None, help="keep requests arriving before END seconds"
    )
    p.add_argument("--slo", default=None, help="goodput SLOs in ms, e.g. ttft:2000,tpot:100")
    p.add_argument(
        "--acceptance-rate",
        type=_acceptance,
        default=None,
        help="draft acceptance when speculating (--num-speculative-tokens): one probability "
        "for every draft position, or an acceptance file (path, or a name under "
        "sim/data/acceptance/) written by `deepinfer measure-acceptance` (default: 0.7)",
    )
    p.add_argument(
        "--out", type=Path, default=None, help="write a JSON report with per-request records"
    )
    p.add_argument(
        "--plot",
        type=Path,
        default=None,
        help="write PNG plots (TTFT/TPOT CDFs, KV usage, queues, batch tokens)",
    )
    p.add_argument(
        "--step-log",
        type=Path,
        default=None,
        metavar="PATH",
        help="write every step (its shape, the cost model's host and device time) to this "
        "step log, the format a real run's --step-log writes (`deepinfer profile --from-log` "
        "fits a profile from it); every step then runs on its own (no fast-forward)",
    )
    p.add_argument(
        "--check-invariants",
        action="store_true",
        help="check scheduler invariants after every step (slow)",
    )
    p.add_argument(
        "--structured",
        action="store_true",
        help="treat every request as structured output (so_args): price its token masks",
    )
    p.add_argument(
        "--grammar-mask-us",
        type=float,
        default=None,
        help="host microseconds to fill one structured request's token mask (default: the "
        "cost model's cpu_grammar_mask_per_token_s)",
    )
    p.add_argument(
        "--no-fast-forward",
        dest="fast_forward",
        action="store_false",
        help="run every engine step one by one instead of advancing proven decode runs "
        "at once (the results are the same to the bit; for timing single steps)",
    )
    p.add_argument(
        "--cluster",
        type=Path,
        default=None,
        help="simulate a cluster described in YAML or JSON (pools of instances, routers, "
        "links, GPU prices; see examples/clusters/); the engine options are each pool's "
        "defaults",
    )
    p.add_argument(
        "--replicas",
        type=int,
        default=None,
        metavar="N",
        help="simulate N colocated instances of the engine behind --router",
    )
    p.add_argument(
        "--router",
        default=None,
        help="with --replicas: round-robin, least-requests (default), least-kv, "
        "power-of-two, prefix-affinity or least-load",
    )
    p.add_argument(
        "--bands",
        type=int,
        default=None,
        metavar="N",
        help="also give each headline figure a 95%% band: N replicates with step prices "
        "drawn from the profile's held-out errors (per step kind, once a replicate) and "
        "its steps' measured spread (each step), and with --request-rate the arrivals "
        "drawn again; seeded by --seed (default: off, the run is exact)",
    )
    p.add_argument("--no-progress", action="store_true", help="hide the progress bar")
    add_engine_options(p)
    p.set_defaults(func=run_simulate)


def _model(name: str, add_mtp_layer: bool, num_speculative_tokens: int) -> Any:
    """The model to simulate: its name, or with --add-mtp-layer its config with one MTP
    layer (refused where it would change nothing)."""
    if not add_mtp_layer:
        return name
    from deepinfer.model_config import load_model_config

    if not num_speculative_tokens:
        raise ValueError("--add-mtp-layer: only with --num-speculative-tokens > 0")
    spec = load_model_config(name)
    if spec.num_nextn_predict_layers:
        raise ValueError(
            f"--add-mtp-layer: {spec.name} ships {spec.num_nextn_predict_layers} MTP "
            "layer(s) already; drop the flag"
        )
    return spec.replace(num_nextn_predict_layers=1)


def _acceptance(text: str) -> float | str:
    try:
        return float(text)
    except ValueError:
        return text


def run_simulate(args: argparse.Namespace) -> int:

    from deepinfer.metrics import parse_slo
    from sim.report import plot_report, print_summary, write_report
    from sim.simulator import simulate
    from sim.traces import load_trace

    path = Path(args.trace) if args.trace else default_trace()
    trace = load_trace(
        path,
        args.format,
        time_scale=args.time_scale,
        max_requests=args.max_requests,
        start=args.start,
        end=args.end,
    )
    if args.structured:
        trace = trace.with_all_structured()
    engine = engine_config_from_args(args)
    sized = trace
    if args.request_rate is not None:
        trace = retime(trace, args.request_rate, engine.seed, args.time_scale)
    slo = parse_slo(args.slo) if args.slo else None
    mask_us = args.grammar_mask_us
    # Options that cannot apply are refused, not accepted and ignored.
    cluster = _cluster(args, engine)
    engines = [p.engine for p in cluster.pools] if cluster is not None else [engine]
    if args.acceptance_rate is not None and not any(e.num_speculative_tokens for e in engines):
        raise ValueError(
            "--acceptance-rate: the engine does not speculate (add --num-speculative-tokens)"
        )
    if mask_us is not None and not any(r.structured for r in trace.requests):
        raise ValueError(
            f"--grammar-mask-us: no request of {path} is structured (add --structured, or "
            "so_args / structured in the trace)"
        )
    model = _model(args.model, args.add_mtp_layer, engine.num_speculative_tokens)
    acceptance = 0.7 if args.acceptance_rate is None else args.acceptance_rate
    if cluster is not None:
        if (
            args.add_mtp_layer or args.structured or mask_us is not None or args.step_log
            or args.bands is not None
        ):  # fmt: skip
            raise ValueError(
                "--add-mtp-layer, --structured, --grammar-mask-us, --step-log and --bands "
                "apply to one engine; a cluster simulates none of them"
            )
        return _run_cluster(args, trace, path, cluster, slo, acceptance)
    if args.bands is not None and args.bands < 1:
        raise ValueError(f"--bands {args.bands}: the replicates, at least 1")
    options = {
        "slo": slo,
        "acceptance_rate": acceptance,
        "check_invariants": args.check_invariants,
        "grammar_mask_per_token_s": None if mask_us is None else mask_us * 1e-6,
        "fast_forward": args.fast_forward,
    }
    with _progress_bar(args, len(trace)) as bar:
        result = simulate(
            trace,
            model,
            args.hardware,
            engine,
            args.cost_model,
            profile=args.profile,
            on_progress=bar.update,
            step_log=args.step_log,
            **options,
        )
    meta = dict(result.meta, trace_path=str(path))
    bands = None
    if args.bands is not None:
        bands = _bands(args, sized, trace, model, engine, result, options)
        meta["bands"] = bands.to_dict()
    title = f"{trace.name}: {meta['model']} on {meta['hardware']}"
    print_summary(result.summary, title)
    print(
        f"KV cache: {meta['num_gpu_blocks']} blocks of {engine.block_size} tokens; "
        f"max_model_len {meta['max_model_len']}; {meta['num_steps']} steps"
    )
    print(_cost_model_line(meta))
    if meta.get("kv_tiers", {}).get("tiers"):
        from sim.kv_tiers import tiers_line

        print(f"KV tiers: {tiers_line(meta['kv_tiers'])}")
    if engine.data_parallel_size > 1:
        print(_data_parallel_line(meta, engine.data_parallel_size, engine.enable_expert_parallel))
    if bands is not None:
        print("\n".join(bands.lines()))
    if args.out:
        write_report(args.out, result.summary, result.requests, result.steps, meta)
        print(f"report: {args.out}")
    if args.step_log:
        print(f"step log: {args.step_log}")
    if args.plot:
        plot_report(args.plot, result.requests, result.steps, title)
        print(f"plots: {args.plot}")
    return 0


def _bands(
    args: argparse.Namespace,
    sized: Any,
    trace: Any,
    model: Any,
    engine: Any,
    result: Any,
    options: dict[str, Any],
) -> Any:
    """--bands N: the replicates of the run (sim/bands.py); under --request-rate each
    re-timed with a seed of its own (`sized`: the requests before re-timing)."""
    from tqdm import tqdm

    from sim.bands import simulate_bands

    workload = None
    rate = args.request_rate
    if rate is not None and rate != float("inf"):

        def workload(i: int) -> Any:
            return retime(sized, rate, engine.seed + 1 + i, args.time_scale)

    with tqdm(
        total=args.bands, desc="bands", unit="run", file=sys.stderr,
        disable=args.no_progress or None, leave=False,
    ) as bar:  # fmt: skip
        return simulate_bands(
            trace, model, args.hardware, engine, result, replicates=args.bands,
            seed=engine.seed, cost_model=args.cost_model, profile=args.profile,
            workload=workload, on_replicate=lambda: bar.update(1), **options,
        )  # fmt: skip


def _progress_bar(args: argparse.Namespace, total: int) -> Any:
    """The requests-done bar on stderr (hidden by --no-progress)."""
    from tqdm import tqdm

    return tqdm(
        total=total,
        desc="simulating",
        unit="req",
        file=sys.stderr,
        disable=args.no_progress or None,
        leave=False,
    )


def _cluster(args: argparse.Namespace, engine: Any) -> Any:
    """The cluster to simulate (--cluster, or --replicas with --router), or None.

    sim.cluster is imported only where there is one: a run of one engine needs none of it."""
    if args.cluster is not None:
        if args.replicas is not None or args.router is not None:
            raise ValueError("--replicas / --router: the cluster file gives its pools and router")
        from sim.cluster import load_cluster

        return load_cluster(args.cluster, base_engine=engine, hardware=args.hardware)
    if args.replicas is None:
        if args.router is not None:
            raise ValueError(
                "--router: routes over --replicas N (for data-parallel ranks: "
                "--data-parallel-router)"
            )
        return None
    if args.replicas < 1:
        raise ValueError(f"--replicas {args.replicas}: must be >= 1")
    from sim.cluster import replicas
    from sim.cluster.description import _router

    router = _router(args.router or "least-requests", "--router")
    return replicas(args.replicas, engine, args.model, args.hardware, router)


def _run_cluster(
    args: argparse.Namespace, trace: Any, path: Path, cluster: Any, slo: Any, acceptance: Any
) -> int:

    from deepinfer.step_log import MergedSteps
    from sim.cluster import simulate_cluster
    from sim.report import plot_report, print_summary, write_report

    with _progress_bar(args, len(trace)) as bar:
        result = simulate_cluster(
            trace,
            cluster,
            args.cost_model,
            profile=args.profile,
            slo=slo,
            acceptance_rate=acceptance,
            check_invariants=args.check_invariants,
            on_progress=bar.update,
            fast_forward=args.fast_forward,
        )
    meta = dict(result.meta, trace_path=str(path))
    title = f"{trace.name}: {cluster.model} on a cluster of {cluster.num_instances} instances"
    print_summary(result.summary, title)
    for line in cluster_lines(meta):
        print(line)
    if not (args.out or args.plot):
        return 0
    steps = MergedSteps(result.steps.values())
    if args.out:
        write_report(args.out, result.summary, result.requests, steps, meta)
        print(f"report: {args.out}")
    if args.plot:
        plot_report(args.plot, result.requests, steps, title)
        print(f"plots: {args.plot}")
    return 0


def cluster_lines(meta: dict[str, Any]) -> list[str]:
    """What the summary says of a cluster beyond one engine's table."""
    pools = ", ".join(
        f"{p['name']}: {p['count']} x {p['role']} on {p['hardware']} ({p['num_gpu_blocks']} "
        f"KV blocks each, {p.get('cost_model', '?')} cost model)"
        for p in meta["pools"]
    )
    lines = [f"pools: {pools}", f"router: {meta['router']['policy']}"]
    if "decode_router" in meta:
        lines[-1] += f"; decode router: {meta['decode_router']['policy']}"
    per = [i["requests"] for i in meta["instances"] if i["role"] != "decode"]
    lines.append(f"requests per instance: {min(per)}-{max(per)} ({meta['num_steps']} steps)")
    pd = meta.get("disaggregation")
    if pd:

        def ms(d: dict[str, Any]) -> str:
            return (
                "n/a"
                if d["p50"] is None
                else f"p50 {d['p50'] * 1e3:.1f} / p99 {d['p99'] * 1e3:.1f} ms"
            )

        lines.append(
            f"disaggregation: {pd['handovers']} KV handovers, {pd['kv_bytes_moved'] / 1e9:.2f} GB "
            f"of KV moved; prefill queue {ms(pd['prefill_queue_s'])}; decode blocks "
            f"reserved after {ms(pd['decode_reservation_s'])}; KV transfer "
            f"{ms(pd['kv_transfer_s'])}; decode queue {ms(pd['decode_queue_s'])}"
        )
    if "kv_tiers" in meta:
        from sim.kv_tiers import tiers_line

        lines.append(f"KV tiers: {tiers_line(meta['kv_tiers'])}")
    c = meta["cost"]
    per_out = c["per_million_output_tokens"]
    per_in = c["per_million_input_tokens"]
    lines.append(
        f"cost: {c['gpus']} GPUs, {c['gpu_hours']:.3f} GPU-hours, ${c['dollars']:.2f}; "
        + (
            f"${per_out:.3f} per million output tokens, ${per_in:.4f} per million input "
            f"tokens ({c['counted']})"
            if per_out is not None and per_in is not None
            else "no tokens counted"
        )
    )
    return lines


def _data_parallel_line(meta: dict[str, Any], ranks: int, expert_parallel: bool) -> str:
    line = (
        f"data parallel: {ranks} ranks{' with expert parallelism' if expert_parallel else ''}"
        f" (KV blocks per rank); requests per rank {meta['dp_requests_per_rank']}; "
        f"stragglers {meta['straggler_seconds']:.3f} s"
    )
    if expert_parallel:
        imb = meta["expert_load_max_over_mean"]
        line += f"; all-to-all {meta['all_to_all_seconds']:.3f} s (datasheet link, uncalibrated)"
        if imb is not None:
            line += f"; busiest rank's expert load {imb:.2f}x the mean"
        if meta.get("dp_draft_passes"):  # speculation: MTP passes in lock-step
            passes = meta["dp_draft_passes"]
            line += (
                f"; MTP passes in lock-step: {passes} a rank, "
                f"{meta['dp_padded_draft_passes']} of the {passes * ranks} padded"
            )
    return line


def retime(trace: Any, rate: float, seed: int, time_scale: float) -> Any:
    """The trace's requests (after --max-requests, --start, --end) at new arrivals."""
    from sim.traces.retime import offline, poisson

    if time_scale != 1.0:
        raise ValueError(
            "--request-rate replaces the trace's arrival times, so --time-scale "
            f"({time_scale}) would have nothing to scale: give one of them"
        )
    if rate == float("inf"):
        return offline(trace)
    try:
        return poisson(trace, rate, seed)
    except ValueError as e:
        raise ValueError(f"--request-rate {rate}: {e}") from None


def default_trace() -> Path:
    """The bundled trace `deepinfer simulate` runs when given none."""
    return Path(__file__).resolve().parents[3] / "traces" / "azure_code_small.json"


def _cost_model_line(meta: dict[str, Any]) -> str:
    name = meta.get("cost_model", "?")
    if meta.get("profile"):
        line = f"cost model: {name}, calibrated on {Path(meta['profile']).name}"
        if meta.get("verify_steps") == "analytic":
            line += " (verify steps and the drafter: uncalibrated, the profile has none)"
        return line
    if not meta.get("calibrated"):
        return (
            f"cost model: {name} (uncalibrated: no profile of {meta['model']} on "
            f"{meta['hardware']}; `deepinfer profile` measures one)"
        )
    return f"cost model: {name}"
