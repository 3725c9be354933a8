"""`deepinfer sweep`: grid and SLO parsing, the rate search, resume, backends, the CLI."""

from __future__ import annotations

import json
import math
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from deepinfer.entrypoints.cli import main
from sim.sweep import (
    RateSpec,
    ResultStore,
    SweepContext,
    build_grid,
    make_backend,
    parse_sweep_slo,
    run_sweep,
    sweep_header,
)
from sim.sweep.point import PointTask
from sim.sweep.search import RateSearch
from sim.traces import Trace, TraceRequest

ROOT = Path(__file__).resolve().parents[2]


def tiny_trace(n: int, prompt: int = 16, output: int = 5) -> Trace:
    reqs = [TraceRequest(f"r{i}", float(i), prompt, output) for i in range(n)]
    return Trace("tiny", "python", reqs)


# ---- the search, on a synthetic latency curve with a known knee ----------------------


class SyntheticBackend:
    """Points priced by a closed-form curve: p99 TTFT = base / (1 - rate / capacity),
    infinite past capacity; it crosses `limit` at capacity * (1 - base / limit)."""

    name, workers = "synthetic", 1

    def __init__(self, capacity: float, base: float = 100.0) -> None:
        self.capacity, self.base = capacity, base
        self.queue: list[PointTask] = []
        self.runs = 0

    def submit(self, task: PointTask) -> None:
        self.queue.append(task)

    def next_done(self) -> dict[str, Any]:
        task = self.queue.pop(0)
        self.runs += 1
        load = task.rate / self.capacity
        ttft = self.base / (1 - load) if load < 1 else math.inf
        row = {"config_key": task.config.key, "rate": task.rate, "status": "ok"}
        return row | {"meets_slo": ttft <= 2000.0, "reason": "", "ttft_ms_p99": ttft}

    def in_flight(self) -> int:
        return len(self.queue)

    def close(self) -> None:
        pass


@pytest.mark.parametrize("capacity", [3.0, 57.0, 400.0])
def test_bisection_finds_the_knee_of_a_synthetic_cost_curve(tmp_path: Path, capacity: float):
    knee = capacity * (1 - 100.0 / 2000.0)
    grid = build_grid({"rate": {"min": 0.1, "max": 1000, "rel_tol": 0.02, "max_points": 30}})
    ctx = SweepContext(tiny_trace(3), parse_sweep_slo("ttft_p99:2000"), 0)
    backend = SyntheticBackend(capacity)
    store = ResultStore(tmp_path, sweep_header(ctx))
    out = run_sweep(grid, ctx, backend, store)
    found = out.configs[0]["max_rate"]
    assert found <= knee < found * 1.02 * 1.001  # within rel_tol (and rate rounding) below
    assert backend.runs <= 20  # bisection, not a scan of the range


def test_search_stops_at_a_rate_independent_failure_and_at_the_bounds():
    s = RateSearch(RateSpec(min=1, max=8), default_start=2)
    assert s.next_rates() == [2.0]
    s.record(2.0, {"status": "rejected", "meets_slo": False, "reason": "too long"})
    assert s.done and s.max_rate is None and s.next_rates() == []
    s = RateSearch(RateSpec(min=1, max=8), default_start=2)
    for rate in (2.0, 4.0, 8.0):
        assert s.next_rates() == [rate]
        s.record(rate, {"status": "ok", "meets_slo": True})
    assert s.done and s.max_rate == 8.0 and "rate.max" in s.note


def test_the_unit_cost_model_saturates_where_queueing_says(tmp_path: Path):
    """One request at a time, 5 steps of 1 ms each: a server of mu = 200 req/s. Below mu
    the p99 wait is a few service times; past it the backlog of a finite trace of N
    requests grows to N (1 - mu / rate), so the p99 TTFT limit L is crossed by
    rate = mu / (1 - L mu / N) at the latest."""
    mu, n, limit = 200.0, 400, 0.1
    raw = {"cost_model": "unit", "max_num_seqs": 1, "rate": {"min": 10, "max": 800}}
    grid = build_grid(raw)
    ctx = SweepContext(tiny_trace(n), parse_sweep_slo(f"ttft_p99:{limit * 1000}"), 0)
    out = run_sweep(grid, ctx, make_backend(ctx, 1, None), ResultStore(tmp_path, sweep_header(ctx)))
    best = out.configs[0]
    assert 0.6 * mu <= best["max_rate"] <= 1.05 * mu / (1 - limit * mu / n), best
    assert best["cost_model"] == "unit" and best["calibrated"] is False


