"""Vidur vs deepinfer's simulator on one public trace, timed the same way.

    deepinfer bench vidur --vidur-python /tmp/vidur-venv/bin/python --cpu 0

Vidur (PyPI `vidur`, tested with 0.0.26) runs in its own virtual environment:
    python3 -m venv /tmp/vidur-venv && /tmp/vidur-venv/bin/pip install vidur==0.0.26

Fairness, which an earlier version of this script lacked (it timed Vidur as a whole
process and ours inside `simulate()` only):
- Both run as whole processes, each in a fresh interpreter, from its start to its
  results written (ours: `deepinfer simulate TRACE --out report.json`; Vidur: its
  `vidur.main`, writing its metrics CSVs). The parent times each process.
- Each also reports its loop alone, timed inside the same process by a small shim:
  ours `simpy.Environment.run`, Vidur's `Simulator.run` up to `_write_output`.
- Every request of both runs must have finished, by status: ours from each record's
  `status` in the report, Vidur's from each `Request.completed` after its loop.
- Runs are interleaved (ours, Vidur, Vidur, ours, ...) `--runs` times (at least 3)
  after one cold Vidur run that trains its predictors; medians are reported.
With `--cpu N` both are pinned to CPU N. Models and GPUs differ (Vidur: Llama-3-8B on
an H100 with a synthetic roofline profile, see vidur_setup.py; ours: moonlight-16b-a3b
on h200), so the latency columns compare policy-level behaviour only.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from benchmarks.vidur_setup import (
    VidurUnavailable,
    check_vidur,
    convert_trace,
    synth_profile,
    vidur_args,
)

ROOT = Path(__file__).resolve().parents[1]

# Each shim writes {"loop_s", "num_requests", "num_finished"} to $COMPARE_TIMES.
OURS_SHIM = """
import json, os, sys, time
import simpy
marks = {}
_run = simpy.Environment.run
def run(self, until=None):
    t0 = time.perf_counter()
    try:
        return _run(self, until)
    finally:
        marks['loop_s'] = marks.get('loop_s', 0.0) + time.perf_counter() - t0
simpy.Environment.run = run
from deepinfer.entrypoints.cli import main
code = main(sys.argv[1:])
doc = json.load(open(sys.argv[sys.argv.index('--out') + 1]))
status = [r['status'] for r in doc['requests']]
marks.update(num_requests=len(status), num_finished=status.count('finished'))
json.dump(marks, open(os.environ['COMPARE_TIMES'], 'w'))
sys.exit(code)
"""

VIDUR_SHIM = """
import json, os, sys, time
from vidur.entities import request as request_module
from vidur.simulator import Simulator
made, marks = [], {}
_init = request_module.Request.__init__
def init(self, *a, **k):
    _init(self, *a, **k)
    made.append(self)
request_module.Request.__init__ = init
_run, _write = Simulator.run, Simulator._write_output
def run(self):
    marks['t0'] = time.perf_counter()
    _run(self)
def write(self):
    marks['loop_s'] = time.perf_counter() - marks.pop('t0')
    _write(self)
