"""`deepinfer profile install`: a re-measured profile is compared point by point with the
shipped one before it replaces it, and gets the commit it was measured at."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from deepinfer.entrypoints.cli import main
from deepinfer.entrypoints.cli import profile_install as install


def _point(kind: str, batch: int, median: float, pipelined: float | None = None) -> dict:
    p = {"kind": kind, "groups": [[batch, 1, 256, False]], "median_s": median}
    if pipelined is not None:
        p["pipelined_s"] = pipelined
    return p


def _profile(points: list[dict], commit: str = "stale") -> dict:
    return {"version": 1, "model": "m", "meta": {"commit": commit, "commit_dirty": True},
            "points": points}  # fmt: skip


def test_ratios_are_taken_over_the_points_both_measured() -> None:
    old = _profile(
        [_point("decode", 1, 2.0, 1.0), _point("decode", 8, 4.0), _point("mixed", 8, 1.0)]
    )
    new = _profile(
        [_point("decode", 1, 1.0, 0.5), _point("decode", 8, 4.0), _point("decode", 64, 9.0)]
    )
    table = install.compare(new, old)
    assert set(table) == {"decode"}  # the mixed point was not re-measured; batch 64 is new
    row = table["decode"]
    assert row["points"] == 2
    assert row["median_ratio"] == pytest.approx(0.75)  # median of 0.5 and 1.0
    assert row["pipelined_ratio"] == pytest.approx(0.5)  # only batch 1 has both
    assert row["largest_moves"][0][0] == pytest.approx(0.5)


def test_install_sets_the_commit_measured(tmp_path: Path, monkeypatch) -> None:
    shipped = tmp_path / "shipped"
    shipped.mkdir()
    (shipped / "m__h200.json").write_text(json.dumps(_profile([_point("decode", 1, 2.0)])))
    fresh = tmp_path / "m__h200.json"
    fresh.write_text(json.dumps(_profile([_point("decode", 1, 1.0)])))
    monkeypatch.setattr("sim.profiled_cost_model.PROFILES_DIR", shipped)
    assert main(["profile", "install", str(fresh), "--commit", "abc123", "--dry-run"]) == 0
    assert json.loads((shipped / "m__h200.json").read_text())["points"][0]["median_s"] == 2.0
    assert main(["profile", "install", str(fresh), "--commit", "abc123"]) == 0
    got = json.loads((shipped / "m__h200.json").read_text())
    assert got["points"][0]["median_s"] == 1.0
    assert got["meta"]["commit"] == "abc123" and got["meta"]["commit_dirty"] is False


def test_moves_rank_by_factor_either_way() -> None:
    """2.5x faster moved more than 1.8x slower (|log| of the ratio, not |ratio - 1|)."""
    old = _profile([_point("decode", 1, 1.0), _point("decode", 8, 1.0)])
    new = _profile([_point("decode", 1, 0.4), _point("decode", 8, 1.8)])
    moves = install.compare(new, old)["decode"]["largest_moves"]
    assert [m[0] for m in moves] == pytest.approx([0.4, 1.8])
