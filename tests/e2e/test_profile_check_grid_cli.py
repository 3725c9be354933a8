"""`deepinfer profile --check-grid PROFILE`: the held-out check of a shipped profile's
grid by step kind, and the options it refuses."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from deepinfer.entrypoints.cli import main
from sim.profiled_cost_model import PROFILES_DIR

ROOT = Path(__file__).resolve().parents[2]
DEMO = str(ROOT / "executors" / "demo" / "deepinfer-demo")
GRID = str(PROFILES_DIR / "deepinfer-demo__cpu.json")


def test_the_shipped_demo_profile_is_checked_by_step_kind(tmp_path: Path, capsys) -> None:  # type: ignore[no-untyped-def]
    out = tmp_path / "check.json"
    code = main([
        "profile", "--check-grid", GRID, "--model", DEMO, "--folds", "3",
        "--check-json", str(out),
    ])  # fmt: skip
    assert code == 0, capsys.readouterr().err
    printed = capsys.readouterr().out
    assert "(3-fold)" in printed and "median <= 3%, p90 <= 8%" in printed
    check = json.loads(out.read_text())
    assert {"decode", "lone_chunk", "prefix_chunk", "verify", "host"} <= set(check["kinds"])
    assert check["too_few"] == ["prefill"]  # the demo grid has one short-prompts step
    for kind, row in check["kinds"].items():
        assert f"  {kind} " in printed
        assert len(row["errors"]) == row["points"]


@pytest.mark.parametrize(
    ("extra", "refused"),
    [
        (["--out", "x.json"], "--out"),
        (["--from-log", "a.jsonl"], "--from-log"),
        (["--reps", "3"], "--reps"),
        (["--max-num-seqs", "8"], "--max-num-seqs"),
    ],
)
def test_options_of_a_measuring_run_are_refused(extra: list[str], refused: str, capsys) -> None:  # type: ignore[no-untyped-def]
    assert main(["profile", "--check-grid", GRID, "--model", DEMO, *extra]) == 2
    assert f"{refused}" in capsys.readouterr().err


def test_the_check_options_need_check_grid(capsys) -> None:  # type: ignore[no-untyped-def]
    assert main(["profile", "--folds", "3", "--out", "x.json"]) == 2
    assert "--folds: only with --check-grid" in capsys.readouterr().err


def test_a_profile_whose_model_does_not_load_asks_for_it(capsys) -> None:  # type: ignore[no-untyped-def]
    assert main(["profile", "--check-grid", GRID]) == 2
    assert "name it with --model" in capsys.readouterr().err