# ---- parsing -----------------------------------------------------------------------


def test_grid_expands_the_product_and_keeps_invalid_combinations_as_rows():
    raw = {
        "max_num_seqs": [8, 16],
        "max_num_batched_tokens": [4, 512],
        "num_speculative_tokens": 4,  # must be < max_num_batched_tokens: 4 is not
        "rate": [1, 2],
    }
    grid = build_grid(raw)
    assert len(grid.configs) == 2 and len(grid.invalid) == 2
    assert grid.rate.rates == (1.0, 2.0)
    assert grid.configs[0].label == "max_num_seqs=8 max_num_batched_tokens=512"


@pytest.mark.parametrize(
    ("raw", "needle"),
    [
        ({"max_num_seq": [8]}, "'max_num_seq' (did you mean 'max_num_seqs'?)"),
        ({"max_num_seqs": ["many"]}, "'max_num_seqs'"),
        ({"max_num_seqs": [0]}, "'max_num_seqs'"),
        ({"enable_chunked_prefill": [2]}, "'enable_chunked_prefill'"),
        ({"model": ["no-such-model"]}, "'model'"),
        ({"rate": {"min": 5, "max": 1}}, "'rate'"),
        ({"rate": {"step": 2}}, "'rate.step'"),
    ],
)
def test_a_bad_grid_names_the_key(raw: dict, needle: str):
    with pytest.raises(ValueError) as e:
        build_grid(raw, "g.yaml")
    assert needle in str(e.value) and "\n" not in str(e.value)


@pytest.mark.parametrize(
    ("text", "needle"),
    [("ttft_p42:1", "ttft_p42"), ("ttft:100", "goodput"), ("goodput:2,ttft:1", "goodput")],
)
def test_a_bad_slo_names_the_part(text: str, needle: str):
    with pytest.raises(ValueError, match=needle):
        parse_sweep_slo(text)


def test_slo_checks_percentiles_and_goodput():
    slo = parse_sweep_slo("ttft_p99:100,tpot_p50:10")
    assert slo.check({"ttft_ms_p99": 99.0, "tpot_ms_p50": 10.0}) == (True, "")
    assert slo.check({"ttft_ms_p99": 101.0, "tpot_ms_p50": 1.0})[1].startswith("ttft_p99")
    good = parse_sweep_slo("ttft:100,goodput:0.9")
    assert good.check({"num_submitted": 10, "num_good": 9})[0]
    assert not good.check({"num_submitted": 10, "num_good": 8})[0]


# ---- the command line --------------------------------------------------------------

GRID = {"max_num_seqs": [4, 64], "cost_model": "analytic"}
GRID["rate"] = {"min": 0.5, "max": 32, "rel_tol": 0.2}  # a few points per config: quick
ARGS = ["--slo", "ttft_p99:1000,tpot_p99:40", "--max-requests", "60", "--no-progress"]


def sweep(tmp_path: Path, out: str, *extra: str, grid: dict | None = None) -> int:
    path = tmp_path / "grid.yaml"
    path.write_text(json.dumps(grid or GRID))  # JSON is YAML
    argv = ["sweep", "--grid", str(path), "--out", str(tmp_path / out), *ARGS, *extra]
    return main(argv)


def results(tmp_path: Path, out: str) -> tuple[str, str]:
    d = tmp_path / out
    return (d / "configs.csv").read_text(), (d / "points.csv").read_text()


