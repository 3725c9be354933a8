"""Simulator speed: whole public traces through `simulate`, in the field's units.

    deepinfer bench sim-speed [--shared ../shared/traces] [--only NAME] [--single] [--profile]
    deepinfer bench sim-speed --ab COMMIT [--ab COMMIT2] [--runs 3] [--only NAME]

Prints one row per trace: requests, engine steps, the share of them the fast-forward
advanced in decode runs, wall seconds, and simulated seconds per wall second (x real
time), requests and steps per wall second. `--single` runs every step one by one
(`fast_forward=False`: the same results, the speed without the fast-forward). The
scheduler's per-step cost must not grow with the waiting queue: the `overload` row
replays the Azure code trace 20x faster, so thousands wait.

The Azure conversation trace (19,366 requests over an hour) is read from --shared, or
downloaded by the user from the Azure Public Dataset (CC-BY 4.0):
https://github.com/Azure/AzurePublicDataset/raw/master/data/AzureLLMInferenceTrace_conv.csv
A trace that is not there is skipped with a line saying where it comes from.

`--ab COMMIT` compares this working tree with COMMIT's code side by side: COMMIT is
checked out in a temporary git worktree, and each run is a fresh process of this
file with that tree (or this one) first on PYTHONPATH, the sides interleaved run by
run, so a load that comes and goes on a shared machine falls on both alike. It
prints each side's median wall seconds and microseconds a step, and each other
side's ratio to this tree (a step's time: commits may take different steps). Pin it
to one core (`taskset -c 0 ...`): the runs inherit the affinity.
"""

from __future__ import annotations

import argparse
import cProfile
import json
import os
import pstats
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from deepinfer.config import EngineConfig
from sim import load_trace, simulate

ROOT = Path(__file__).resolve().parents[1]

CONV_URL = (
    "https://github.com/Azure/AzurePublicDataset/raw/master/data/AzureLLMInferenceTrace_conv.csv"
)
CASES = [
    # name, file, model, engine overrides, time scale
    ("azure-code", "azure2023_code.csv", "moonlight-16b-a3b", {}, 1.0),
    ("azure-conv", "AzureLLMInferenceTrace_conv.csv", "moonlight-16b-a3b", {}, 1.0),
    ("mooncake-conv", "mooncake_fast25_conversation_trace.jsonl", "deepseek-v2-lite", {}, 1.0),
    (
        "azure-code-overload",
        "azure2023_code.csv",
        "moonlight-16b-a3b",
        {"num_gpu_blocks": 4000},
        0.05,
    ),
]


def run_case(
    shared: Path, name: str, fname: str, model: str, overrides: dict, scale: float,
    fast_forward: bool = True,
) -> dict:  # fmt: skip
    trace = load_trace(shared / fname, time_scale=scale)
    # (only when off: an --ab side's older simulate may not take the argument)
    single = {} if fast_forward else {"fast_forward": False}
    t0 = time.perf_counter()
    result = simulate(trace, model=model, engine=EngineConfig(**overrides), **single)
    wall = time.perf_counter() - t0
    steps = result.meta["num_steps"]
    waiting = result.summary.get("waiting_mean") or 0.0
    makespan = result.summary["duration_s"]
    return dict(
        name=name,
        requests=len(trace),
        steps=steps,
        fast_forwarded=result.meta.get("fast_forward", {}).get("steps", 0) / steps,
        wall=wall,
        x_real_time=makespan / wall,
        req_per_s=len(trace) / wall,
        steps_per_s=steps / wall,
        us_per_step=1e6 * wall / steps,
        waiting_mean=waiting,
        makespan=makespan,
        completed=result.summary["num_completed"],
        rejected=result.summary["num_rejected"],
    )


def run_ab(
    shared: Path, names: list[str], commits: list[str], runs: int, single: bool = False
) -> None:
    """Interleaved runs of this tree and each commit's tree; prints medians and ratios."""
    worktrees = tempfile.mkdtemp(prefix="sim-speed-ab-")
    trees = {"this tree": ROOT}
    try:
        for commit in commits:
            tree = Path(worktrees) / commit.replace("/", "_")
            subprocess.run(
                ["git", "-C", str(ROOT), "worktree", "add", "--detach", str(tree), commit],
                check=True, capture_output=True,
            )  # fmt: skip
            trees[commit] = tree
        for name in names:
            rows: dict[str, list[dict]] = {side: [] for side in trees}
            for i in range(runs):
                for side, tree in trees.items():
                    rows[side].append(_run_in(tree, shared, name, single))
                    r = rows[side][-1]
                    print(
                        f"  run {i + 1}/{runs} {side:12} {r['wall']:7.2f} s "
                        f"{r['us_per_step']:7.1f} us/step",
                        flush=True,
                    )
            _print_ab(name, runs, trees, rows)
    finally:
        for tree in list(trees.values())[1:]:
            subprocess.run(
                ["git", "-C", str(ROOT), "worktree", "remove", "--force", str(tree)],
                check=False, capture_output=True,
            )  # fmt: skip
        shutil.rmtree(worktrees, ignore_errors=True)


