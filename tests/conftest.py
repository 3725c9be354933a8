"""Shared pytest setup: GPU tests skip without CUDA, and give the device back after."""

from __future__ import annotations

import gc
import sys
from collections.abc import Iterator

import pytest


def _has_cuda() -> bool:
    try:
        import torch
    except ImportError:
        return False
    return torch.cuda.is_available()


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if _has_cuda():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(autouse=True)
def _free_the_device(request: pytest.FixtureRequest) -> Iterator[None]:
    """After a GPU test, collect what it left (engines hold reference cycles) so that the
    next test's engine can take its gpu_memory_utilization of the device."""
    yield
    torch = sys.modules.get("torch")
    if "gpu" in request.keywords and torch is not None and torch.cuda.is_available():
        gc.unfreeze()  # (a CUDA executor froze its start-up heap: executors/warmup.py)
        gc.collect()
        torch.cuda.empty_cache()
