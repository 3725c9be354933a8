"""GPU specs the cost model prices a step against.

The figures live in `sim/data/hardware.json` (one entry per GPU, each with the
spec sheet it came from), so adding a GPU is a data change, not a code change.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path
from typing import Any

HARDWARE_FILE = Path(__file__).parent / "data" / "hardware.json"


@dataclass(frozen=True)
class HardwareSpec:
    """One GPU. Rates are peak (spec-sheet) figures; efficiencies live in the cost model."""

    name: str
    peak_bf16_flops: float  # dense tensor-core FLOP/s in bf16 (not the 2:4-sparse figure)
    peak_fp8_flops: float  # dense tensor-core FLOP/s in fp8 (used when weights are fp8)
    hbm_bandwidth: float  # bytes/s
    memory_bytes: int  # device memory as the driver reports it
    source: str = ""  # where the figures come from
    # GPU-to-GPU link out of one GPU, one direction (bytes/s); None: no such link listed.
    nvlink_bandwidth: float | None = None
    all_to_all_latency_s: float = 0.0  # fixed cost of one all_to_all call
    # The device is the host's own CPU: a launch runs the step before it returns, so async
    # scheduling overlaps nothing (the host schedules, runs, then processes, in turn).
    runs_on_host: bool = False
    # Streaming multiprocessors: how many attention programs one wave runs at once (the
    # profiled cost model's prefill wave); 0 on a host CPU.
    num_sms: int = 0

    def peak_flops(self, dtype_bytes: int) -> float:
        """Peak matmul rate for weights of `dtype_bytes` (1: fp8 GEMMs, else bf16)."""
        return self.peak_fp8_flops if dtype_bytes == 1 else self.peak_bf16_flops


@lru_cache(maxsize=1)
def _table() -> dict[str, dict[str, Any]]:
    # Read once: get_hardware is called per simulation, the file never changes at run time.
    with HARDWARE_FILE.open() as f:
        raw = json.load(f)
    return {k: v for k, v in raw.items() if not k.startswith("_")}


def known_hardware() -> list[str]:
    """Names `get_hardware` accepts, sorted."""
    return sorted(_table())


def get_hardware(name: str) -> HardwareSpec:
    """The spec of GPU `name` (case-insensitive), e.g. "h200"; unknown names raise ValueError."""
    key = name.strip().lower()
    table = _table()
    if key not in table:
        raise ValueError(f"unknown hardware {name!r}; known: {', '.join(known_hardware())}")
    entry = table[key]
    on_host = bool(entry.get("runs_on_host", False))
    try:
        return HardwareSpec(
            name=key,
            peak_bf16_flops=float(entry["peak_bf16_flops"]),
            peak_fp8_flops=float(entry["peak_fp8_flops"]),
            hbm_bandwidth=float(entry["hbm_bandwidth"]),
            memory_bytes=int(entry["memory_bytes"]),
            source=str(entry.get("source", "")),
            nvlink_bandwidth=(
                float(entry["nvlink_bandwidth"]) if "nvlink_bandwidth" in entry else None
            ),
            all_to_all_latency_s=float(entry.get("all_to_all_latency_s", 0.0)),
            runs_on_host=on_host,
            # A GPU's SMs set its kernels' waves (prefill and split-KV attention); a
            # host CPU has none.
            num_sms=int(entry.get("num_sms", 0)) if on_host else int(entry["num_sms"]),
        )
    except KeyError as e:
        raise ValueError(f"{HARDWARE_FILE}: entry {key!r} lacks field {e.args[0]!r}") from None