def _run_in(tree: Path, shared: Path, name: str, single: bool = False) -> dict:
    """One run of case `name` in a fresh process on `tree`'s code (this file's
    measurement, which needs only `simulate`, `load_trace` and `EngineConfig`)."""
    env = dict(os.environ, PYTHONPATH=str(tree))
    cmd = [sys.executable, str(Path(__file__).resolve()), "--json", "--only", name,
           "--shared", str(shared.resolve())] + (["--single"] if single else [])  # fmt: skip
    done = subprocess.run(cmd, cwd=tree, env=env, check=True, capture_output=True, text=True)
    return json.loads(done.stdout.strip().splitlines()[-1])


def _print_ab(name: str, runs: int, trees: dict[str, Path], rows: dict[str, list[dict]]) -> None:
    print(f"{name}: median of {runs} interleaved runs, one process each")
    print(f"{'side':12} {'commit':10} {'steps':>8} {'wall s':>7} {'us/step':>8} {'ratio':>7}")
    base = statistics.median(r["us_per_step"] for r in rows["this tree"])
    for side, tree in trees.items():
        head = subprocess.run(
            ["git", "-C", str(tree), "rev-parse", "--short", "HEAD"],
            capture_output=True, text=True, check=False,
        ).stdout.strip()  # fmt: skip
        us = statistics.median(r["us_per_step"] for r in rows[side])
        wall = statistics.median(r["wall"] for r in rows[side])
        print(
            f"{side:12} {head:10} {rows[side][0]['steps']:8d} {wall:7.2f} {us:8.1f} "
            f"{us / base:6.2f}x"
        )


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument(
        "--shared",
        type=Path,
        default=ROOT.parent / "shared" / "traces",
        help="folder with the full public traces",
    )
    p.add_argument("--only", default=None, help="run only the case with this name")
    p.add_argument("--profile", action="store_true", help="cProfile the run, top 25 by tottime")
    p.add_argument(
        "--ab",
        action="append",
        metavar="COMMIT",
        help="compare this tree with COMMIT's code, interleaved (repeat for more commits)",
    )
    p.add_argument("--runs", type=int, default=3, help="--ab: runs of each side (default 3)")
    p.add_argument(
        "--single", action="store_true", help="run every step one by one (no fast-forward)"
    )
    p.add_argument("--json", action="store_true", help="print each case's row as JSON")
    args = p.parse_args()
    cases = [c for c in CASES if args.only in (None, c[0])]
    missing = [c for c in cases if not (args.shared / c[1]).is_file()]
    for c in missing:
        where = CONV_URL if c[1] == CONV_URL.rsplit("/", 1)[1] else "the project's shared traces"
        print(f"{c[0]}: {args.shared / c[1]} is not there (it comes from {where}); skipped")
    cases = [c for c in cases if c not in missing]
    if args.ab:
        run_ab(args.shared, [c[0] for c in cases], args.ab, args.runs, args.single)
        return
    prof = cProfile.Profile() if args.profile else None
    rows = []
    for case in cases:
        if prof:
            prof.enable()
        rows.append(run_case(args.shared, *case, fast_forward=not args.single))
        if prof:
            prof.disable()
    if args.json:
        for r in rows:
            print(json.dumps(r))
        return
    print(
        f"{'trace':20} {'requests':>8} {'done':>6} {'rej':>5} {'steps':>8} {'ff':>5} "
        f"{'wall s':>7} {'x real':>7} {'req/s':>7} {'steps/s':>8} {'us/step':>8} "
        f"{'waiting':>8} {'sim s':>7}"
    )
    for r in rows:
        print(
            f"{r['name']:20} {r['requests']:8d} {r['completed']:6d} {r['rejected']:5d} "
            f"{r['steps']:8d} {r['fast_forwarded']:5.0%} {r['wall']:7.2f} "
            f"{r['x_real_time']:7.0f} {r['req_per_s']:7.0f} {r['steps_per_s']:8.0f} "
            f"{r['us_per_step']:8.1f} {r['waiting_mean']:8.1f} {r['makespan']:7.0f}"
        )
    if prof:
        pstats.Stats(prof).sort_stats("tottime").print_stats(25)


if __name__ == "__main__":
    main()
