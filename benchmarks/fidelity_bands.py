"""The simulator's uncertainty bands beside the real runs, per workload.

The fidelity benchmark simulates each workload once, without noise; `band_check` runs
it again `replicates` times with step prices drawn from the profile's noise
(sim/bands.py: the grid's held-out errors per step kind, once a replicate, and the
points' measured spread, each step) and says, for each headline figure
(benchmarks/fidelity_spread.py FIGURES), the simulated 95% band and whether each real
run's value fell inside it. The requests and their arrivals are the ones the real
runs served, so only the step prices are drawn: a real figure outside the band is a
miss the profile's own uncertainty does not explain.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

from benchmarks.fidelity_spread import FIGURES, figures
from deepinfer.config import EngineConfig
from deepinfer.model_config import ModelConfig
from deepinfer.records import RequestRecord
from sim.bands import simulate_bands
from sim.cost_model_registry import profile_key
from sim.profiled_cost_model import find_profile
from sim.simulator import SimResult
from sim.traces import Trace


def band_check(
    trace: Trace,
    model: str | ModelConfig,
    hardware: str,
    cfg: EngineConfig,
    sim: SimResult,
    profile: Path | None,
    replicates: int,
    acceptance: float,
    real_runs: Sequence[Sequence[RequestRecord]],
) -> dict[str, Any]:
    """The bands of `sim`'s figures over `replicates` replicates (seeded by the engine's
    seed) and, per figure, each real run's value and whether it lies inside."""

    def headline(result: SimResult) -> dict[str, float]:
        every = figures(result.requests)
        return {k: every[k] for k in FIGURES}

    bands = simulate_bands(
        trace, model, hardware, cfg, sim, replicates=replicates, seed=cfg.seed,
        profile=profile, figures=headline, acceptance_rate=acceptance,
    )  # fmt: skip
    reals = [figures(run) for run in real_runs]
    rows = {}
    for key, band in bands.figures.items():
        values = [r[key] for r in reals]
        rows[key] = band.to_dict() | {
            "real": values,
            "inside": [band.contains(v) for v in values],
        }
    return {"replicates": replicates, "noise": bands.noise, "figures": rows}


DEFAULT_REPLICATES = 10


def replicates_for(
    asked: int | None, spec: ModelConfig, hardware: str, cfg: EngineConfig, profile: Path | None
) -> int:
    """The bands' replicates: `asked` (--bands N), or by default DEFAULT_REPLICATES where a
    profile prices the hardware and none where none does (the simulator then prices with
    the analytic model, and the bands have no held-out errors to draw from). Asked for
    with no profile: ValueError, before any real run."""
    if profile is not None or asked == 0:
        return DEFAULT_REPLICATES if asked is None else asked
    key = profile_key(spec.with_quantization(cfg.quantization))
    if find_profile(key, hardware, cfg.batch_invariant) is not None:
        return DEFAULT_REPLICATES if asked is None else asked
    if asked is None:
        print(f"no bands: no profile of {key} on {hardware} to draw their noise from")
        return 0
    raise ValueError(
        f"--bands {asked}: no profile of {key} on {hardware} ships, and the bands draw "
        "their noise from a profile's held-out errors; pass --profile PROFILE.json, or "
        "--bands 0"
    )


def _cell(row: dict[str, Any] | None) -> str:
    """The band as signed offsets from the point estimate, and the real runs inside."""
    if row is None or not row["point"] or row["low"] != row["low"]:  # (NaN: no band)
        return "-"
    lo, hi = row["low"] / row["point"] - 1, row["high"] / row["point"] - 1
    return f"{lo:+.0%}..{hi:+.0%} ({sum(row['inside'])}/{len(row['inside'])})"


def band_table_lines(results: Sequence[dict[str, Any]]) -> list[str]:
    """Markdown rows: per workload and figure, the simulated 95% band around the point
    estimate (signed offsets) and how many of the real runs fell inside it."""
    lines = [
        "| workload | " + " | ".join(FIGURES) + " | real values inside |",
        "|---|" + "---|" * len(FIGURES) + "---|",
    ]
    for r in results:
        b = r.get("bands")
        if not b:
            continue
        rows = b["figures"]
        inside = sum(sum(row["inside"]) for row in rows.values())
        total = sum(len(row["inside"]) for row in rows.values())
        cells = [_cell(rows.get(k)) for k in FIGURES]
        lines.append(f"| {r['workload']} | " + " | ".join(cells) + f" | {inside} of {total} |")
    return lines


def print_band_table(results: Sequence[dict[str, Any]]) -> None:
    banded = [r for r in results if r.get("bands")]
    if not banded:
        return
    first = banded[0]["bands"]
    print(
        f"\nsimulated 95% bands ({first['replicates']} replicates; step prices drawn from "
        f"{first['noise']}) around the point estimate, and the real runs inside"
    )
    for line in band_table_lines(banded):
        print(line)
