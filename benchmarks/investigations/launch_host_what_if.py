"""What pricing the launch's host time does, before the profiler measures it.

A step that replays no CUDA graph (a piecewise or eager step) keeps the host busy while
it launches; under async scheduling the engine reads the step in flight's results only
after that launch returns. The grid profiles shipped so far hold no `launch_s`. This
script estimates a launch from served step logs (a decode step N applied, then the
non-graph step N+1 launched beside it: the wall between their applications, less
N+1's scheduling and N-1's processing, where it outlasts N's device span, is N+1's
launch), fits it as a + b * requests + c * tokens, writes a copy of a grid profile whose
non-graph points carry it as `launch_s`, and prints the estimates.

    python benchmarks/investigations/launch_host_what_if.py GRID.json OUT.json LOG...

Fit on one set of runs' logs and re-simulate others with the copy
(`deepinfer bench fidelity --real DIR --profile OUT.json`), so no run prices itself.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np

from deepinfer.step_log_file import read_step_log
from sim.profile_fit import nnls_relative


def launch_estimates(paths: list[str]) -> list[tuple[int, int, float]]:
    """(requests, tokens, launch seconds) of each non-graph step launched beside a
    decode step whose results it held."""
    rows = []
    for path in paths:
        log = read_step_log(path)
        if not log.engine.get("async_scheduling") or log.engine.get("num_speculative_tokens"):
            continue
        steps = log.steps
        for before, cur, after in zip(steps, steps[1:], steps[2:]):
            decode = all(g[1] == 1 for g in cur.groups)
            chunk = any(g[1] > 1 for g in after.groups)
            if not (decode and chunk and cur.overlapped and after.overlapped):
                continue
            if cur.device_s is None:
                continue
            wall = cur.record.time - before.record.time
            launch = wall - after.schedule_s - before.process_s
            if wall > cur.device_s + 1e-3:  # the launch outlasted the step in flight
                reqs = sum(g[0] for g in after.groups)
                tokens = sum(g[0] * g[1] for g in after.groups)
                rows.append((reqs, tokens, launch))
    return rows


def main(argv: list[str]) -> int:
    grid, out, logs = Path(argv[0]), Path(argv[1]), argv[2:]
    rows = launch_estimates(logs)
    x = np.array([[1.0, r, t] for r, t, _ in rows])
    y = np.array([s for _, _, s in rows])
    a, b, c = nnls_relative(x, y)
    print(
        f"{len(rows)} launches: p10/p50/p90 "
        f"{np.percentile(y, [10, 50, 90]).round(5).tolist()} s; "
        f"fit {a * 1e3:.2f} ms + {b * 1e6:.1f} us/request + {c * 1e6:.3f} us/token"
    )
    profile = json.loads(grid.read_text())
    for p in profile["points"]:
        if p.get("drafter") or all(g[1] == 1 for g in p["groups"]):
            continue
        p["launch_s"] = float(a + b * p["num_reqs"] + c * p["num_tokens"])
    out.write_text(json.dumps(profile, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
