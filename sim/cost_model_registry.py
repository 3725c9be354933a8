"""The cost models by name, and the one a simulation of (model, hardware) uses.

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
from typing import Any

from deepinfer.config import EngineConfig
from deepinfer.model_config import ModelConfig
from sim.analytic_cost_model import AnalyticCostModel
from sim.cost_coefficients import load_cost_coefficients
from sim.cost_model import CostModel, EngineSettings, UnitCostModel
from sim.hardware import HardwareSpec
from sim.profiled_cost_model import ProfiledCostModel, find_profile, profile_path


def get_cost_model(
    spec: str | CostModel | None,
    model: ModelConfig,
    hardware: HardwareSpec,
    profile: str | Path | None = None,
    num_speculative_tokens: int = 0,
) -> CostModel:
    """A cost model by name, or a cost-model object as it prices a synchronous engine of
    the default limits and these drafts (see resolve_cost_model)."""
    return resolve_cost_model(spec, model, hardware, profile, num_speculative_tokens)[0]


def resolve_cost_model(
    spec: str | CostModel | None,
    model: ModelConfig,
    hardware: HardwareSpec,
    profile: str | Path | None = None,
    num_speculative_tokens: int = 0,
    batch_invariant: bool = False,
    async_scheduling: bool = False,
    max_num_seqs: int = 256,
    max_num_batched_tokens: int = 8192,
) -> tuple[CostModel, dict[str, Any]]:
    """The cost model and what the report says of it: its name, whether it is calibrated
    on the real executor, and the profile it fitted.

    num_speculative_tokens: the drafts the engine's MTP drafter proposes after every
    step (the profiled and analytic models price the drafter's work from it).

    None: "profiled" when `profile` is given or a shipped profile exists for (model,
    hardware) in the engine's mode, else "analytic" (uncalibrated). An object must be a
    CostModel (sim/cost_model.py), used as its `for_engine` gives it for these settings
    (a ProfiledCostModel built for other drafts, scheduling or limits is fitted again
    for these; one of another model or hardware is refused).
    batch_invariant: the engine's mode; a cost model that cannot price it is refused
    (`check_mode`). async_scheduling: the engine launches a step while the one before
    runs (the profiled model then prices steps from the profile's pipelined times).
    max_num_seqs, max_num_batched_tokens: the engine's limits, which choose the graphs its
    runner captures (the profiled model prices a decode step in the graph that holds it,
    a prompt chunk at its token bucket).
    """
    limits = {"max_num_seqs": max_num_seqs, "max_num_batched_tokens": max_num_batched_tokens}
    cost, meta = _resolve(
        spec, model, hardware, profile, batch_invariant, num_speculative_tokens,
        async_scheduling, limits,
    )  # fmt: skip
    check_mode(cost, batch_invariant, model.name, hardware.name)
    return cost, meta


def check_mode(cost: CostModel, batch_invariant: bool, model: str, hardware: str) -> None:
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
    async_scheduling: bool,
    limits: dict[str, int],
) -> tuple[CostModel, dict[str, Any]]:
    if spec is None:
        found = find_profile(profile_key(model), hardware.name, batch_invariant)
        spec = "profiled" if profile is not None or found else "analytic"
    if isinstance(spec, str):
        key = spec.strip().lower()
        if key == "profiled":
            path = (
                Path(profile)
                if profile is not None
                else find_profile(profile_key(model), hardware.name, batch_invariant)
            )
            if path is None:
                raise ValueError(
                    f"no profile of {model.name!r} on {hardware.name!r} (looked for "
                    f"{profile_path(profile_key(model), hardware.name, batch_invariant)}); measure one with `deepinfer "
                    f"profile --model {model.name} --out PROFILE.json` and pass it, or use "
                    "cost model 'analytic'"
                )
            cost = ProfiledCostModel(
                path, model, hardware, num_speculative_tokens,
                async_scheduling=async_scheduling, **limits,
            )  # fmt: skip
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
    if not isinstance(spec, CostModel):
        raise TypeError(
            f"cost model {spec!r} is not a sim.cost_model.CostModel; pass 'profiled', "
            "'analytic', 'unit' or a subclass of CostModel (step_time(out) is the one "
            "method it must define)"
        )
    # priced for this engine, not the one it was built for
    spec = spec.for_engine(
        model, hardware, EngineSettings(num_speculative_tokens, async_scheduling, **limits)
    )
    meta = {"cost_model": type(spec).__name__, "calibrated": isinstance(spec, ProfiledCostModel)}
    return spec, meta


def engine_cost_model(
    spec: str | CostModel | None,
    model: ModelConfig,
    hardware: HardwareSpec,
    profile: str | Path | None,
    engine: EngineConfig,
) -> tuple[CostModel, dict[str, Any]]:
    """`resolve_cost_model` for an engine (its drafts, batch-invariant mode, async
    scheduling), refusing a speculating engine on a model with no MTP layer to draft with."""
    if engine.num_speculative_tokens and not model.num_nextn_predict_layers:
        raise ValueError(
            f"num_speculative_tokens={engine.num_speculative_tokens}: drafts come from the "
            f"model's MTP layers and {model.name} has none (num_nextn_predict_layers=0); "
            "`deepinfer simulate --add-mtp-layer` (in Python: "
            "model.replace(num_nextn_predict_layers=1)) gives it one in its own shapes"
        )
    model = model.with_quantization(engine.quantization)
    cost, meta = resolve_cost_model(
        spec,
        model,
        hardware,
        profile,
        engine.num_speculative_tokens,
        batch_invariant=engine.batch_invariant,
        async_scheduling=bool(engine.async_scheduling),
        max_num_seqs=engine.max_num_seqs,
        max_num_batched_tokens=engine.max_num_batched_tokens,
    )
    measured = cost.meta.get("quantization") if isinstance(cost, ProfiledCostModel) else None
    if isinstance(cost, ProfiledCostModel) and measured != model.quant_method:
        raise ValueError(
            f"quantization={model.quant_method}: profile {cost.profile_name} was measured "
            f"with quantization={measured}, whose weights stream at another speed; pass a "
            f"profile measured with --quantization {model.quant_method}, or use cost model "
            "'analytic'"
        )
    return cost, meta


def profile_key(model: ModelConfig) -> str:
    """The name a model's profiles go by: an FP8 model's are `<name>__fp8` (its weights
    stream at half the bytes, so a bf16 profile would misprice it)."""
    return model.name if model.quant_method is None else f"{model.name}__{model.quant_method}"
