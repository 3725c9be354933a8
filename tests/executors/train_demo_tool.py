"""The demo model's training tool, examples/train_demo, for tests.

The tool lives outside the engine's import path (examples/ is not installed), so
tests reach it as the package `examples.train_demo` from the repository root, the
way its command runs it (`python -m examples.train_demo.train`).
"""

from __future__ import annotations

import importlib
import sys
from pathlib import Path
from types import ModuleType

REPO = Path(__file__).resolve().parents[2]
TOOL_DIR = REPO / "examples" / "train_demo"


def train_demo(module: str) -> ModuleType:
    """`examples.train_demo.<module>` from this checkout (not some other `examples`)."""
    if str(REPO) not in sys.path:
        sys.path.insert(0, str(REPO))
    mod = importlib.import_module(f"examples.train_demo.{module}")
    assert Path(mod.__file__).resolve().is_relative_to(TOOL_DIR), mod.__file__
    return mod
