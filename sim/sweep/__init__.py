"""Capacity planning: per engine config of a grid, the highest request rate meeting an SLO.

- grid.py      the grid file / flags -> configs and the rate spec
- slo.py       the SLO: percentile limits and/or a goodput fraction
- point.py     one config at one rate, simulated, as one row (what a worker runs)
- search.py    per config, the rates to run: fixed, or a bisection on the rate
- backends.py  where points run: here, local processes, or Ray
- results.py   the resumable points file and the final CSV/JSON
- runner.py    run_sweep: the searches driven over a backend, configs ranked
- report.py    the ranked table and the plots
"""

from sim.sweep.backends import make_backend
from sim.sweep.grid import Grid, RateSpec, SweepConfig, build_grid, load_grid_file
from sim.sweep.point import PointTask, SweepContext, run_point
from sim.sweep.results import ResultStore, sweep_header, write_outputs
from sim.sweep.runner import SweepOutcome, run_sweep
from sim.sweep.slo import SweepSLO, parse_sweep_slo

__all__ = [
    "Grid",
    "PointTask",
    "RateSpec",
    "ResultStore",
    "SweepConfig",
    "SweepContext",
    "SweepOutcome",
    "SweepSLO",
    "build_grid",
    "load_grid_file",
    "make_backend",
    "parse_sweep_slo",
    "run_point",
    "run_sweep",
    "sweep_header",
    "write_outputs",
]
