"""`deepinfer simulate` as a user runs it: exit codes, report, plots."""

from __future__ import annotations

import json
import subprocess
import sys
import warnings
from pathlib import Path

import pytest

from deepinfer.entrypoints import cli
from deepinfer.errors import SchedulerStalled
from deepinfer.scheduler_checks import raise_stalled

ROOT = Path(__file__).resolve().parents[2]


def run_cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "deepinfer", *args],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )


def test_simulate_default_trace_prints_summary_and_writes_report_and_plot(tmp_path) -> None:
    out, png = tmp_path / "report.json", tmp_path / "report.png"
    proc = run_cli("simulate", "--out", str(out), "--plot", str(png), "--no-progress")
    assert proc.returncode == 0, proc.stderr
    assert "Successful requests:" in proc.stdout and "Mean TTFT (ms):" in proc.stdout
    report = json.loads(out.read_text())
    assert report["meta"]["num_requests"] == len(report["requests"]) == 400
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


@pytest.mark.parametrize("name", ["example.jsonl", "mooncake_conversation_small.jsonl"])
def test_simulate_runs_on_every_bundled_trace(name: str) -> None:
    proc = run_cli("simulate", f"traces/{name}", "--no-progress", "--max-num-seqs", "64")
    assert proc.returncode == 0, proc.stderr
    assert "Successful requests:" in proc.stdout


def test_malformed_trace_row_exits_2_naming_file_line_and_field(tmp_path) -> None:
    bad = tmp_path / "bad.jsonl"
    bad.write_text(
        '{"id": "a", "arrival": 0, "prompt_len": 10, "output_len": 2}\n'
        '{"id": "b", "arrival": 1, "prompt_len": "ten", "output_len": 2}\n'
    )
    proc = run_cli("simulate", str(bad), "--no-progress")
    assert proc.returncode == 2
    assert f"{bad}:2" in proc.stderr and "prompt_len" in proc.stderr
    assert "Traceback" not in proc.stderr


def test_unknown_model_and_bad_option_exit_2() -> None:
    proc = run_cli("simulate", "--model", "no-such-model", "--no-progress")
    assert proc.returncode == 2 and "no-such-model" in proc.stderr
    proc = run_cli("simulate", "--prefill-watermark", "3", "--no-progress")
    assert proc.returncode == 2 and "prefill_watermark" in proc.stderr


def test_a_stall_exits_3_with_the_diagnosis(monkeypatch, capsys) -> None:
    def stalled(self):  # what a scheduler bug would look like from the outside
        raise_stalled(self)

    monkeypatch.setattr("deepinfer.scheduler.Scheduler.schedule", stalled)
    code = cli.main(["simulate", "traces/example.jsonl", "--no-progress"])
    assert code == 3
    err = capsys.readouterr().err
    assert "stalled" in err and "head of waiting" in err and "watermark" in err


def test_help_explains_every_engine_option() -> None:
    proc = run_cli("simulate", "--help")
    assert proc.returncode == 0
    for flag in (
        "--prefill-watermark",
        "--num-gpu-blocks",
        "--enable-chunked-prefill",
        "--slo",
        "--format",
        "--time-scale",
        "--request-rate",
        "--max-requests",
        "--plot",
    ):
        assert flag in proc.stdout
    assert SchedulerStalled.__name__  # the error type the CLI maps to exit code 3


def test_version_and_one_line_errors_exit_2_without_a_traceback(tmp_path) -> None:
    proc = run_cli("--version")
    assert proc.returncode == 0 and proc.stdout.startswith("deepinfer ")
    proc = run_cli("simulate", str(tmp_path), "--no-progress")  # a directory, not a trace
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    assert proc.stderr.strip().count("\n") == 0 and str(tmp_path) in proc.stderr
    proc = run_cli("--debug", "simulate", str(tmp_path), "--no-progress")
    assert proc.returncode != 0 and "Traceback" in proc.stderr


def test_an_internal_error_is_one_line_exit_1_unless_debug(monkeypatch, capsys) -> None:
    def broken(*args, **kwargs):  # a bug deep inside
        raise KeyError("oops")

    monkeypatch.setattr("sim.simulator.simulate", broken)
    assert cli.main(["simulate", "traces/example.jsonl", "--no-progress"]) == 1
    err = capsys.readouterr().err
    assert "internal error: KeyError" in err and "--debug" in err and "Traceback" not in err
    with pytest.raises(KeyError):
        cli.main(["--debug", "simulate", "traces/example.jsonl", "--no-progress"])


