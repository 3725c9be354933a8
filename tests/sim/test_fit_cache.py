"""The disk memo of profile fits returns exactly what the solver returns, solves again
whenever anything it was keyed on differs, and never fails a fit it cannot store."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from sim.fit_cache import cache_dir, memo_solve
from sim.profile_fit import nnls_relative


@pytest.fixture
def cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setenv("DEEPINFER_CACHE_DIR", str(tmp_path / "cache"))
    return tmp_path / "cache"


def _problem(seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    x = rng.uniform(0.1, 2.0, size=(40, 5))
    return x, x @ np.array([0.5, 0.0, 2.0, 1e-3, 7.0]) + rng.uniform(0.0, 0.01, size=40)


def test_a_stored_fit_is_read_back_bit_for_bit_without_solving(cache: Path) -> None:
    x, y = _problem()
    first = nnls_relative(x, y)
    assert list((cache / "fits").iterdir())  # stored
    calls = []
    again = memo_solve("nnls_relative", (x, y), "other", lambda: calls.append(1) or first)
    assert calls  # another solver version is another key
    import scipy

    version = f"{scipy.__version__} {np.__version__}"
    hit = memo_solve("nnls_relative", (x, y), version, lambda: pytest.fail("solved again"))
    assert hit.tobytes() == first.tobytes() and hit.dtype == first.dtype
    assert again.tobytes() == first.tobytes()


def test_other_inputs_are_solved_not_read(cache: Path) -> None:
    x, y = _problem()
    base = nnls_relative(x, y)
    y2 = y.copy()
    y2[3] *= 1.5
    changed = nnls_relative(x, y2)
    assert changed.tobytes() != base.tobytes()
    # the same values in another shape are another problem
    calls = []
    memo_solve("m", (x,), "v", lambda: calls.append(1) or base)
    memo_solve("m", (x.reshape(20, 10),), "v", lambda: calls.append(1) or base)
    assert len(calls) == 2


def test_a_fit_is_solved_where_nothing_can_be_stored_or_read(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    blocker = tmp_path / "a_file"
    blocker.write_text("not a folder")
    monkeypatch.setenv("DEEPINFER_CACHE_DIR", str(blocker))
    x, y = _problem(1)
    assert cache_dir() == blocker
    assert np.array_equal(nnls_relative(x, y), nnls_relative(x, y))
    # a damaged entry is solved again, and replaced
    monkeypatch.setenv("DEEPINFER_CACHE_DIR", str(tmp_path / "ok"))
    stored = nnls_relative(x, y)
    (entry,) = (tmp_path / "ok" / "fits").iterdir()
    entry.write_bytes(b"garbage")
    assert nnls_relative(x, y).tobytes() == stored.tobytes()
    assert np.load(entry).tobytes() == stored.tobytes()
