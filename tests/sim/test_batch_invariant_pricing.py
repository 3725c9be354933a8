"""The simulator never prices batch-invariant mode at normal-mode speed: only a profile
measured in the mode prices it (`deepinfer profile --batch-invariant true` records it in
the profile's meta); a profile of the other mode, or the analytic model, is refused with
a message saying how to measure one."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from deepinfer.config import EngineConfig
from sim import simulate
from sim.profiled_cost_model import profile_path
from sim.traces import TraceRequest

TRACE = [TraceRequest(f"r{i}", 0.01 * i, 200, 8) for i in range(4)]
SHIPPED = profile_path("moonlight-16b-a3b", "h200")


def _profile_in_mode(tmp_path: Path, batch_invariant: bool) -> Path:
    data = json.loads(SHIPPED.read_text())
    data["meta"]["batch_invariant"] = batch_invariant
    path = tmp_path / f"moonlight__bi{int(batch_invariant)}.json"
    path.write_text(json.dumps(data))
    return path


def test_the_analytic_model_refuses_the_mode() -> None:
    with pytest.raises(ValueError, match="batch_invariant=True: the analytic cost model") as e:
        simulate(TRACE, engine=EngineConfig(batch_invariant=True), cost_model="analytic")
    assert "deepinfer profile --model moonlight-16b-a3b --batch-invariant true" in str(e.value)


def test_without_a_profile_of_the_mode_the_default_refuses_instead_of_the_normal_one() -> None:
    """A normal-mode profile of Moonlight on the H200 ships; it does not price the mode."""
    assert SHIPPED.is_file()
    with pytest.raises(ValueError, match="batch_invariant=True"):
        simulate(TRACE, engine=EngineConfig(batch_invariant=True))


def test_a_profile_prices_only_the_mode_it_was_measured_in(tmp_path) -> None:
    binv = _profile_in_mode(tmp_path, True)
    result = simulate(TRACE, engine=EngineConfig(batch_invariant=True), profile=binv)
    assert len(result.requests) == len(TRACE)
    with pytest.raises(ValueError, match="measured with batch_invariant=True"):
        simulate(TRACE, engine=EngineConfig(), profile=binv)
    with pytest.raises(ValueError, match="measured with batch_invariant=False"):
        simulate(TRACE, engine=EngineConfig(batch_invariant=True), profile=SHIPPED)


def test_the_unit_model_prices_no_kernels_and_accepts_the_mode() -> None:
    result = simulate(TRACE, engine=EngineConfig(batch_invariant=True), cost_model="unit")
    assert len(result.requests) == len(TRACE)
