"""Hypothesis profiles for the property suite.

`ci` (the default) keeps the whole of tests/property within about three minutes
on two cores and is derandomized, so a CI failure reproduces exactly;
`HYPOTHESIS_PROFILE=deep` runs many more examples from fresh random seeds;
`mutation` (derandomized, 10 examples a test before scaling) is what mutmut runs for each
mutant (tests/property/MUTATION.md).
Under CI=true no example database is written: failing seeds stay local, and
the shrunk examples worth keeping live on as tests in tests/core/test_regressions.py.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from hypothesis import HealthCheck, settings

from tests.property.coverage import TRANSITIONS

_SLOW_OK = [HealthCheck.too_slow, HealthCheck.data_too_large, HealthCheck.filter_too_much]
_DB = {"database": None} if os.environ.get("CI", "").lower() == "true" else {}

settings.register_profile(
    "ci",
    max_examples=300,
    deadline=None,
    derandomize=True,
    print_blob=True,
    suppress_health_check=_SLOW_OK,
    **_DB,
)
settings.register_profile(
    "deep",
    max_examples=5000,
    deadline=None,
    derandomize=False,
    print_blob=True,
    suppress_health_check=_SLOW_OK,
    **_DB,
)
settings.register_profile(
    "mutation",
    max_examples=10,
    deadline=None,
    derandomize=True,
    print_blob=False,
    suppress_health_check=_SLOW_OK,
    database=None,
)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter) -> None:
    """The transitions the run reached (tests/property/coverage.py), when any test here
    drove an engine."""
    if TRANSITIONS.counts:
        terminalreporter.write_line(TRANSITIONS.report())
        if _gated(terminalreporter.config):
            for line in TRANSITIONS.below_floor():
                terminalreporter.write_line(f"  below its floor: {line}", red=True)


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    """A whole run of this directory under the `ci` profile fails when a transition was
    reached fewer times than its floor (coverage.FLOOR): the run did not test it."""
    if exitstatus == 0 and _gated(session.config) and TRANSITIONS.below_floor():
        session.exitstatus = pytest.ExitCode.TESTS_FAILED


def _gated(config: pytest.Config) -> bool:
    """The floors hold for the `ci` profile's examples over every test of this directory:
    not under another profile, a keyword or marker selection, or a subset of its files."""
    if os.environ.get("HYPOTHESIS_PROFILE", "ci") != "ci":
        return False
    if config.option.keyword or config.option.markexpr or getattr(config.option, "lf", False):
        return False
    here = Path(__file__).parent
    ran = {Path(str(item.path)) for item in config._property_items}  # type: ignore[attr-defined]
    return ran >= set(here.glob("test_*.py"))


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    here = Path(__file__).parent
    config._property_items = [i for i in items if Path(str(i.path)).parent == here]  # type: ignore[attr-defined]
