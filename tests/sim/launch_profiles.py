"""A shipped profile as `deepinfer profile` writes it on CUDA now: every pipelined point
with its host launch (`launch_s`) and the device's own time (`device_s`), made up in the
shape the real runner has them: a decode graph's replay is short, a piecewise step
issues its eager attention layer by layer (a launch of some 12 ms, 4 ms more with
decodes beside its chunks), and such a step's device work is well under its pipelined
time, which the launch set."""

from __future__ import annotations

import copy
import json
from typing import Any

from sim.profiled_cost_model import PROFILES_DIR

GRAPH_LAUNCH_S = 3e-4
CHUNK_LAUNCH_S = 12e-3
DECODE_BESIDE_S = 4e-3


def launch_seconds(groups: list[list[Any]]) -> float:
    """The made-up launch of a point of these groups ([count, query, context, is_prompt])."""
    chunks = any(g[1] > 1 and g[3] for g in groups)
    decodes = any(g[1] == 1 or not g[3] for g in groups)
    if not chunks:
        return GRAPH_LAUNCH_S
    return CHUNK_LAUNCH_S + (DECODE_BESIDE_S if decodes else 0.0)


def with_launch_times(name: str) -> dict[str, Any]:
    """The shipped profile `name` (e.g. "moonlight-16b-a3b__h200") with launch and device
    times on every point that has a pipelined time."""
    path = PROFILES_DIR / f"{name}.json"
    data: dict[str, Any] = copy.deepcopy(json.loads(path.read_text()))
    data["_path"] = str(path.with_name(f"{name}-launch.json"))
    for point in data["points"]:
        if "pipelined_s" not in point:
            continue
        launch = launch_seconds(point["groups"])
        point["launch_s"] = launch
        pipelined = min(point["pipelined_s"], point["median_s"])
        # Bound by its launch: the device's own work a fraction of the period.
        point["device_s"] = pipelined if launch < 1e-3 else min(pipelined, 0.4 * launch)
    return data
