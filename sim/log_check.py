"""How well a profile predicts logged steps, by step kind: the profiled cost model's
device price against each step's duration (its device span, where the log has one) and
its host price against the step's host seconds, as median and p90 of |relative error|.

The held-out check (`deepinfer profile --from-log LOG --held-out F`): fit on the first
1 - F of each log's steps, predict the last F, the steps the fit never saw; the same
table for another profile (a grid profile, `--compare`) reads the two side by side. A
whole run held out is `--check LOG`: its steps are predicted, never fitted.

A step's device price is the span the simulator's timeline gives it
(`sim.cost_model.device_span`): launched while the step before ran (async scheduling on
a GPU), its pipelined price (with launches priced apart, its device time) and what its
idle-launch part outlasts the step before; otherwise its price on an idle device
(`CostModel.launch_cost`, both figures).
"""

from __future__ import annotations

import math
import warnings
from dataclasses import replace
from typing import Any

import numpy as np

from deepinfer.model_config import ModelConfig
from deepinfer.step_log_file import StepLogFile
from sim.cost_model import device_span
from sim.hardware import get_hardware
from sim.profile_fit import shape_output
from sim.profile_from_log import KINDS, step_kind
from sim.profiled_cost_model import ProfiledCostModel


def split_logs(
    logs: list[StepLogFile], held_out: float
) -> tuple[list[StepLogFile], list[StepLogFile]]:
    """Each log cut in two by time: its first 1 - held_out of steps, and the rest."""
    if not 0 < held_out < 1:
        raise ValueError(f"--held-out {held_out}: a fraction of the steps, between 0 and 1")
    fit, rest = [], []
    for log in logs:
        cut = len(log.steps) - max(1, math.floor(held_out * len(log.steps)))
        if cut < 1:
            raise ValueError(f"{log.path}: {len(log.steps)} steps, too few to hold some out")
        fit.append(replace(log, steps=log.steps[:cut]))
        rest.append(replace(log, steps=log.steps[cut:]))
    return fit, rest


def step_errors(
    profile: dict[str, Any], model: ModelConfig, logs: list[StepLogFile]
) -> dict[str, dict[str, float]]:
    """By step kind (and "all"): steps, device and host median and p90 |error| of
    `profile`'s prices of `logs`' steps (steps of zero duration or host time skip that
    comparison; verify steps are left out)."""
    device: dict[str, list[float]] = {}
    host: dict[str, list[float]] = {}
    for log in logs:
        hw = get_hardware(log.header["hardware"])
        with warnings.catch_warnings():  # (range warnings: the table says how it went)
            warnings.simplefilter("ignore")
            engine = log.engine
            cost = ProfiledCostModel(
                profile, model, hw,
                async_scheduling=bool(engine.get("async_scheduling")),
                max_num_seqs=int(engine.get("max_num_seqs") or 256),
                max_num_batched_tokens=int(engine.get("max_num_batched_tokens") or 8192),
            )  # fmt: skip
            behind = None  # the device price of the step before
            for step in log.steps:
                kind = step_kind(step.groups)
                out = shape_output(step.groups)
                own, idle = cost.launch_cost(out)
                overlapped = step.overlapped and cost.pipelined
                priced = device_span(own, idle, behind if overlapped else None)
                behind = own
                if kind not in KINDS:
                    continue
                real = step.seconds  # (a pipelined step's device span where the log has one)
                if real > 0:
                    device.setdefault(kind, []).append(abs(priced - real) / real)
                if step.host_s > 0:
                    host.setdefault(kind, []).append(
                        abs(cost.cpu_time(out) - step.host_s) / step.host_s
                    )
    table = {}
    for kind in [*KINDS, "all"]:
        dev = device.get(kind, []) if kind != "all" else sum(device.values(), [])
        hst = host.get(kind, []) if kind != "all" else sum(host.values(), [])
        if not dev and not hst:
            continue
        table[kind] = {"steps": len(dev), **_stats("device", dev), **_stats("host", hst)}
    return table


def _stats(name: str, errors: list[float]) -> dict[str, float]:
    if not errors:
        return {f"{name}_median": math.nan, f"{name}_p90": math.nan}
    e = np.asarray(errors)
    return {f"{name}_median": float(np.median(e)), f"{name}_p90": float(np.quantile(e, 0.9))}


def error_table(columns: dict[str, dict[str, dict[str, float]]]) -> str:
    """`step_errors` of several profiles (name -> table) side by side, a line a kind:
    median / p90 |error| of the device price, then of the host price."""
    names = list(columns)
    kinds = [k for k in [*KINDS, "all"] if any(k in t for t in columns.values())]
    head = f"  {'kind':8s} {'steps':>6s}" + "".join(f"  {name[:30]:>30s}" for name in names)
    lines = [
        head,
        f"  {'':8s} {'':>6s}" + "".join(f"  {'device p50/p90 | host p50/p90':>30s}" for _ in names),
    ]
    for kind in kinds:
        steps = max(int(t[kind]["steps"]) for t in columns.values() if kind in t)
        cells = []
        for name in names:
            row = columns[name].get(kind)
            if row is None:
                cells.append(f"  {'-':>30s}")
                continue
            text = (
                f"{_pct(row['device_median'])}/{_pct(row['device_p90'])} | "
                f"{_pct(row['host_median'])}/{_pct(row['host_p90'])}"
            )
            cells.append(f"  {text:>30s}")
        lines.append(f"  {kind:8s} {steps:6d}" + "".join(cells))
    return "\n".join(lines)


def _pct(value: float) -> str:
    return "-" if math.isnan(value) else f"{value:.1%}"
