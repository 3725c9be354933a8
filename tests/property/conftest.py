"""Hypothesis profiles for the property suite.

`ci` (the default) keeps the whole of tests/property within about two minutes on two
cores (its share of the ten CI gives the suite) and is derandomized, so a CI
failure reproduces exactly;
`HYPOTHESIS_PROFILE=deep` runs many more examples from fresh random seeds;
`mutation` (derandomized, 10 examples a test before scaling) is what mutmut runs for each
mutant (tests/property/MUTATION.md).
Under CI=true no example database is written: failing seeds stay local, and
the shrunk examples worth keeping live on as tests in tests/core/test_regressions.py.
"""

from __future__ import annotations

import os

from hypothesis import HealthCheck, settings

_SLOW_OK = [HealthCheck.too_slow, HealthCheck.data_too_large, HealthCheck.filter_too_much]
_DB = {"database": None} if os.environ.get("CI", "").lower() == "true" else {}

settings.register_profile(
    "ci",
    max_examples=150,
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