def test_num_requests_and_each_default_shown_once() -> None:
    proc = run_cli("simulate", "--num-requests", "5", "--no-progress", "--out", "/dev/null")
    assert proc.returncode == 0 and "Submitted requests:                      5" in proc.stdout
    for command in ("simulate", "generate", "profile"):
        text = " ".join(run_cli(command, "--help").stdout.split())
        for option in text.split(" --")[1:]:
            assert option.count("(default") <= 1, option


def test_request_rate_retimes_the_trace_as_a_seeded_poisson_process(tmp_path) -> None:
    def arrivals(*flags: str) -> list[float]:
        out = tmp_path / "r.json"
        args = ("simulate", "--num-requests", "200", "--no-progress", "--out", str(out))
        proc = run_cli(*args, *flags)
        assert proc.returncode == 0, proc.stderr
        return sorted(r["arrival"] for r in json.loads(out.read_text())["requests"])

    at_4 = arrivals("--request-rate", "4")
    assert at_4 == arrivals("--request-rate", "4")  # seeded: the same every run
    assert at_4 != arrivals("--request-rate", "4", "--seed", "1")
    gaps = [b - a for a, b in zip(at_4, at_4[1:])]
    assert at_4[0] == 0.0 and abs(sum(gaps) / len(gaps) - 0.25) < 0.06  # mean gap 1/R
    assert arrivals("--request-rate", "inf") == [0.0] * 200
    for bad in (["--request-rate", "0"], ["--request-rate", "2", "--time-scale", "0.5"]):
        proc = run_cli("simulate", "--no-progress", *bad)
        assert proc.returncode == 2 and "--request-rate" in proc.stderr, proc.stderr
        assert "Traceback" not in proc.stderr


def test_batch_invariant_simulation_without_a_profile_of_the_mode_exits_2() -> None:
    """`--batch-invariant true` (or DEEPINFER_BATCH_INVARIANT=1) is never priced at
    normal-mode speed: with no profile measured in the mode the command says how to
    measure one."""
    proc = run_cli("simulate", "--no-progress", "--batch-invariant", "true")
    assert proc.returncode == 2, proc.stderr
    assert "deepinfer profile --model moonlight-16b-a3b --batch-invariant true" in proc.stderr
    assert "Traceback" not in proc.stderr


def test_options_that_cannot_apply_are_refused_not_ignored(capsys) -> None:
    """An acceptance rate without speculation, a mask cost without structured requests:
    both were accepted and changed nothing."""
    trace = "traces/example.jsonl"
    assert cli.main(["simulate", trace, "--acceptance-rate", "0.9", "--no-progress"]) == 2
    assert "--acceptance-rate" in capsys.readouterr().err
    assert cli.main(["simulate", trace, "--grammar-mask-us", "30", "--no-progress"]) == 2
    assert "--grammar-mask-us" in capsys.readouterr().err
    args = ["simulate", trace, "--no-progress", "--num-speculative-tokens", "2"]
    args += ["--model", "executors/demo/deepinfer-demo/config.json"]  # (it has an MTP layer)
    assert cli.main([*args, "--acceptance-rate", "0.9"]) == 0


def test_add_mtp_layer_lets_a_model_without_one_speculate(capsys) -> None:
    """Moonlight ships no MTP layer: `--num-speculative-tokens` alone is refused with the
    flag named; with `--add-mtp-layer` its verify steps are priced from the shipped
    profile's speculative points (no warning that it has none). The flag is refused where
    it would change nothing."""
    trace = ["simulate", "traces/example.jsonl", "--no-progress"]
    assert cli.main([*trace, "--num-speculative-tokens", "3"]) == 2
    assert "--add-mtp-layer" in capsys.readouterr().err
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert cli.main([*trace, "--num-speculative-tokens", "3", "--add-mtp-layer"]) == 0
    assert "calibrated on moonlight-16b-a3b__h200.json" in capsys.readouterr().out
    assert not [w for w in caught if "no verify points" in str(w.message)]
    assert cli.main([*trace, "--add-mtp-layer"]) == 2
    assert "only with --num-speculative-tokens" in capsys.readouterr().err
    demo = ["--model", "executors/demo/deepinfer-demo/config.json"]
    assert cli.main([*trace, *demo, "--num-speculative-tokens", "2", "--add-mtp-layer"]) == 2
    assert "already" in capsys.readouterr().err