def test_cli_end_to_end_and_the_same_results_with_1_and_2_workers(tmp_path: Path, capsys):
    assert sweep(tmp_path, "w2", "--workers", "2") == 0
    printed = capsys.readouterr().out
    assert "max_num_seqs=64" in printed and "analytic (uncalibrated)" in printed
    assert "local x 2" in printed
    assert (tmp_path / "w2" / "sweep.png").stat().st_size > 0
    doc = json.loads((tmp_path / "w2" / "sweep.json").read_text())
    assert [c["rank"] for c in doc["configs"]] == [1, 2]
    assert all(c["max_rate"] for c in doc["configs"])
    assert sweep(tmp_path, "w1", "--workers", "1", "--no-plot") == 0
    assert results(tmp_path, "w1") == results(tmp_path, "w2")


def test_cli_with_ray_local_gives_the_same_results(tmp_path: Path, capsys):
    pytest.importorskip("ray")
    assert sweep(tmp_path, "w1", "--workers", "1", "--no-plot") == 0
    assert sweep(tmp_path, "ray", "--ray", "local", "--workers", "2", "--no-plot") == 0
    assert "on ray x 2" in capsys.readouterr().out
    assert results(tmp_path, "ray") == results(tmp_path, "w1")


def test_resume_after_a_kill_gives_the_same_results(tmp_path: Path, capsys):
    grid = tmp_path / "grid.yaml"
    grid.write_text(json.dumps(GRID | {"rate": {"min": 0.5, "max": 32, "rel_tol": 0.1}}))
    out = tmp_path / "killed"
    argv = ["sweep", "--grid", str(grid), "--out", str(out), "--workers", "1", *ARGS]
    argv[-2] = "120"  # --max-requests: points slow enough to be killed between two
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    proc = subprocess.Popen([sys.executable, "-m", "deepinfer", *argv], env=env, cwd=ROOT)
    points = out / "points.jsonl"
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline and proc.poll() is None:
        if points.exists() and points.read_text().count("\n") >= 4:  # header + 3 points
            break
        time.sleep(0.02)
    assert proc.poll() is None, "the sweep ended before it could be killed"
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    with points.open("a") as f:
        f.write('{"config_key": "cut sho')  # as if killed in the middle of a line
    assert main(argv) == 0
    assert "from points.jsonl" in capsys.readouterr().out
    text = (out / "sweep.json").read_text()
    assert main([*argv[:4], str(tmp_path / "clean"), *argv[5:]]) == 0
    assert (tmp_path / "clean" / "sweep.json").read_text() == text
    assert results(tmp_path, "clean") == results(tmp_path, "killed")


def test_a_results_file_of_another_sweep_is_refused(tmp_path: Path, capsys):
    assert sweep(tmp_path, "o", "--workers", "1", "--no-plot", "--rates", "1") == 0
    argv = ["--workers", "1", "--no-plot", "--rates", "1", "--arrival-seed", "7"]
    assert sweep(tmp_path, "o", *argv) == 2
    assert "seed" in capsys.readouterr().err
    assert sweep(tmp_path, "o", *argv, "--fresh") == 0


def test_a_worker_that_dies_is_an_error_row_and_the_other_points_run(tmp_path, monkeypatch):
    import sim.sweep.backends as backends

    real = backends.run_point

    def dies_at_4(task: PointTask, ctx: SweepContext) -> dict[str, Any]:
        if task.rate == 4.0:
            os._exit(1)  # as a worker killed for its memory would
        return real(task, ctx)

    monkeypatch.setattr(backends, "run_point", dies_at_4)  # forked workers inherit it
    grid = build_grid({"cost_model": "unit", "max_num_seqs": [1, 2], "rate": [1, 2, 4, 8]})
    ctx = SweepContext(tiny_trace(20), parse_sweep_slo("ttft_p99:1000"), 0)
    store = ResultStore(tmp_path, sweep_header(ctx))
    out = run_sweep(grid, ctx, backends.PoolBackend(ctx, 2), store)
    status = {(p["max_num_seqs"], p["rate"]): p["status"] for p in out.points}
    assert status == {
        (n, r): "error" if r == 4.0 else "ok" for n in (1, 2) for r in (1.0, 2.0, 4.0, 8.0)
    }


