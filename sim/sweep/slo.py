"""The sweep's SLO: percentile limits, and/or a goodput fraction over per-request limits.

    ttft_p99:2000,tpot_p99:50      the run's p99 TTFT <= 2000 ms and p99 TPOT <= 50 ms
    ttft:2000,tpot:50,goodput:0.9  at least 90% of requests meet both, each on its own

A percentile key is METRIC_STAT with METRIC in ttft, tpot, itl, e2el and STAT in mean,
p50, p90, p99, max (the summary's `{metric}_ms_{stat}`). A plain METRIC is a
per-request threshold as `deepinfer simulate --slo` takes it; those need `goodput:F`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from deepinfer.metrics import LATENCY_METRICS, SLO

_STATS = ("mean", "p50", "p90", "p99", "max")
_PER_REQUEST = ("ttft", "tpot", "e2el")


@dataclass(frozen=True)
class SweepSLO:
    limits: dict[str, float] = field(default_factory=dict)  # summary key -> most ms allowed
    per_request: SLO = field(default_factory=SLO)
    goodput: float | None = None  # the least fraction of submitted requests that is good

    @property
    def text(self) -> str:
        parts = [f"{k.replace('_ms_', '_')}:{v:g}" for k, v in self.limits.items()]
        parts += [f"{k.removesuffix('_ms')}:{v:g}" for k, v in self.per_request.to_dict().items()]
        if self.goodput is not None:
            parts.append(f"goodput:{self.goodput:g}")
        return ",".join(parts)

    def check(self, summary: dict[str, Any]) -> tuple[bool, str]:
        """Whether a run's summary meets every objective, and the first one missed."""
        for key, limit in self.limits.items():
            value = summary.get(key)
            name = key.replace("_ms_", "_")
            if value is None:
                return False, f"{name}: no sample"
            if value > limit:
                return False, f"{name} {value:.1f} > {limit:g} ms"
        if self.goodput is not None:
            frac = good_fraction(summary)
            if frac < self.goodput:
                return False, f"goodput {frac:.3f} < {self.goodput:g}"
        return True, ""


def good_fraction(summary: dict[str, Any]) -> float:
    n = summary.get("num_submitted") or 0
    return (summary.get("num_good") or 0) / n if n else 0.0


def parse_sweep_slo(text: str) -> SweepSLO:
    """Parse `--slo`; a ValueError names the part that is wrong."""
    limits: dict[str, float] = {}
    per_request: dict[str, float] = {}
    goodput: float | None = None
    for raw in text.split(","):
        part = raw.strip()
        if not part:
            continue
        key, sep, value = part.partition(":")
        key = key.strip().lower()
        if not sep:
            raise ValueError(f"--slo part {part!r}: expected NAME:VALUE, e.g. ttft_p99:2000")
        try:
            number = float(value)
        except ValueError:
            raise ValueError(f"--slo part {part!r}: {value.strip()!r} is not a number") from None
        if not 0 < number < float("inf"):
            raise ValueError(f"--slo part {part!r}: must be a positive finite number")
        metric, _, stat = key.partition("_")
        if key == "goodput":
            if number > 1:
                raise ValueError(f"--slo part {part!r}: goodput is a fraction in (0, 1]")
            goodput = number
        elif key in _PER_REQUEST:
            per_request[f"{key}_ms"] = number
        elif metric in LATENCY_METRICS and stat in _STATS:
            limits[f"{metric}_ms_{stat}"] = number
        else:
            raise ValueError(
                f"--slo part {part!r}: unknown key {key!r}; use METRIC_STAT (METRIC in "
                f"{', '.join(LATENCY_METRICS)}; STAT in {', '.join(_STATS)}), "
                f"{'/'.join(_PER_REQUEST)} with goodput:FRACTION, or goodput"
            )
    if per_request and goodput is None:
        raise ValueError(
            f"--slo: per-request limits ({', '.join(k[:-3] for k in per_request)}) need "
            "goodput:FRACTION (e.g. goodput:0.9); or give a percentile such as ttft_p99:2000"
        )
    if goodput is not None and not per_request:
        raise ValueError("--slo: goodput needs per-request limits, e.g. ttft:2000,goodput:0.9")
    if not limits and goodput is None:
        raise ValueError("--slo: no objective given, e.g. ttft_p99:2000,tpot_p99:50")
    return SweepSLO(limits, SLO(**per_request), goodput)
