"""`deepinfer profile --check-grid PROFILE [--folds K]`: the held-out check of a
profile's grid per step kind (sim/grid_check.py): every point priced by the fit of the
others, median and p90 |error| by kind against the fidelity targets, and the kinds the
grid does not cover. No device: the simulator's fit only.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from deepinfer.entrypoints.cli.profile_from_log import measuring_flags


def add_check_grid_options(p: argparse.ArgumentParser) -> None:
    group = p.add_argument_group("check a profile's grid (no device)")
    group.add_argument(
        "--check-grid",
        type=Path,
        metavar="PROFILE",
        help="price every point of PROFILE by the fit of the others and print the errors "
        "by step kind, and the kinds its grid does not cover; --model names the model "
        "where the profile's own name does not load",
    )
    group.add_argument(
        "--folds",
        type=int,
        default=None,
        metavar="K",
        help="with --check-grid: hold out a K-th of each kind's points at a time (default: "
        "leave-one-out)",
    )
    group.add_argument(
        "--check-json",
        type=Path,
        default=None,
        metavar="PATH",
        help="with --check-grid: also write the check (every held-out error) as JSON",
    )


def check_grid_args(args: argparse.Namespace) -> None:
    """Refuse what the grid check does not take, or its options without --check-grid."""
    if args.check_grid is None:
        given = [n for n in ("folds", "check_json") if getattr(args, n) is not None]
        if given:
            flags = ", ".join("--" + n.replace("_", "-") for n in given)
            raise ValueError(f"{flags}: only with --check-grid PROFILE")
        return
    given = ["--" + n.replace("_", "-") for n in ("from_log", "out") if getattr(args, n)]
    measuring = measuring_flags(args)
    if measuring:
        given.append(measuring)
    if given:
        raise ValueError(
            f"{', '.join(given)}: --check-grid measures nothing and writes no profile; it "
            "checks the one given"
        )


def run_check_grid(args: argparse.Namespace) -> int:
    from deepinfer.model_config import load_model_config
    from sim.grid_check import check_grid
    from sim.hardware import get_hardware
    from sim.profiled_cost_model import load_profile

    profile = load_profile(args.check_grid)
    name = args.model or profile.get("model") or "(none named)"
    try:
        spec = load_model_config(name)
    except (ValueError, OSError, TypeError) as e:
        raise ValueError(
            f"{args.check_grid}: its model {name!r} does not load here ({e}); name it "
            "with --model (a preset or a config.json path)"
        ) from e
    hardware = get_hardware(profile["meta"]["hardware"])
    check = check_grid(profile, spec, hardware, args.folds or 0)
    print(check.table())
    if args.check_json is not None:
        args.check_json.parent.mkdir(parents=True, exist_ok=True)
        args.check_json.write_text(json.dumps(check.to_dict(), indent=1) + "\n")
        print(f"check: {args.check_json}")
    return 0
