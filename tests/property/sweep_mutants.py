"""Sweep mutmut's mutants in one process: each mutant switched on in turn (mutmut's
trampoline reads MUTANT_UNDER_TEST at every call) while tests/property's tests run, the
first failure killing it. Much faster than `mutmut run` on a few cores: no process and no
import per mutant.

    nice env HYPOTHESIS_PROFILE=mutation python -m mutmut run "zzz_nothing*"  # mutants/ only
    cd mutants && PYTHONPATH=$PWD python ../tests/property/sweep_mutants.py NAMES.txt > OUT.tsv

NAMES.txt: mutant names, one a line (`mutmut results --all true` lists them). Prints a
line per mutant, `NAME<TAB>KILLED by TEST: ERROR` or `SURVIVED`, and the time it took,
after a first line for no mutant (every test must pass there). The tests are the
hypothesis tests and state machines of tests/property that take no arguments, under the
HYPOTHESIS_PROFILE (default: mutation), explicit examples and generation only (no
shrinking: whether a mutant dies does not depend on it). A mutant still running after
SWEEP_LIMIT seconds (default 240) counts as killed, as mutmut counts a timeout.
Parametrized tests and machines built with arguments are not run: judge a survivor
against them with check_mutant.sh.
"""

from __future__ import annotations

import importlib
import inspect
import os
import signal
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

os.environ.setdefault("HYPOTHESIS_PROFILE", "mutation")

from hypothesis import Phase, settings  # noqa: E402
from hypothesis.stateful import RuleBasedStateMachine, run_state_machine_as_test  # noqa: E402

import tests.property.conftest  # noqa: E402,F401  (registers and loads the profiles)

PHASES = [Phase.explicit, Phase.generate]
# Tests that cannot run in a sweep's process (their state outlives one run).
SKIP = {"test_a_stop_string_ends_the_request_on_the_token_that_completes_it"}


class Hung(BaseException):  # (not an Exception: neither hypothesis nor the engine takes it)
    pass


def property_tests() -> list[tuple[str, Any]]:
    """(name, test) of every argument-free hypothesis test and state machine of
    tests/property, in file order."""
    found = []
    package = importlib.import_module("tests.property")  # (mutants/'s copy, run from there)
    for path in sorted(Path(str(package.__file__)).parent.glob("test_*.py")):
        module = importlib.import_module(f"tests.property.{path.stem}")
        for name, obj in vars(module).items():
            if name in SKIP or getattr(obj, "__module__", None) != module.__name__:
                continue
            if isinstance(obj, type) and issubclass(obj, RuleBasedStateMachine):
                if len(inspect.signature(obj.__init__).parameters) == 1:
                    found.append((name, obj))
            elif name.startswith("test_") and callable(obj):
                marks = getattr(obj, "pytestmark", [])
                if any(m.name == "parametrize" for m in marks):
                    continue
                if not inspect.signature(obj).parameters:  # (fixtures: pytest's to give)
                    found.append((name, obj))
    return found


def run(test: Any) -> None:
    """One test, without shrinking or the example database."""
    if isinstance(test, type):
        s = settings(test.TestCase.settings, phases=PHASES, database=None)
        run_state_machine_as_test(test, settings=s)
        return
    if hasattr(test, "hypothesis"):
        given = test._hypothesis_internal_use_settings
        test._hypothesis_internal_use_settings = settings(given, phases=PHASES, database=None)
    test()


def _hung(signum: int, frame: Any) -> None:
    raise Hung("over SWEEP_LIMIT (counted detected, as mutmut counts a timeout)")


def sweep(
    names: list[str], tests: list[tuple[str, Any]], limit: float, out: Callable[[str], None]
) -> None:
    """Each mutant of `names` against `tests` until one fails; a line each to `out`."""
    signal.signal(signal.SIGALRM, _hung)
    for name in ["<none>", *names]:
        os.environ["MUTANT_UNDER_TEST"] = "" if name == "<none>" else name
        start = time.time()
        verdict = "SURVIVED"
        signal.setitimer(signal.ITIMER_REAL, limit)
        for test_name, test in tests:
            try:
                run(test)
            except BaseException as e:  # (a mutant may raise anything, SystemExit too)
                signal.setitimer(signal.ITIMER_REAL, 0)
                first = (str(e).splitlines() or [""])[0][:140]
                verdict = f"KILLED by {test_name}: {type(e).__name__}: {first}"
                break
        signal.setitimer(signal.ITIMER_REAL, 0)
        out(f"{name}\t{verdict}\t{time.time() - start:.1f}s")


def main() -> None:
    if len(sys.argv) != 2:
        sys.exit(__doc__)
    names = [line.strip() for line in Path(sys.argv[1]).read_text().splitlines() if line.strip()]
    limit = float(os.environ.get("SWEEP_LIMIT", "240"))
    sweep(names, property_tests(), limit, lambda line: print(line, flush=True))


if __name__ == "__main__":
    main()
