"""The demo model's training tool (examples/train_demo) stays runnable, documented and
out of the engine: its CLI starts, the checkpoint's README.md is what the tool's
readme.py writes for the recorded run, and nothing the package installs imports it.
"""

from __future__ import annotations

import ast
import json
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

from executors.demo import DEMO_MODEL_DIR
from tests.executors.train_demo_tool import REPO, train_demo

COMMAND = "python -m examples.train_demo.train"
ENGINE_PACKAGES = ("deepinfer", "sim", "executors", "kernels")
TOOL_MODULES = ("train", "corpus", "evaluate", "modeling", "checkpoint", "readme")


def test_cli_help_runs_from_the_repository_root() -> None:
    """`python -m examples.train_demo.train --help` imports the whole tool and exits 0."""
    pytest.importorskip("torch")
    pytest.importorskip("safetensors")
    proc = subprocess.run(
        [sys.executable, "-m", "examples.train_demo.train", "--help"],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.startswith(f"usage: {COMMAND} ")
    for flag in ("--out", "--device", "--minutes", "--seed"):
        assert flag in proc.stdout


def test_running_train_py_as_a_file_names_the_command() -> None:
    proc = subprocess.run(
        [sys.executable, "examples/train_demo/train.py", "--help"],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode != 0
    assert COMMAND in proc.stderr


def test_engine_packages_do_not_import_the_training_tool() -> None:
    """executors/demo/ keeps only the loader and the checkpoint; no module of the
    installed packages imports examples/ or a training module from its old home."""
    demo = REPO / "executors" / "demo"
    kept = sorted(p.name for p in demo.iterdir() if p.name != "__pycache__")
    assert kept == ["__init__.py", "deepinfer-demo"]
    old = {f"executors.demo.{m}" for m in TOOL_MODULES}
    offenders = []
    for package in ENGINE_PACKAGES:
        for path in sorted((REPO / package).rglob("*.py")):
            for node in ast.walk(ast.parse(path.read_text(), str(path))):
                if isinstance(node, ast.Import):
                    names = [a.name for a in node.names]
                elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                    names = [node.module, *(f"{node.module}.{a.name}" for a in node.names)]
                else:
                    continue
                for name in names:
                    if name.split(".")[0] == "examples" or name in old:
                        offenders.append(f"{path.relative_to(REPO)}:{node.lineno}: {name}")
    assert not offenders, offenders


@pytest.mark.skipif(
    not (DEMO_MODEL_DIR / "model.safetensors").is_file(), reason="demo checkpoint not built"
)
def test_checkpoint_readme_is_what_the_tool_writes(tmp_path: Path) -> None:
    """The command in the checkpoint's README.md parses to the arguments eval.json
    records, and readme.py fills its template from eval.json into exactly README.md."""
    pytest.importorskip("torch")
    pytest.importorskip("safetensors")
    train, readme = train_demo("train"), train_demo("readme")
    shipped = (DEMO_MODEL_DIR / "README.md").read_text()
    command = re.search(r"## Training\n\n```\n(.+)\n```", shipped).group(1)
    assert command.startswith(COMMAND + " ")
    argv = shlex.split(command.removeprefix(COMMAND + " "))
    report = json.loads((DEMO_MODEL_DIR / "eval.json").read_text())
    args = {
        k: str(v) if isinstance(v, Path) else v for k, v in vars(train.parse_args(argv)).items()
    }
    assert args == report["args"]
    readme.write_readme(tmp_path, readme.fields(DEMO_MODEL_DIR, report, args, argv))
    assert (tmp_path / "README.md").read_text() == shipped
