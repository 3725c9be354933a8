"""`deepinfer simulate --step-log` then `deepinfer profile --from-log`: the fit, the
kinds it did not cover, the held-out table beside a grid profile's, and the options a
fit from logs refuses."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from deepinfer.entrypoints.cli import main
from sim.profiled_cost_model import PROFILES_DIR

ROOT = Path(__file__).resolve().parents[2]
DEMO = str(ROOT / "executors" / "demo" / "deepinfer-demo")
GRID = str(PROFILES_DIR / "deepinfer-demo__cpu.json")


@pytest.fixture(scope="module")
def sim_log(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("logs") / "sim.jsonl"
    assert main([
        "simulate", str(ROOT / "traces" / "azure_code_small.json"), "--model", DEMO,
        "--hardware", "cpu", "--num-requests", "80", "--num-gpu-blocks", "512",
        "--block-size", "16", "--max-num-seqs", "64", "--max-num-batched-tokens", "1024",
        "--async-scheduling", "false", "--no-progress", "--step-log", str(path),
    ]) == 0  # fmt: skip
    return path


def test_a_profile_from_a_log_with_its_held_out_check(sim_log, tmp_path, capsys) -> None:
    out = tmp_path / "fitted.json"
    code = main([
        "profile", "--from-log", str(sim_log), "--out", str(out), "--held-out", "0.3",
        "--compare", GRID,
    ])  # fmt: skip
    assert code == 0, capsys.readouterr().err
    printed = capsys.readouterr().out
    assert f"-> {out}" in printed
    for kind in ("decode", "prefill", "mixed"):
        assert f"  {kind} " in printed
    assert "held out: the last 30%" in printed and "deepinfer-demo__cpu.json" in printed
    profile = json.loads(out.read_text())
    assert profile["model"] == "deepinfer-demo" and profile["meta"]["hardware"] == "cpu"
    # The simulator takes it like any profile.
    assert main([
        "simulate", str(ROOT / "traces" / "example.jsonl"), "--model", DEMO, "--hardware",
        "cpu", "--profile", str(out), "--num-gpu-blocks", "512", "--block-size", "16",
        "--no-progress",
    ]) == 0  # fmt: skip
    assert "calibrated on fitted.json" in capsys.readouterr().out


def test_another_runs_steps_are_checked_against_the_fit(sim_log, tmp_path, capsys) -> None:
    code = main([
        "profile", "--from-log", str(sim_log), "--out", str(tmp_path / "p.json"),
        "--check", str(sim_log),
    ])  # fmt: skip
    assert code == 0
    assert "steps of 1 other run(s), priced by the fit" in capsys.readouterr().out


@pytest.mark.parametrize(
    "args, says",
    [
        (["--device", "cpu"], "--device: options of a measuring run"),
        (["--max-num-seqs", "8"], "--max-num-seqs: options of a measuring run"),
        (["--compare", GRID], "--compare: with --held-out F or --check LOG"),
        (["--held-out", "1.5"], "--held-out 1.5: a fraction"),
        (["--model", "deepseek-v3"], "was written by"),  # the log's is the demo model
    ],
)
def test_what_a_fit_from_logs_does_not_take_is_refused(
    sim_log, tmp_path, capsys, args: list[str], says: str
) -> None:
    out = tmp_path / "p.json"
    assert main(["profile", "--from-log", str(sim_log), "--out", str(out), *args]) == 2
    assert says in capsys.readouterr().err


def test_its_options_without_from_log_and_bad_logs_exit_2(sim_log, tmp_path, capsys) -> None:
    assert main(["profile", "--base", GRID, "--out", str(tmp_path / "p.json")]) == 2
    assert "--base: only with --from-log LOG" in capsys.readouterr().err
    bad = tmp_path / "bad.jsonl"
    bad.write_text(sim_log.read_text().split("\n")[0] + "\n{oops\n")
    assert main(["profile", "--from-log", str(bad), "--out", str(tmp_path / "p.json")]) == 2
    assert "bad.jsonl:2: not JSON" in capsys.readouterr().err


def test_a_log_whose_model_does_not_load_here_is_named(sim_log, tmp_path, capsys) -> None:
    """The simulator's header keeps --model as given (a relative path): read elsewhere,
    the error names the log and the way out (--model)."""
    moved = tmp_path / "moved.jsonl"
    header, rest = sim_log.read_text().split("\n", 1)
    moved.write_text(header.replace(DEMO, "no/such/model/dir") + "\n" + rest)
    assert main(["profile", "--from-log", str(moved), "--out", str(tmp_path / "p.json")]) == 2
    err = capsys.readouterr().err
    assert "moved.jsonl: its model 'no/such/model/dir' does not load here" in err
    assert "--model" in err
    out = tmp_path / "q.json"
    assert main(["profile", "--from-log", str(moved), "--out", str(out), "--model", DEMO]) == 0
