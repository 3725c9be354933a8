"""`deepinfer profile --from-log LOG [LOG...] --out PROFILE.json [--base PROFILE.json]`:
a profile fitted from step logs alone, no grid run (sim/profile_from_log.py), or a grid
profile refined by them; says which step kinds the logs did not cover.

A run writes its step log with `--step-log PATH` (`deepinfer generate`, `deepinfer
serve`, `deepinfer simulate`, `deepinfer bench fidelity`; `LLM(..., step_log=PATH)`).
`--held-out F` also fits on the first 1 - F of each log and prints how the fit predicts
the rest, by step kind; `--check LOG...` predicts other runs' steps; `--compare
PROFILE` prints another profile's errors on the same steps beside.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

# The flags of a measuring run: they mean nothing to a fit from logs (None: not given).
_MEASURING = ("device", "dtype", "load_format", "add_mtp_layer", "enforce_eager", "quick")


def add_from_log_options(p: argparse.ArgumentParser) -> None:
    group = p.add_argument_group("fit from step logs (no grid run)")
    group.add_argument(
        "--from-log",
        nargs="+",
        type=Path,
        metavar="LOG",
        help="fit the profile from these step logs (written by a run's --step-log PATH) "
        "instead of measuring a grid; --model names the model where the logs' header "
        "cannot (its config moved)",
    )
    group.add_argument(
        "--base",
        type=Path,
        metavar="PROFILE",
        help="with --from-log: refine this profile: logged steps replace its points of "
        "the same cells and add the others; without it the logs must cover every step "
        "kind the cost model needs",
    )
    group.add_argument(
        "--held-out",
        type=float,
        metavar="F",
        help="with --from-log: also fit on the first 1 - F of each log's steps and print "
        "the errors on the rest by step kind",
    )
    group.add_argument(
        "--check",
        nargs="+",
        type=Path,
        metavar="LOG",
        help="with --from-log: print the fitted profile's errors on these runs' steps",
    )
    group.add_argument(
        "--compare",
        type=Path,
        metavar="PROFILE",
        help="with --held-out or --check: print this profile's errors beside",
    )


def measuring_flags(args: argparse.Namespace) -> str:
    """The options of a measuring run given (a run's engine options among them), as
    flags: a command that measures nothing refuses them ("" where none is given)."""
    measuring = [n for n in _MEASURING if getattr(args, n) not in (None, False)]
    engine = [k for k, v in vars(args).items() if k.startswith("engine_") and v is not None]
    if args.reps != 5 or args.rounds != 1:
        measuring.append("reps" if args.reps != 5 else "rounds")
    names = measuring + [k.removeprefix("engine_") for k in engine]
    return ", ".join("--" + n.replace("_", "-") for n in names)


def check_from_log_args(args: argparse.Namespace) -> None:
    """Refuse what a fit from logs does not take, or its options without --from-log."""
    if args.from_log is None:
        given = [n for n in ("base", "held_out", "check", "compare") if getattr(args, n)]
        if given:
            flags = ", ".join("--" + n.replace("_", "-") for n in given)
            raise ValueError(f"{flags}: only with --from-log LOG")
        return
    if args.out is None:
        raise ValueError("profile --from-log: --out PROFILE.json is required")
    flags = measuring_flags(args)
    if flags:
        raise ValueError(
            f"{flags}: options of a measuring run; --from-log fits the steps its logs hold, "
            "with the engine options their runs had"
        )
    if args.compare is not None and args.held_out is None and args.check is None:
        raise ValueError("--compare: with --held-out F or --check LOG (the steps to compare on)")


def run_from_log(args: argparse.Namespace, model: str | None) -> int:
    from deepinfer.model_config import load_model_config
    from sim.log_check import split_logs
    from sim.profile_from_log import fit_from_logs, load_logs
    from sim.profiled_cost_model import load_profile

    logs = load_logs(args.from_log)
    logged_name = logs[0].header["model"]
    logged = None
    try:
        logged = load_model_config(logged_name)
    except (ValueError, OSError) as e:
        if model is None:
            raise ValueError(
                f"{logs[0].path}: its model {logged_name!r} does not load here ({e}); "
                "name it with --model"
            ) from e
    spec = load_model_config(model) if model is not None else logged
    assert spec is not None
    if logged is not None and logged.name != spec.name:
        raise ValueError(
            f"--model {model}: {logs[0].path} was written by {logged_name!r} "
            f"({logged.name}), a different model"
        )
    base = load_profile(args.base) if args.base is not None else None
    fit = fit_from_logs(logs, spec, base)
    profile = fit.profile
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(profile, indent=1) + "\n")
    steps = sum(len(log.steps) for log in logs)
    print(
        f"profile from {len(logs)} step log(s), {steps} steps: {len(profile['points'])} "
        f"points, {len(profile['host'])} host samples -> {args.out}"
    )
    print(fit.summary())
    compare = load_profile(args.compare) if args.compare is not None else None
    if args.held_out is not None:
        fitted, rest = split_logs(logs, args.held_out)
        part = fit_from_logs(fitted, spec, base).profile
        print(
            f"\nheld out: the last {args.held_out:.0%} of each log's steps, priced by the "
            "fit of the rest (median / p90 |error|)"
        )
        _print_errors(spec, rest, part, compare, args.compare)
    if args.check is not None:
        checked = load_logs(args.check)
        print(f"\nsteps of {len(checked)} other run(s), priced by the fit (median / p90 |error|)")
        _print_errors(spec, checked, profile, compare, args.compare)
    return 0


def _print_errors(
    spec: Any,
    logs: list[Any],
    fitted: dict[str, Any],
    compare: dict[str, Any] | None,
    compare_path: Path | None,
) -> None:
    """The errors of the fitted profile on `logs`' steps, and `compare`'s beside."""
    from sim.log_check import error_table, step_errors

    columns = {"from logs": step_errors(fitted, spec, logs)}
    if compare is not None and compare_path is not None:
        columns[compare_path.name] = step_errors(compare, spec, logs)
    print(error_table(columns))