Simulator.run, Simulator._write_output = run, write
from vidur.main import main
main()
marks.update(num_requests=len(made), num_finished=sum(1 for r in made if r.completed))
json.dump(marks, open(os.environ['COMPARE_TIMES'], 'w'))
"""


def timed(cmd: list[str], env: dict[str, str], log: Path, times: Path, cwd: Path) -> dict:
    """Run one whole process; its wall time, plus what its shim measured inside."""
    times.unlink(missing_ok=True)
    t0 = time.perf_counter()
    with open(log, "w") as f:
        p = subprocess.run(cmd, stdout=f, stderr=subprocess.STDOUT, env=env, cwd=cwd)
    wall = time.perf_counter() - t0
    if p.returncode != 0 or not times.exists():
        raise VidurUnavailable(
            f"{cmd[1]} exited {p.returncode}; see {log}:\n{log.read_text()[-2000:]}"
        )
    got = json.loads(times.read_text())
    if got["num_finished"] != got["num_requests"]:
        raise SystemExit(
            f"{log}: only {got['num_finished']}/{got['num_requests']} requests finished"
        )
    return {"wall": wall, **got}


def ours_latencies(report: Path) -> dict:
    s = json.loads(report.read_text())["summary"]
    keys = {"ttft": "ttft", "tpot": "tpot", "e2e": "e2el"}
    out = {f"{k}_{st}": s[f"{v}_ms_{st}"] for k, v in keys.items() for st in ("mean", "p99")}
    return out | {"steps": s["num_steps"]}


def vidur_latencies(out_dir: Path) -> dict:
    """TTFT = prefill_e2e_time, TPOT = decode_time_execution_plus_preemption_normalized,
    E2E = request_e2e_time (Vidur's seconds, here in ms)."""
    import csv

    import numpy as np

    path = sorted(out_dir.rglob("request_metrics.csv"), key=lambda q: q.stat().st_mtime)[-1]
    with open(path, newline="") as f:
        rows = list(csv.DictReader(f))
    cols = {
        "ttft": "prefill_e2e_time",
        "tpot": "decode_time_execution_plus_preemption_normalized",
        "e2e": "request_e2e_time",
    }
    out: dict[str, Any] = {"rows": len(rows)}
    for name, col in cols.items():
        xs = np.array([1e3 * float(r[col]) for r in rows if r.get(col)])
        out[f"{name}_mean"], out[f"{name}_p99"] = float(xs.mean()), float(np.percentile(xs, 99))
    return out


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--vidur-python", required=True, help="python of a venv with `vidur` installed")
    p.add_argument(
        "--trace", type=Path, default=ROOT.parent / "shared" / "traces" / "azure2023_code.csv"
    )
    p.add_argument("--workdir", type=Path, default=Path("/tmp/vidur_compare"))
    p.add_argument("--cpu", type=int, default=None, help="pin both simulators to this CPU")
    p.add_argument("--runs", type=int, default=3, help="interleaved timed runs of each (>= 3)")
    p.add_argument("--vidur-scheduler", default="sarathi", choices=["sarathi", "vllm"])
    p.add_argument("--profiling-dataset", default=None, help="a real Vidur profile in the cache")
    p.add_argument("--network-dataset", default=None)
    p.add_argument("--max-num-seqs", type=int, default=256)
    p.add_argument("--max-batched-tokens", type=int, default=8192)
    p.add_argument("--block-size", type=int, default=64)
    p.add_argument("--max-tokens", type=int, default=8192, help="Vidur's per-request token cap")
    p.add_argument("--model", default="moonlight-16b-a3b", help="our model preset")
    p.add_argument("--hardware", default="h200", help="our hardware preset")
    p.add_argument("--full-grid", action="store_true", help="Vidur's full random-forest search")
    args = p.parse_args()
    if args.runs < 3:
        p.error("--runs: at least 3 (the figure is a median)")
    if args.cpu is not None:
        os.sched_setaffinity(0, {args.cpu})  # inherited by both simulators' processes
    try:
        version = check_vidur(args.vidur_python)
    except VidurUnavailable as e:
        print(f"vidur_compare: Vidur is not available: {e}", file=sys.stderr)
        return 2

    work = args.workdir
    work.mkdir(parents=True, exist_ok=True)
    date = "2023-11-16"
    trace_csv = work / "trace_vidur.csv"
    n = convert_trace(args.trace, trace_csv, date)
    cache = work / "cache"
    if args.profiling_dataset is None:
        shutil.rmtree(cache, ignore_errors=True)
        synth_profile(cache, args.block_size)
    (work / "ours_shim.py").write_text(OURS_SHIM)
    (work / "vidur_shim.py").write_text(VIDUR_SHIM)
    times = work / "times.json"
    base = dict(os.environ, COMPARE_TIMES=str(times))
    venv_env = base | {"WANDB_MODE": "disabled", "HF_HUB_OFFLINE": "1", "TQDM_DISABLE": "1"}
    ours_env = base | {"PYTHONPATH": str(ROOT)}
    report = work / "ours_report.json"
    ours_cmd = [sys.executable, str(work / "ours_shim.py"), "simulate", str(args.trace)]
    ours_cmd += ["--model", args.model, "--hardware", args.hardware, "--no-progress"]
    ours_cmd += ["--max-num-seqs", str(args.max_num_seqs), "--block-size", str(args.block_size)]
    ours_cmd += ["--max-num-batched-tokens", str(args.max_batched_tokens), "--out", str(report)]

    def vidur(label: str) -> dict:
        out = work / f"out_{label}"
        shutil.rmtree(out, ignore_errors=True)
        out.mkdir()
        cmd = [args.vidur_python, str(work / "vidur_shim.py")]
        cmd += vidur_args(trace_csv, date, out, cache, args)
        return timed(cmd, venv_env, work / f"vidur_{label}.log", times, out)

    def ours(i: int) -> dict:
        return timed(ours_cmd, ours_env, work / f"ours_{i}.log", times, ROOT)

    try:
        cold = vidur("cold")  # trains and caches the predictors: not a timed run
        runs: dict[str, list[dict]] = {"ours": [], "vidur": []}
        for i in range(args.runs):
            order = ["ours", "vidur"] if i % 2 == 0 else ["vidur", "ours"]
            for who in order:
                runs[who].append(ours(i) if who == "ours" else vidur(f"warm{i}"))
    except VidurUnavailable as e:
        print(f"vidur_compare: a run failed: {e}", file=sys.stderr)
        return 3

    med = {
        who: {k: statistics.median(r[k] for r in rs) for k in ("wall", "loop_s")}
        for who, rs in runs.items()
    }
    lat = {
        "ours": ours_latencies(report),
        "vidur": vidur_latencies(work / f"out_warm{args.runs - 1}"),
    }
    profile = args.profiling_dataset or "synthetic roofline"
    print(
        f"trace {args.trace.name}: {n} requests; vidur {version} ({args.vidur_scheduler}, "
        f"Llama-3-8B/H100, {profile} profile); ours {args.model}/{args.hardware}; "
        f"cpu pin {args.cpu}; median of {args.runs} interleaved runs; all requests finished"
    )
    print(
        f"{'simulator':10} {'process s':>10} {'loop s':>8} {'runs (process s)':>26} "
        f"{'TTFT mean/p99 ms':>20} {'TPOT mean/p99 ms':>18} {'E2E mean/p99 ms':>20}"
    )
    for who in ("ours", "vidur"):
        walls = " ".join(f"{r['wall']:.2f}" for r in runs[who])
        m, la = med[who], lat[who]
        print(
            f"{who:10} {m['wall']:10.2f} {m['loop_s']:8.2f} {walls:>26} "
            f"{la['ttft_mean']:9.1f}/{la['ttft_p99']:<10.1f} {la['tpot_mean']:7.2f}/{la['tpot_p99']:<10.2f} "
            f"{la['e2e_mean']:9.1f}/{la['e2e_p99']:<10.1f}"
        )
    ratio_process = med["vidur"]["wall"] / med["ours"]["wall"]
    ratio_loop = med["vidur"]["loop_s"] / med["ours"]["loop_s"]
    print(f"Vidur / deepinfer: whole process {ratio_process:.2f}x, loop alone {ratio_loop:.2f}x")
    print(f"Vidur cold (training its predictors first): {cold['wall']:.2f} s, not in the medians")
    (work / "result.json").write_text(
        json.dumps(
            {
                "vidur_version": version,
                "runs": runs,
                "cold": cold,
                "median": med,
                "latencies": lat,
                "ratio": {"process": ratio_process, "loop": ratio_loop},
                "args": {k: str(x) for k, x in vars(args).items()},
            },
            indent=2,
        )
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
