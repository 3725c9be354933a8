"""What a plain simulation and the command line leave unimported: every run pays for
every module it loads, before it simulates anything."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def _loaded(code: str) -> set[str]:
    """The modules a fresh interpreter holds after running `code`."""
    proc = subprocess.run(
        [sys.executable, "-c", f"{code}\nimport sys\nprint(' '.join(sys.modules))"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr
    return set(proc.stdout.split())


def test_one_engine_loads_neither_ranks_nor_routers_nor_clusters() -> None:
    loaded = _loaded(
        "from deepinfer.config import EngineConfig\n"
        "from sim import load_trace, simulate\n"
        "EngineConfig()"
    )
    assert "sim.simulator" in loaded
    assert not {"deepinfer.routing", "sim.data_parallel", "sim.cluster"} & loaded


def test_a_submodule_of_sim_loads_no_engine() -> None:
    loaded = _loaded("import sim.traces")
    assert not {"sim.simulator", "deepinfer.engine", "simpy"} & loaded


def test_the_command_line_loads_no_engine_until_a_command_runs() -> None:
    loaded = _loaded(
        "from deepinfer.entrypoints.cli import build_parser\n"
        "from deepinfer.entrypoints.cli.simulate import _cluster\n"
        "args = build_parser().parse_args(['simulate'])\n"
        "assert _cluster(args, None) is None"
    )
    assert not {"deepinfer.engine", "deepinfer.routing", "sim"} & loaded
