"""The disk memo of profile fits returns exactly what the solver returns, solves again
whenever anything it was keyed on differs or its entry is damaged, and never fails a fit
it cannot store."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from sim.fit_cache import memo_solve
from sim.profile_fit import nnls_relative


@pytest.fixture
def cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setenv("DEEPINFER_CACHE_DIR", str(tmp_path / "cache"))
    return tmp_path / "cache"


def _problem(seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    x = rng.uniform(0.1, 2.0, size=(40, 5))
    return x, x @ np.array([0.5, 0.0, 2.0, 1e-3, 7.0]) + rng.uniform(0.0, 0.01, size=40)


def _entries(cache: Path) -> list[Path]:
    return sorted((cache / "fits").iterdir())


def test_a_stored_fit_is_read_back_bit_for_bit_without_solving(
    cache: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    x, y = _problem()
    first = nnls_relative(x, y)
    assert len(_entries(cache)) == 1
    import scipy.optimize

    def refuse(*args: object, **kwargs: object) -> None:
        raise AssertionError("solved again")

    monkeypatch.setattr(scipy.optimize, "nnls", refuse)
    hit = nnls_relative(x, y)
    assert hit.tobytes() == first.tobytes() and hit.dtype == first.dtype


def test_other_inputs_versions_or_solver_code_are_solved_not_read(cache: Path) -> None:
    x, y = _problem()
    base = nnls_relative(x, y)
    y2 = y.copy()
    y2[3] *= 1.5
    assert nnls_relative(x, y2).tobytes() != base.tobytes()
    calls: list[str] = []

    def one() -> np.ndarray:
        calls.append("one")
        return np.zeros(2)

    def other() -> np.ndarray:  # the same name and inputs, other code
        calls.append("other")
        return np.ones(2)

    assert memo_solve("m", (x,), "v", one).tolist() == [0.0, 0.0]
    assert memo_solve("m", (x,), "v", one).tolist() == [0.0, 0.0]  # (a hit)
    assert memo_solve("m", (x,), "v", other).tolist() == [1.0, 1.0]
    memo_solve("m", (x,), "v2", one)  # another solver version
    memo_solve("m", (x.reshape(20, 10),), "v", one)  # the same bytes in another shape
    memo_solve("m", (np.asfortranarray(x),), "v", one)  # in another memory order
    assert calls == ["one", "other", "one", "one", "one"]


@pytest.mark.parametrize("damage", [b"", b"garbage", None])
def test_a_damaged_entry_is_solved_again_and_replaced(cache: Path, damage: bytes | None) -> None:
    """Empty (a crash before its bytes reached the disk), garbage, or a valid file whose
    result is not the one its digest was taken of."""
    x, y = _problem(1)
    stored = nnls_relative(x, y)
    (entry,) = _entries(cache)
    if damage is None:
        with np.load(entry) as f:
            check = f["digest"]
        with entry.open("wb") as f:
            np.savez(f, result=np.zeros_like(stored), digest=check)
    else:
        entry.write_bytes(damage)
    assert nnls_relative(x, y).tobytes() == stored.tobytes()
    with np.load(entry) as f:
        assert f["result"].tobytes() == stored.tobytes()
    assert _entries(cache) == [entry]  # no temporary left behind


def test_a_fit_is_solved_where_nothing_can_be_stored(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    x, y = _problem(2)
    blocker = tmp_path / "a_file"
    blocker.write_text("not a folder")
    monkeypatch.setenv("DEEPINFER_CACHE_DIR", str(blocker))
    want = nnls_relative(x, y)
    # no folder configured and no home folder to find one under
    monkeypatch.delenv("DEEPINFER_CACHE_DIR")
    monkeypatch.delenv("XDG_CACHE_HOME", raising=False)

    def homeless() -> Path:
        raise RuntimeError("Could not determine home directory.")

    monkeypatch.setattr(Path, "home", staticmethod(homeless))
    assert nnls_relative(x, y).tobytes() == want.tobytes()