def test_rejected_and_invalid_configs_are_rows_not_crashes(tmp_path: Path, capsys):
    # Without chunked prefill: 64 tokens reject every prompt; 16384 exceeds the batch
    # budget (an invalid combination); the model's own limit serves all 60 requests.
    grid = {"max_model_len": [64, 16384, None], "enable_chunked_prefill": False}
    grid |= {"cost_model": "analytic", "rate": [1, 4]}
    assert sweep(tmp_path, "r", "--workers", "1", "--no-plot", grid=grid) == 0
    rows = json.loads((tmp_path / "r" / "sweep.json").read_text())["configs"]
    assert [r["status"] for r in rows] == ["ok", "rejected", "invalid"]
    assert rows[0]["max_rate"] == 4.0 and "max_model_len" in rows[1]["note"]


@pytest.mark.parametrize(
    ("argv", "needle"),
    [
        (["--max-num-seq", "4"], "--max-num-seq"),
        (["--max-num-seqs", "4,x"], "max_num_seqs"),
        (["--workers", "0"], "--workers"),
        (["--rates", "1,-2"], "rate"),
    ],
)
def test_a_bad_flag_is_one_line_naming_it_and_exit_2(tmp_path: Path, capsys, argv, needle):
    with pytest.raises(SystemExit) as e:  # argparse's errors exit; ours return 2
        code = main(["sweep", "--slo", "ttft_p99:1", "--out", str(tmp_path), *argv])
        raise SystemExit(code)
    err = capsys.readouterr().err
    assert e.value.code == 2 and needle in err and err.count("\n") == 1, err


def test_a_bad_grid_file_is_one_line_and_exit_2(tmp_path: Path, capsys):
    bad = tmp_path / "bad.yaml"
    bad.write_text("max_num_seqs: [8]\nwatermark: [0.5]\n")
    assert main(["sweep", "--grid", str(bad), "--slo", "ttft_p99:1", "--out", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert "'watermark'" in err and str(bad) in err and err.count("\n") == 1


CLUSTER = {
    "pools": [
        {"name": "prefill", "role": "prefill", "count": 1},
        {"name": "decode", "role": "decode", "count": 1},
    ]
}


def test_a_cluster_sweep_ranks_plans_by_cost_per_million_tokens(tmp_path: Path, capsys):
    grid = {
        "cluster": CLUSTER,
        "cluster.pools.decode.count": [1, 3],
        "cluster.decode_router": ["least-kv", "round-robin"],
        "cost_model": "analytic",
        "rate": [1, 4],
    }
    assert sweep(tmp_path, "c", "--workers", "1", grid=grid) == 0
    rows = json.loads((tmp_path / "c" / "sweep.json").read_text())["configs"]
    assert len(rows) == 4 and all(r["status"] == "ok" and r["max_rate"] == 4.0 for r in rows)
    costs = [r["per_million_output_tokens"] for r in rows]
    assert costs == sorted(costs)  # best (cheapest) first at the same max rate
    assert [r["gpus"] for r in rows] == [2, 2, 4, 4]
    assert (tmp_path / "c" / "pareto.png").exists()
    assert "decode.count=1" in capsys.readouterr().out


@pytest.mark.parametrize(
    ("raw", "needle"),
    [
        ({"cluster.router": ["round-robin"]}, "no base cluster"),
        ({"cluster": CLUSTER, "cluster.pools.middle.count": [1]}, "no pool named 'middle'"),
        ({"cluster": "missing.yaml"}, "cannot read"),
    ],
)
def test_a_bad_cluster_grid_names_the_key(raw: dict, needle: str):
    with pytest.raises(ValueError, match=needle):
        build_grid(raw, "g.yaml")


def test_a_cluster_knob_with_a_wrong_value_is_an_invalid_row():
    grid = build_grid({"cluster": CLUSTER, "cluster.pools.decode.count": [1, 0]}, "g.yaml")
    assert len(grid.configs) == 1
    assert "count 0" in grid.invalid[0][1]
