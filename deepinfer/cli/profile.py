"""`deepinfer profile --model NAME --out PROFILE.json`: measure the real executor's steps.

Writes the profile the simulator's profiled cost model fits (sim/data/profiles/ holds
the shipped ones): start-up, a grid of whole steps (decode, prefill, mixed, many short
prompts) with median and spread, and the core's host time per step.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

from deepinfer.cli.engine_options import add_engine_options, engine_config_from_args

PROFILE_VERSION = 1


def add_profile_parser(sub: Any) -> None:
    p = sub.add_parser(
        "profile",
        help="measure the real executor's step times for the simulator (needs the torch extra)",
        description="Run the real executor over a grid of whole engine steps and write the "
        "profile that `deepinfer simulate` fits (cost model 'profiled').",
    )
    p.add_argument(
        "--model",
        default="moonlight-16b-a3b",
        help="preset (random weights in its shapes), checkpoint directory, or "
        "hub id (default: %(default)s)",
    )
    p.add_argument("--out", type=Path, required=True, help="profile JSON to write")
    p.add_argument("--device", default=None, help="cpu or cuda (default: detected)")
    p.add_argument("--dtype", default=None, help="float32, bfloat16 or float16")
    p.add_argument(
        "--load-format",
        default=None,
        choices=["auto", "dummy"],
        help="dummy: random weights (default for presets, else auto)",
    )
    p.add_argument("--reps", type=int, default=5, help="timed runs of each grid point")
    p.add_argument("--quick", action="store_true", help="a small grid (tests, smoke runs)")
    p.add_argument("--enforce-eager", action="store_true", help="no CUDA graphs")
    add_engine_options(p)
    p.set_defaults(func=run_profile)


def run_profile(args: argparse.Namespace) -> int:
    from tqdm import tqdm

    from deepinfer.engine import EngineCore
    from deepinfer.executor import get_executor_class
    from deepinfer.model_config import known_models
    from executors.profiler import default_grid, environment, profile_host, profile_steps

    if args.reps < 1:
        raise ValueError(f"--reps {args.reps}: must be >= 1")
    cfg = engine_config_from_args(args)
    load_format = args.load_format or ("dummy" if args.model in known_models() else "auto")
    executor = get_executor_class("torch")(
        cfg, args.model, dtype=args.dtype, device=args.device, load_format=load_format,
        enforce_eager=args.enforce_eager,
    )  # fmt: skip
    engine = EngineCore(cfg, executor, model_max_len=executor.max_model_len)
    max_len = engine.scheduler.max_model_len
    capacity = executor.num_kv_blocks() * cfg.block_size
    grid = default_grid(
        cfg.max_num_batched_tokens, cfg.max_num_seqs, max_len, capacity, quick=args.quick
    )
    with tqdm(total=len(grid), desc="profiling", unit="step", file=sys.stderr) as bar:
        points = profile_steps(
            executor, grid, reps=args.reps, seed=cfg.seed, on_point=lambda _: bar.update(1)
        )
    host = profile_host(engine, num_requests=24 if args.quick else 96, seed=cfg.seed)
    warm = executor.warmup
    profile = {
        "version": PROFILE_VERSION,
        "model": executor.config.name if args.model not in known_models() else args.model,
        "meta": {
            **environment(executor),
            "dtype": str(executor.dtype).removeprefix("torch."),
            "load_format": load_format,
            "cuda_graphs": executor.runner.graphs is not None,
            # Batch-invariant kernels are slower: the simulator prices each mode only with
            # a profile measured in it (sim/cost_model.py check_mode).
            "batch_invariant": cfg.batch_invariant,
            # Steps up to this many tokens replay piecewise graphs; larger ones run eagerly.
            "piecewise_max_tokens": pw.max_size if (pw := executor.runner.piecewise) else 0,
            "engine": {
                "block_size": cfg.block_size,
                "max_num_seqs": cfg.max_num_seqs,
                "max_num_batched_tokens": cfg.max_num_batched_tokens,
                "num_gpu_blocks": executor.num_kv_blocks(),
                "max_model_len": max_len,
            },
        },
        "startup": {
            "seconds": executor.startup_seconds,
            "warmup_seconds": warm.seconds if warm else 0.0,
            "warmup_compiled": warm.num_compiled if warm else 0,
        },
        "points": points,
        "host": host,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(profile, indent=1) + "\n")
    late = sum(p["compiled"] for p in points)
    print(
        f"profile: {len(points)} steps, {len(host)} host samples, start-up "
        f"{executor.startup_seconds:.1f} s, {late} kernel compiles after start-up -> {args.out}"
    )
    executor.shutdown()
    return 0
