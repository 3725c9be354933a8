"""The held-out check of a profile's grid per step kind (sim/grid_check.py)."""

from __future__ import annotations

import copy
import warnings
from typing import Any

import pytest

from deepinfer.model_config import load_model_config
from sim.grid_check import KindCheck, _folds, _short, check_grid, point_kind, step_kind
from sim.hardware import get_hardware
from sim.profile_fit import shape_output
from sim.profiled_cost_model import ProfiledCostModel, load_profile, profile_path

MODEL = "moonlight-16b-a3b"


def _small_profile() -> dict[str, Any]:
    """The shipped profile's plain steps on a few batches and contexts, a few prompt
    chunks and host samples: a profile the cost model fits in milliseconds."""
    data = load_profile(profile_path(MODEL, "h200"))

    def kept(p: dict[str, Any]) -> bool:
        (count, q, ctx, *_), *more = p["groups"]
        if p.get("drafter"):
            return False
        if p["kind"] == "decode":
            return count in (1, 4, 16, 64) and ctx in (256, 1024, 4096)
        return bool(more) or q in (256, 1024)  # every mixed step; chunks of two sizes

    keep = [p for p in data["points"] if kept(p)]
    return dict(data, points=keep, host=data["host"][:12])


def _spec_hw():  # type: ignore[no-untyped-def]
    return load_model_config(MODEL), get_hardware("h200")


def test_a_held_out_point_is_priced_by_a_fit_that_never_saw_it() -> None:
    """A planted outlier (one decode node ten times its measured time): the fit of the
    whole profile prices it near its planted time (the surface passes through it), and
    the check prices it from the other points, near its true time: a fold never fits on
    the points it holds out."""
    profile = _small_profile()
    planted = copy.deepcopy(profile)
    i = next(
        i for i, p in enumerate(planted["points"])
        if p["kind"] == "decode" and p["groups"][0][:3] == [16, 1, 1024]
    )  # fmt: skip
    true_s = planted["points"][i]["median_s"]
    planted["points"][i]["median_s"] = 10 * true_s
    spec, hw = _spec_hw()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        whole = ProfiledCostModel(planted, spec, hw)
    assert whole.step_time(shape_output(planted["points"][i]["groups"])) > 3 * true_s
    for folds in (0, 3):
        check = check_grid(planted, spec, hw, folds)
        decode = check.kinds["decode"]
        outlier = decode.errors[decode.items.index(i)]
        assert outlier == pytest.approx(-0.9, abs=0.03), folds  # priced near true_s


def test_leave_one_out_and_k_fold_hold_out_every_point_once() -> None:
    kinds = ["decode"] * 5 + ["mixed"] * 3 + ["verify"]
    assert _folds(kinds, 0) == [0, 1, 2, 3, 4, 5, 6, 7, -1]  # one verify: nothing to fit it
    assert _folds(kinds, 2) == [0, 1, 0, 1, 0, 0, 1, 0, -1]  # each kind spread over the folds
    with pytest.raises(ValueError, match="folds=1"):
        check_grid(_small_profile(), *_spec_hw(), folds=1)


def test_the_check_reports_each_kind_and_the_kinds_the_grid_lacks() -> None:
    profile = _small_profile()
    check = check_grid(profile, *_spec_hw(), folds=3)
    assert {"decode", "mixed", "lone_chunk", "prefix_chunk", "host"} <= set(check.kinds)
    assert {"verify", "draft"} <= set(check.uncovered)
    assert check.kinds["host"].reqs[1] == max(h["num_reqs"] for h in profile["host"])
    table = check.table()
    assert "verify" in table and "not covered" in table and "3-fold" in table
    for kind, row in check.to_dict()["kinds"].items():
        assert row["points"] == len(check.kinds[kind].errors) >= 2
        assert row["meets_targets"] == (row["median_abs"] <= 0.03 and row["p90_abs"] <= 0.08)


def test_a_step_kind_reads_the_shape() -> None:
    def kind(groups: list[list[Any]], drafter: bool = False) -> str:
        return step_kind(shape_output(groups), drafter)

    assert kind([[8, 1, 512, False]]) == "decode"
    assert kind([[8, 1, 512, False]], drafter=True) == "draft"
    assert kind([[1, 512, 0, True]]) == "lone_chunk"
    assert kind([[1, 512, 4096, True]]) == "prefix_chunk"
    assert kind([[4, 64, 0, True]]) == "prefill"
    assert kind([[4, 1, 512, False], [1, 256, 0, True]]) == "mixed"
    assert kind([[4, 3, 512, False, 2]], drafter=True) == "verify"
    assert point_kind({"groups": [[4, 3, 512, False, 2]], "drafter": 2}) == "verify"


def test_kinds_that_stop_short_of_the_grids_reach_are_named() -> None:
    def kind(name: str, reqs: int, context: int) -> KindCheck:
        return KindCheck(name, (0.01, -0.01), (0, 1), (1, reqs), (1, 1), (257, context))

    checked = {
        "decode": kind("decode", 512, 65537),
        "verify": kind("verify", 512, 4100),
        "mixed": kind("mixed", 241, 40000),
        "host": kind("host", 256, 0),
    }
    short = _short(checked)
    assert len(short) == 2
    assert short[0].startswith("verify: contexts up to 4100, the grid's steps reach 65537")
    assert short[1] == "host: samples up to 256 requests, the grid's steps reach 512"
