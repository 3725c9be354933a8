"""`deepinfer bench`: one command for the benchmarks, each with its own options."""

from __future__ import annotations

import pytest

from deepinfer.entrypoints.cli import main
from deepinfer.entrypoints.cli.bench import BENCHMARKS


def test_bench_help_lists_every_benchmark_with_its_line(capsys, monkeypatch) -> None:
    monkeypatch.setenv("COLUMNS", "400")  # one line each: no wrapping inside a line
    with pytest.raises(SystemExit) as exit_:
        main(["bench", "--help"])
    assert exit_.value.code == 0
    text = " ".join(capsys.readouterr().out.split())
    for name, (_, line) in BENCHMARKS.items():
        assert f" {name} {line} " in text


@pytest.mark.parametrize("name", list(BENCHMARKS))
def test_each_benchmark_shows_its_own_options(name: str, capsys) -> None:
    """Everything after the name, --help included, goes to the benchmark's own parser,
    whose usage line names the command."""
    with pytest.raises(SystemExit) as exit_:
        main(["bench", name, "--help"])
    assert exit_.value.code == 0
    out = capsys.readouterr().out
    assert out.startswith(f"usage: deepinfer bench {name} ")
    assert "--" in out.split("\n\n", 1)[1]  # its options


def test_a_benchmarks_bad_option_is_its_usage_error(capsys) -> None:
    with pytest.raises(SystemExit) as exit_:
        main(["bench", "sweep-speed", "--no-such-option"])
    assert exit_.value.code == 2
    assert "deepinfer bench sweep-speed: error: unrecognized arguments" in capsys.readouterr().err
