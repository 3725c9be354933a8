"""Efficiency factors and overheads of the analytic cost model, loaded from data.

The numbers live in `sim/data/cost_coefficients.json` (its `_doc` key says
where each comes from), so calibrating the simulator is a data change.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, fields, replace
from pathlib import Path
from typing import Any

COEFFICIENTS_FILE = Path(__file__).parent / "data" / "cost_coefficients.json"


@dataclass(frozen=True)
class CostCoefficients:
    """Fractions of peak a kernel class reaches, and fixed times in seconds."""

    matmul_efficiency: float  # dense projections: fraction of peak FLOP/s
    moe_matmul_efficiency: float  # routed-expert grouped GEMMs
    attention_efficiency: float  # prefill / decode attention kernels
    bandwidth_efficiency: float  # fraction of HBM bandwidth for weights, KV, activations
    moe_bandwidth_efficiency: float  # routed-expert weight reads
    layer_overhead_s: float  # per decoder layer per step (small kernels)
    step_overhead_s: float  # per step on the GPU (input copy, sampling)
    cpu_step_overhead_s: float  # host time per step
    cpu_per_request_s: float  # host time per scheduled request
    # host time per token sampled under a grammar (so_args): its mask filled on the CPU
    cpu_grammar_mask_per_token_s: float
    activation_bytes: int = 2  # bf16 activations

    def __post_init__(self) -> None:
        for f in fields(self):
            value = getattr(self, f.name)
            if f.name.endswith("efficiency") and not 0.0 < value <= 1.0:
                raise ValueError(
                    f"cost coefficient {f.name}={value}: expected a fraction in (0, 1]"
                )
            if f.name.endswith("_s") and value < 0.0:
                raise ValueError(f"cost coefficient {f.name}={value}: expected >= 0 seconds")


def load_cost_coefficients(path: str | Path | None = None, **overrides: Any) -> CostCoefficients:
    """Coefficients from `path` (default: the bundled file), with keyword overrides."""
    src = Path(path) if path is not None else COEFFICIENTS_FILE
    with src.open() as f:
        raw = json.load(f)
    names = {f.name for f in fields(CostCoefficients)}
    values = {k: v for k, v in raw.items() if not k.startswith("_")}
    unknown = sorted(set(values) - names)
    if unknown:
        raise ValueError(f"{src}: unknown cost coefficient(s) {unknown}; known: {sorted(names)}")
    missing = [f.name for f in fields(CostCoefficients) if f.name not in values]
    missing = [m for m in missing if m != "activation_bytes"]
    if missing:
        raise ValueError(f"{src}: missing cost coefficient(s) {missing}")
    coeffs = CostCoefficients(**values)
    bad = sorted(set(overrides) - names)
    if bad:
        raise ValueError(f"unknown cost coefficient override(s) {bad}; known: {sorted(names)}")
    return replace(coeffs, **overrides) if overrides else coeffs
