"""What a simulated step costs: the CostModel protocol and its registry.

The simulator advances its clock by `step_time(out)` (GPU) and, where it
models host overhead, `cpu_time(out)` (which async scheduling can overlap
with the previous step's GPU time).

  "unit"      every non-empty step costs 1 ms, no CPU time: for tests
  "analytic"  roofline per op group (sim/analytic_cost_model.py)
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Protocol, runtime_checkable

from deepinfer.model_config import ModelConfig
from sim.analytic_cost_model import AnalyticCostModel, GroupCost, expected_distinct_experts
from sim.cost_coefficients import CostCoefficients, load_cost_coefficients
from sim.hardware import HardwareSpec
from sim.kv_capacity import default_activation_reserve_bytes, kv_capacity_blocks

if TYPE_CHECKING:
    from deepinfer.outputs import SchedulerOutput

__all__ = [
    "AnalyticCostModel",
    "CostCoefficients",
    "CostModel",
    "GroupCost",
    "UnitCostModel",
    "default_activation_reserve_bytes",
    "expected_distinct_experts",
    "get_cost_model",
    "kv_capacity_blocks",
    "load_cost_coefficients",
]


@runtime_checkable
class CostModel(Protocol):
    """Prices one step. Pure: the same SchedulerOutput always costs the same."""

    def step_time(self, out: SchedulerOutput) -> float:
        """GPU seconds to execute `out`; 0.0 for an empty step."""
        ...

    def cpu_time(self, out: SchedulerOutput) -> float:
        """Host seconds spent around `out` (scheduling, input prep, output processing)."""
        ...


class UnitCostModel:
    """Every non-empty step costs `step_seconds`; host time is `cpu_seconds` (default 0)."""

    def __init__(self, step_seconds: float = 0.001, cpu_seconds: float = 0.0):
        if step_seconds < 0 or cpu_seconds < 0:
            raise ValueError("UnitCostModel: step_seconds and cpu_seconds must be >= 0")
        self.step_seconds = step_seconds
        self.cpu_seconds = cpu_seconds

    def step_time(self, out: SchedulerOutput) -> float:
        return self.step_seconds if out.scheduled else 0.0

    def cpu_time(self, out: SchedulerOutput) -> float:
        return self.cpu_seconds if out.scheduled else 0.0


class _ZeroCpuTime:
    """Adapts a user object that only has step_time: its host time is zero."""

    def __init__(self, inner: object):
        self.inner = inner

    def step_time(self, out: SchedulerOutput) -> float:
        return self.inner.step_time(out)  # type: ignore[attr-defined]

    def cpu_time(self, out: SchedulerOutput) -> float:
        return 0.0


def get_cost_model(spec: str | CostModel, model: ModelConfig, hardware: HardwareSpec) -> CostModel:
    """A cost model by name ("analytic" or "unit"), or a cost-model object passed through.

    An object needs `step_time(out)`; one without `cpu_time` is wrapped so its
    host time reads as zero.
    """
    if isinstance(spec, str):
        key = spec.strip().lower()
        if key == "analytic":
            return AnalyticCostModel(model, hardware, load_cost_coefficients())
        if key == "unit":
            return UnitCostModel()
        raise ValueError(f"unknown cost model {spec!r}; known: 'analytic', 'unit', or an object")
    if not callable(getattr(spec, "step_time", None)):
        raise TypeError(
            f"cost model {spec!r} has no step_time(out) method; pass 'analytic', 'unit' "
            f"or an object with step_time"
        )
    if not callable(getattr(spec, "cpu_time", None)):
        return _ZeroCpuTime(spec)
    return spec
