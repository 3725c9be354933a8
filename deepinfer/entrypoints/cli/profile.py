"""`deepinfer profile --model NAME --out PROFILE.json`: measure the real executor's steps
(`deepinfer profile install PROFILE.json` then puts one among the shipped profiles:
`profile_install.py`; `deepinfer profile --from-log LOG...` fits one from runs' step logs
instead: `profile_from_log.py`; `deepinfer profile --check-grid PROFILE` prices each of
its points by the fit of the others: `profile_check_grid.py`).

Writes the profile the simulator's profiled cost model fits (sim/data/profiles/ holds
the shipped ones): start-up, a grid of whole steps (decode, prefill, mixed, many short
prompts) with median and spread, and the core's host time per step. With
`--num-speculative-tokens K` the engine speculates, and the profile adds the steps of a
speculating engine: verify steps (1 + k tokens a request, k = 1..K), decode steps and
prompt chunks, each followed by the MTP drafter's proposal of K drafts (timed apart as
`draft_s`); the grid above is then measured with the drafter detached, as a
non-speculating engine runs it. `--add-mtp-layer` gives a model that ships no MTP layer
one in its own shapes (dummy weights only; recorded in the profile's meta).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

from deepinfer.entrypoints.cli.engine_options import add_engine_options, engine_config_from_args
from deepinfer.entrypoints.cli.profile_check_grid import (
    add_check_grid_options,
    check_grid_args,
    run_check_grid,
)
from deepinfer.entrypoints.cli.profile_from_log import (
    add_from_log_options,
    check_from_log_args,
    run_from_log,
)
from deepinfer.entrypoints.cli.profile_install import add_install_parser

PROFILE_VERSION = 1
DEFAULT_MODEL = "moonlight-16b-a3b"


def add_profile_parser(sub: Any) -> None:
    p = sub.add_parser(
        "profile",
        help="measure the real executor's step times for the simulator (needs the torch "
        "extra), or install a measured profile",
        usage="deepinfer profile --out PROFILE.json [--model NAME] [options]\n"
        "       deepinfer profile --from-log LOG [LOG ...] --out PROFILE.json "
        "[--base PROFILE.json]\n"
        "       deepinfer profile --check-grid PROFILE.json [--folds K]\n"
        "       deepinfer profile install PROFILE.json [--commit HASH] [--dry-run]",
        description="Run the real executor over a grid of whole engine steps and write the "
        "profile that `deepinfer simulate` fits (cost model 'profiled'), or, with --from-log, "
        "fit one from the step logs of served or replayed runs (their --step-log). "
        "`deepinfer profile install PROFILE.json` compares such a profile with the shipped "
        "one of its name, step kind by step kind, then replaces it (`install --help`).",
    )
    p.add_argument(
        "--model",
        default=None,
        help="preset (random weights in its shapes), checkpoint directory, or "
        f"hub id (default: {DEFAULT_MODEL}; with --from-log: the logs' own)",
    )
    p.add_argument("--out", type=Path, help="profile JSON to write (required to measure)")
    p.add_argument("--device", default=None, help="cpu or cuda (default: detected)")
    p.add_argument("--dtype", default=None, help="float32, bfloat16 or float16")
    p.add_argument(
        "--load-format",
        default=None,
        choices=["auto", "dummy"],
        help="dummy: random weights (default for presets, else auto)",
    )
    p.add_argument("--reps", type=int, default=5, help="timed runs of each grid point")
    p.add_argument(
        "--rounds",
        type=int,
        default=1,
        help="passes over the grid, each with --reps runs of every point (on a shared "
        "machine a burst of load then hits one round of a point, not all its runs)",
    )
    p.add_argument("--quick", action="store_true", help="a small grid (tests, smoke runs)")
    p.add_argument("--enforce-eager", action="store_true", help="no CUDA graphs")
    p.add_argument(
        "--add-mtp-layer",
        action="store_true",
        help="give the model one MTP layer in its own shapes where it has none, so that "
        "--num-speculative-tokens can profile verify steps (dummy weights only)",
    )
    add_engine_options(p)
    add_from_log_options(p)
    add_check_grid_options(p)
    p.set_defaults(func=run_profile)
    add_install_parser(p.add_subparsers(dest="profile_action", title="install a profile"))


def run_profile(args: argparse.Namespace) -> int:
    check_grid_args(args)
    if args.check_grid is not None:  # (no torch needed: the simulator's fit)
        return run_check_grid(args)
    check_from_log_args(args)
    if args.from_log is not None:  # (no torch needed: the simulator's fit)
        return run_from_log(args, args.model)
    import tempfile

    from tqdm import tqdm

    from deepinfer.engine import EngineCore
    from deepinfer.entrypoints.executor_registry import get_executor_class
    from deepinfer.model_config import known_models, write_config_with_mtp_layer
    from executors.profile_env import executor_meta
    from executors.profile_grid import GridLimits, default_grid, run_slack, speculative_grid
    from executors.profiler import drafter_detached, profile_host, profile_steps

    if args.out is None:
        raise ValueError("profile: --out PROFILE.json is required to measure")
    if args.reps < 1 or args.rounds < 1:
        raise ValueError(f"--reps {args.reps}, --rounds {args.rounds}: each must be >= 1")
    _refuse_scheduling_options(args)
    cfg = engine_config_from_args(args)
    k = cfg.num_speculative_tokens
    args.model = args.model or DEFAULT_MODEL
    load_format = args.load_format or ("dummy" if args.model in known_models() else "auto")
    model = args.model
    if args.add_mtp_layer:
        if not k:
            raise ValueError("--add-mtp-layer: only with --num-speculative-tokens > 0")
        if load_format != "dummy":
            raise ValueError(
                f"--add-mtp-layer: the checkpoint of {args.model} has no MTP weights; the "
                "added layer needs --load-format dummy"
            )
        model = str(write_config_with_mtp_layer(args.model, tempfile.mkdtemp(prefix="profile-")))
    else:
        _check_has_mtp(args.model, k)
    executor = get_executor_class("torch")(
        cfg, model, dtype=args.dtype, device=args.device, load_format=load_format,
        enforce_eager=args.enforce_eager,
    )  # fmt: skip
    engine = EngineCore(cfg, executor, model_max_len=executor.max_model_len)
    max_len = engine.scheduler.max_model_len
    capacity = executor.num_kv_blocks() * cfg.block_size
    limits = GridLimits(
        cfg.max_num_batched_tokens, cfg.max_num_seqs, max_len, capacity,
        slack=run_slack(1 + k, k, args.reps),
    )  # fmt: skip
    grid = default_grid(limits, quick=args.quick)
    if k:
        grid += speculative_grid(k, limits, quick=args.quick)
    with tqdm(total=len(grid), desc="profiling", unit="step", file=sys.stderr) as bar:
        points = profile_steps(
            executor, grid, reps=args.reps, seed=cfg.seed, on_point=lambda _: bar.update(1),
            rounds=args.rounds,
        )  # fmt: skip
    with drafter_detached(executor.runner):  # the core's host work of a plain engine
        host = profile_host(
            engine, num_requests=24 if args.quick else 96, seed=cfg.seed,
            decode_batch=min(cfg.max_num_seqs, 32 if args.quick else 512),
        )  # fmt: skip
    warm = executor.warmup
    profile = {
        "version": PROFILE_VERSION,
        "model": executor.config.name if args.model not in known_models() else args.model,
        "meta": {
            **executor_meta(executor, cfg),
            "load_format": load_format,
            # Drafts the MTP drafter proposes after each step of the speculative points.
            "num_speculative_tokens": k,
            # The model shipped no MTP layer: one in its shapes was added (dummy weights).
            "mtp_layer_added": bool(args.add_mtp_layer),
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
    verify = sum(p["kind"] == "verify" for p in points)
    print(
        f"profile: {len(points)} steps ({verify} verify), {len(host)} host samples, start-up "
        f"{executor.startup_seconds:.1f} s, {late} kernel compiles after start-up -> {args.out}"
    )
    executor.shutdown()
    return 0


def _check_has_mtp(model: str, k: int) -> None:
    """Speculation drafts with the model's MTP layer: say how to add one where a local
    config has none (the executor checks hub models itself)."""
    from deepinfer.model_config import load_model_config

    if not k:
        return
    try:
        cfg = load_model_config(model)
    except ValueError:
        return
    if not cfg.num_nextn_predict_layers:
        raise ValueError(
            f"--num-speculative-tokens {k}: {cfg.name} has no MTP layer to draft with "
            "(num_nextn_predict_layers=0); add --add-mtp-layer to profile one in its "
            "shapes with dummy weights"
        )


# Engine options that shape scheduling only. The profile prices steps it times on their
# own and pipelined, outside any scheduler: given to it, these would only reorder its
# host-time sample, and a user would take the profile as measured for them. The
# simulator takes them when it replays a trace with the profile.
_SCHEDULING_ONLY = {
    "async_scheduling": "the profile times every step both one at a time and pipelined; "
    "`deepinfer simulate --async-scheduling` chooses which of the two it prices",
    "policy": "the profile times steps outside any queue; pass it to `deepinfer simulate`",
    "prefill_watermark": "the profile times steps outside any scheduler; pass it to "
    "`deepinfer simulate`",
    "enable_chunked_prefill": "the profile times prompt steps of each size, chunks or not; "
    "pass it to `deepinfer simulate`",
}


def _refuse_scheduling_options(args: argparse.Namespace) -> None:
    for name, why in _SCHEDULING_ONLY.items():
        if getattr(args, f"engine_{name}") is not None:
            raise ValueError(f"--{name.replace('_', '-')}: {why}")
    role = args.engine_role
    if role is not None and role != "normal":
        raise ValueError(
            f"--role: the profile measures an engine in the normal role (its host sample "
            f"needs decode steps); {role!r} is a choice for `deepinfer simulate`"
        )
