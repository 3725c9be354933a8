"""Served launches against the profile's launch fit (issue 46: mixed steps priced low).

    python -m benchmarks.investigations.served_launches LOG.jsonl... --profile P.json
        [--model moonlight-16b-a3b] [--hardware h100]

Reads step logs of a real run on CUDA (`--step-log`; each line's `launch_s`, the host's
seconds inside the step's launch, and `device_s`) and prices each step's launch with the
profile's launch fit (`CostModel.launch_seconds`, the profiler's `launch_s` points). By
step kind: the served launches' p10 / p50 / p90, the fit's median for the same steps,
and the median ratio served / fitted. Then the launches that look like a wait on the
device: at least 80% of the step before's device span, where that span is over three
times the fit's price of the launch (a launch can only last as long as the step before
by waiting for it; its own work is the fit's order).
"""

from __future__ import annotations

import argparse
import statistics
import warnings
from collections.abc import Sequence
from typing import Any, NamedTuple

from deepinfer.model_config import load_model_config
from deepinfer.step_log_file import StepLogFile, read_step_log
from sim.hardware import get_hardware
from sim.profile_fit import shape_output
from sim.profile_from_log import step_kind
from sim.profiled_cost_model import ProfiledCostModel

WAIT_SHARE = 0.8  # of the step before's device span
WAIT_OVER_PRICE = 3.0  # that span over the launch's price


class Launch(NamedTuple):
    kind: str
    served: float  # the host's seconds inside the launch, as logged
    priced: float  # the profile's launch fit for the step's shape
    before: float | None  # the step before's device span (None: the first, or untimed)


def launches(log: StepLogFile, cost: Any) -> list[Launch]:
    """Each logged step with a launch time, in order."""
    out, before = [], None
    for step in log.steps:
        if step.launch_s is not None:
            priced = cost.launch_seconds(shape_output(step.groups))
            out.append(Launch(step_kind(step.groups), step.launch_s, priced, before))
        before = step.device_s
    return out


def waits(rows: Sequence[Launch]) -> list[Launch]:
    """The launches as long as a wait for the step before (module docstring)."""
    return [
        r
        for r in rows
        if r.before is not None
        and r.before > WAIT_OVER_PRICE * r.priced
        and r.served >= WAIT_SHARE * r.before
    ]


def summary(rows: Sequence[Launch]) -> dict[str, dict[str, float]]:
    """By kind: steps, served p10 / p50 / p90, fitted p50 (seconds), served / fitted p50."""
    table = {}
    for kind in sorted({r.kind for r in rows}):
        mine = [r for r in rows if r.kind == kind]
        served = sorted(r.served for r in mine)
        q = [served[round(f * (len(served) - 1))] for f in (0.1, 0.5, 0.9)]
        ratios = [r.served / r.priced for r in mine if r.priced > 0]
        table[kind] = {
            "steps": len(mine),
            "p10": q[0],
            "p50": q[1],
            "p90": q[2],
            "fitted_p50": statistics.median(r.priced for r in mine),
            "ratio_p50": statistics.median(ratios) if ratios else float("nan"),
        }
    return table


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("logs", nargs="+")
    p.add_argument("--profile", required=True)
    p.add_argument("--model", default="moonlight-16b-a3b")
    p.add_argument("--hardware", default="h100")
    args = p.parse_args(argv)
    for path in args.logs:
        log = read_step_log(path)
        engine = log.engine
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # (extrapolation: not what this reads)
            cost = ProfiledCostModel(
                args.profile, load_model_config(args.model), get_hardware(args.hardware),
                async_scheduling=True, max_num_seqs=int(engine["max_num_seqs"]),
                max_num_batched_tokens=int(engine["max_num_batched_tokens"]),
            )  # fmt: skip
        rows = launches(log, cost)
        print(f"{path}: {len(rows)} launches timed (ms)")
        for kind, s in summary(rows).items():
            print(
                f"  {kind:8s} n={s['steps']:5d}  served {1e3 * s['p10']:6.2f} / "
                f"{1e3 * s['p50']:6.2f} / {1e3 * s['p90']:6.2f}  fitted {1e3 * s['fitted_p50']:6.2f}"
                f"  served/fitted {s['ratio_p50']:.2f}"
            )
        held = waits(rows)
        print(f"  as long as a wait for the step before: {len(held)} of {len(rows)}")
        for r in held[:10]:
            print(
                f"    {r.kind:8s} launch {1e3 * r.served:7.2f} ms after a step of "
                f"{1e3 * (r.before or 0.0):7.2f} ms (fitted {1e3 * r.priced:.2f})"
            )


if __name__ == "__main__":
    main()
