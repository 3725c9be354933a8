"""`deepinfer sweep` wall time against the worker count: the 16-config grid of
benchmarks/sweep_grid.yaml on the bundled trace, local worker processes.

    deepinfer bench sweep-speed [--workers 1,2,4] [--slo ttft_p99:2000,tpot_p99:150]
        [--out /tmp/sweep_speed]

Each run is a whole `deepinfer sweep` process, timed from its start. Prints one line per
run (the sweep's own timing line) and whether each run's ranked configs and points are
byte-identical to the first run's: the rows must not depend on what runs them.
"""

from __future__ import annotations

import argparse
import filecmp
import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def run_sweep(workers: int, slo: str, out: Path) -> str:
    """One sweep in its own process; its timing line (the output's second-to-last)."""
    proc = subprocess.run(
        [
            sys.executable, "-m", "deepinfer", "sweep",
            "--grid", str(ROOT / "benchmarks" / "sweep_grid.yaml"), "--slo", slo,
            "--workers", str(workers), "--out", str(out), "--no-progress", "--no-plot",
        ],
        cwd=ROOT, capture_output=True, text=True, check=True,
    )  # fmt: skip
    lines = proc.stdout.splitlines()
    return lines[-2] if len(lines) >= 2 else proc.stdout


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--workers", default="1,2,4", help="worker counts, one sweep each")
    p.add_argument("--slo", default="ttft_p99:2000,tpot_p99:150", help="the sweep's SLO")
    p.add_argument("--out", type=Path, default=Path("/tmp/sweep_speed"), help="results root")
    args = p.parse_args(argv)
    workers = [int(w) for w in args.workers.split(",") if w]
    shutil.rmtree(args.out, ignore_errors=True)
    for w in workers:
        print(run_sweep(w, args.slo, args.out / f"w{w}"), flush=True)
    first = args.out / f"w{workers[0]}"
    for w in workers[1:]:
        same = all(
            filecmp.cmp(first / name, args.out / f"w{w}" / name, shallow=False)
            for name in ("configs.csv", "points.csv")
        )
        verdict = "identical to" if same else "DIFFERENT from"
        print(f"workers={w}: configs.csv and points.csv {verdict} workers={workers[0]}")
    for line in (first / "configs.csv").read_text().splitlines()[:4]:
        print(line[:160])
    return 0


if __name__ == "__main__":
    sys.exit(main())
