"""Simulator speed: whole public traces through `simulate`, wall time per trace.

    deepinfer bench sim-speed [--shared ../shared/traces] [--profile]

Prints one row per trace: requests, engine steps, wall seconds, simulated
requests per second and steps per second, and the simulated makespan. The
scheduler's per-step cost must not grow with the waiting queue: the
`overload` row replays the Azure trace 20x faster, so thousands wait.
"""

from __future__ import annotations

import argparse
import cProfile
import pstats
import time
from pathlib import Path

from deepinfer.config import EngineConfig
from sim import load_trace, simulate

ROOT = Path(__file__).resolve().parents[1]

CASES = [
    # name, file, model, engine overrides, time scale
    ("azure-code", "azure2023_code.csv", "moonlight-16b-a3b", {}, 1.0),
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
    shared: Path, name: str, fname: str, model: str, overrides: dict, scale: float
) -> dict:
    trace = load_trace(shared / fname, time_scale=scale)
    t0 = time.perf_counter()
    result = simulate(trace, model=model, engine=EngineConfig(**overrides))
    wall = time.perf_counter() - t0
    steps = result.meta["num_steps"]
    waiting = result.summary.get("waiting_mean") or 0.0
    return dict(
        name=name,
        requests=len(trace),
        steps=steps,
        wall=wall,
        req_per_s=len(trace) / wall,
        steps_per_s=steps / wall,
        us_per_step=1e6 * wall / steps,
        waiting_mean=waiting,
        makespan=result.summary["duration_s"],
        completed=result.summary["num_completed"],
        rejected=result.summary["num_rejected"],
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
    args = p.parse_args()
    cases = [c for c in CASES if args.only in (None, c[0])]
    prof = cProfile.Profile() if args.profile else None
    rows = []
    for case in cases:
        if prof:
            prof.enable()
        rows.append(run_case(args.shared, *case))
        if prof:
            prof.disable()
    print(
        f"{'trace':22} {'requests':>8} {'done':>6} {'rej':>5} {'steps':>8} {'wall s':>7} "
        f"{'req/s':>7} {'us/step':>8} {'waiting':>8} {'sim s':>8}"
    )
    for r in rows:
        print(
            f"{r['name']:22} {r['requests']:8d} {r['completed']:6d} {r['rejected']:5d} "
            f"{r['steps']:8d} {r['wall']:7.2f} {r['req_per_s']:7.0f} {r['us_per_step']:8.1f} "
            f"{r['waiting_mean']:8.1f} {r['makespan']:8.0f}"
        )
    if prof:
        pstats.Stats(prof).sort_stats("tottime").print_stats(25)


if __name__ == "__main__":
    main()
