"""Shared pytest setup: GPU tests skip without CUDA, and give the device back after; the
property suite's coverage floors (tests/property/coverage.py) are judged over the whole
run, also when pytest-xdist spreads it over worker processes."""

from __future__ import annotations

import gc
import os
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.property.coverage import TRANSITIONS

PROPERTY_DIR = Path(__file__).parent / "property"


def _has_cuda() -> bool:
    try:
        import torch
    except ImportError:
        return False
    return torch.cuda.is_available()


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    config._collected_files = {Path(str(i.path)) for i in items}  # type: ignore[attr-defined]
    if _has_cuda():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(autouse=True, scope="session")
def _own_fit_cache(tmp_path_factory: pytest.TempPathFactory) -> Iterator[None]:
    """Profile fits memoised in this session's own folder (sim/fit_cache.py): a test never
    reads an entry another run stored."""
    patch = pytest.MonkeyPatch()
    patch.setenv("DEEPINFER_CACHE_DIR", str(tmp_path_factory.mktemp("fit-cache")))
    yield
    patch.undo()


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


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter) -> None:
    """The transitions the run reached, when any property test drove an engine."""
    if _is_worker(terminalreporter.config) or not TRANSITIONS.counts:
        return
    terminalreporter.write_line(TRANSITIONS.report())
    if _gated(terminalreporter.config):
        for line in TRANSITIONS.below_floor():
            terminalreporter.write_line(f"  below its floor: {line}", red=True)


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    """A whole run of tests/property under the `ci` profile fails when a transition was
    reached fewer times than its floor (coverage.FLOOR): the run did not test it. An
    xdist worker counts only its own tests: it hands its counts to the controller, which
    sums them (pytest_testnodedown) and judges."""
    config = session.config
    if _is_worker(config):
        config.workeroutput["transitions"] = dict(TRANSITIONS.counts)  # type: ignore[attr-defined]
    elif exitstatus == 0 and _gated(config) and TRANSITIONS.below_floor():
        session.exitstatus = pytest.ExitCode.TESTS_FAILED


@pytest.hookimpl(optionalhook=True)
def pytest_testnodedown(node: object, error: object) -> None:
    """(pytest-xdist, controller) A worker is done: add its counts to the run's."""
    TRANSITIONS.counts.update(getattr(node, "workeroutput", {}).get("transitions", {}))


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_node_collection_finished(node: object, ids: list[str]) -> None:
    """(pytest-xdist, controller) The controller collects nothing: the files run are
    those a worker collected (each collects all)."""
    config = node.config  # type: ignore[attr-defined]
    config._collected_files = {config.rootpath / i.split("::")[0] for i in ids}


def _is_worker(config: pytest.Config) -> bool:
    return hasattr(config, "workerinput")


def _gated(config: pytest.Config) -> bool:
    """The floors hold for the `ci` profile's examples over every test of tests/property:
    not under another profile, a keyword or marker selection, or a subset of its files."""
    if os.environ.get("HYPOTHESIS_PROFILE", "ci") != "ci":
        return False
    if config.option.keyword or config.option.markexpr or getattr(config.option, "lf", False):
        return False
    ran = getattr(config, "_collected_files", set())
    return ran >= set(PROPERTY_DIR.glob("test_*.py"))
