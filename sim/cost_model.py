"""What a simulated step costs: the CostModel protocol and its registry.

The simulator advances its clock by `step_time(out)` (GPU) and, where it
models host overhead, `cpu_time(out)` (which async scheduling can overlap
with the previous step's GPU time). A model with `grammar_mask_per_token_s`
also prices structured outputs: `mask_time(out, per_token)` of host work that
fills the step's token masks while the device runs its forward, so only the
part longer than the device time delays the step.

  "profiled"  measured steps of the real executor, fitted (sim/profiled_cost_model.py);
              the default wherever sim/data/profiles/ holds one for (model, hardware)
  "analytic"  roofline per op group (sim/analytic_cost_model.py): uncalibrated
  "unit"      every non-empty step costs 1 ms, no CPU time: for tests

Batch-invariant mode (EngineConfig.batch_invariant) runs slower kernels: it is priced only
by a profile measured in it (`deepinfer profile --batch-invariant true`, which records
`batch_invariant` in the profile's meta). A profile measured in the other mode, or the
analytic model (which has no measurement of the mode), is refused rather than silently
predicting the normal speed (`check_mode`).
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

from deepinfer.model_config import ModelConfig
from sim.analytic_cost_model import AnalyticCostModel, GroupCost, expected_distinct_experts
from sim.cost_coefficients import CostCoefficients, load_cost_coefficients
from sim.hardware import HardwareSpec
from sim.kv_capacity import default_activation_reserve_bytes, kv_capacity_blocks
from sim.profiled_cost_model import ProfiledCostModel, find_profile, profile_path

if TYPE_CHECKING:
    from deepinfer.outputs import SchedulerOutput

__all__ = [
    "AnalyticCostModel",
    "CostCoefficients",
    "CostModel",
    "GroupCost",
    "ProfiledCostModel",
    "UnitCostModel",
    "default_activation_reserve_bytes",
    "expected_distinct_experts",
    "get_cost_model",
    "resolve_cost_model",
    "kv_capacity_blocks",
    "load_cost_coefficients",
    "mask_time",
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


def mask_time(out: SchedulerOutput, per_token_s: float) -> float:
    """Host seconds filling the grammar token masks of `out`'s structured requests: one
    mask per sampled position (each verified draft too)."""
    n = 0
    for r in out.scheduled:
        if r.structured and r.will_sample:
            n += 1 + len(r.draft_token_ids)
    return n * per_token_s


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


def get_cost_model(
    spec: str | CostModel | None,
    model: ModelConfig,
    hardware: HardwareSpec,
    profile: str | Path | None = None,
    num_speculative_tokens: int = 0,
) -> CostModel:
    """A cost model by name, or a cost-model object passed through (see resolve_cost_model)."""
    return resolve_cost_model(spec, model, hardware, profile, num_speculative_tokens)[0]


def resolve_cost_model(
    spec: str | CostModel | None,
    model: ModelConfig,
    hardware: HardwareSpec,
    profile: str | Path | None = None,
    num_speculative_tokens: int = 0,
    batch_invariant: bool = False,
    async_scheduling: bool = False,
) -> tuple[CostModel, dict[str, Any]]:
    """The cost model and what the report says of it: its name, whether it is calibrated
    on the real executor, and the profile it fitted.

    num_speculative_tokens: the drafts the engine's MTP drafter proposes after every
    step (the profiled and analytic models price the drafter's work from it).

    None: "profiled" when `profile` is given or a shipped profile exists for (model,
    hardware) in the engine's mode, else "analytic" (uncalibrated). An object needs
    `step_time(out)`; one without `cpu_time` is wrapped so its host time reads as zero.
    batch_invariant: the engine's mode; a cost model that cannot price it is refused
    (`check_mode`). async_scheduling: the engine launches a step while the one before
    runs (the profiled model then prices steps from the profile's pipelined times).
    """
    cost, meta = _resolve(
        spec, model, hardware, profile, batch_invariant, num_speculative_tokens, async_scheduling
    )
    check_mode(cost, batch_invariant, model.name, hardware.name)
    return cost, meta


def check_mode(cost: Any, batch_invariant: bool, model: str, hardware: str) -> None:
    """ValueError when `cost` would price the other mode's kernels: a profile measured
    with batch_invariant different from the engine's, or the analytic model for a
    batch-invariant engine. The unit model and other objects price no kernels: accepted."""
    howto = (
        f"measure one with `deepinfer profile --model {model} --batch-invariant true --out "
        f"{profile_path(model, hardware, True)}` (on the GPU) and pass it, or use cost "
        "model 'unit'"
    )
    if isinstance(cost, ProfiledCostModel):
        measured = bool(cost.meta.get("batch_invariant", False))
        if measured != batch_invariant:
            raise ValueError(
                f"batch_invariant={batch_invariant}: profile {cost.profile_name} was measured "
                f"with batch_invariant={measured}, whose kernels run at another speed; "
                + (howto if batch_invariant else "pass a profile measured without the mode")
            )
    elif isinstance(cost, AnalyticCostModel) and batch_invariant:
        raise ValueError(
            "batch_invariant=True: the analytic cost model has no measurement of the "
            f"batch-invariant kernels and would predict normal-mode speed; {howto}"
        )


def _resolve(
    spec: str | CostModel | None,
    model: ModelConfig,
    hardware: HardwareSpec,
    profile: str | Path | None,
    batch_invariant: bool,
    num_speculative_tokens: int,
    async_scheduling: bool = False,
) -> tuple[CostModel, dict[str, Any]]:
    if spec is None:
        found = find_profile(model.name, hardware.name, batch_invariant)
        spec = "profiled" if profile is not None or found else "analytic"
    if isinstance(spec, str):
        key = spec.strip().lower()
        if key == "profiled":
            path = (
                Path(profile)
                if profile is not None
                else find_profile(model.name, hardware.name, batch_invariant)
            )
            if path is None:
                raise ValueError(
                    f"no profile of {model.name!r} on {hardware.name!r} (looked for "
                    f"{profile_path(model.name, hardware.name, batch_invariant)}); measure one with `deepinfer "
                    f"profile --model {model.name} --out PROFILE.json` and pass it, or use "
                    "cost model 'analytic'"
                )
            cost = ProfiledCostModel(
                path, model, hardware, num_speculative_tokens, async_scheduling=async_scheduling
            )
            meta: dict[str, Any] = {
                "cost_model": "profiled",
                "calibrated": True,
                "profile": str(path),
            }
            if async_scheduling:  # whether overlapped steps are measured or taken as serial
                meta["async_steps"] = "pipelined" if cost.pipelined else "sequential"
            if num_speculative_tokens:  # whether verify steps are measured or guessed
                meta["verify_steps"] = "profiled" if cost.prices_speculation else "analytic"
            return cost, meta
        if profile is not None:
            raise ValueError(f"a profile was given with cost model {spec!r}; use 'profiled'")
        if key == "analytic":
            cost_a = AnalyticCostModel(
                model, hardware, load_cost_coefficients(), num_speculative_tokens
            )
            return cost_a, {"cost_model": "analytic", "calibrated": False}
        if key == "unit":
            return UnitCostModel(), {"cost_model": "unit", "calibrated": False}
        raise ValueError(
            f"unknown cost model {spec!r}; known: 'profiled', 'analytic', 'unit', or an object"
        )
    if not callable(getattr(spec, "step_time", None)):
        raise TypeError(
            f"cost model {spec!r} has no step_time(out) method; pass 'profiled', 'analytic', "
            "'unit' or an object with step_time"
        )
    meta = {"cost_model": type(spec).__name__, "calibrated": isinstance(spec, ProfiledCostModel)}
    if not callable(getattr(spec, "cpu_time", None)):
        return _ZeroCpuTime(spec), meta
    return spec, meta
