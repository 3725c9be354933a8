"""Serving metrics computed from `RequestRecord`s and `StepRecord`s.

The latency figures follow vLLM's serving benchmark (`vllm bench serve`), so a
simulated run and a benchmark of a real server can be compared line by line:

- TTFT = first_token - arrival
- TPOT = (e2el - ttft) / (output_tokens - 1), only for requests with > 1 output token
- ITL  = every gap between consecutive `token_times` of a request, all requests flattened
- E2EL = finish - arrival

Latency statistics use only *finished* requests; aborted and rejected ones are
counted but never enter a latency distribution. Percentiles are numpy's default
(linear interpolation) and std is the population std, as in vLLM.

Summary keys (all times in ms unless the key says `_s`):

- `{m}_ms_{s}` for m in ttft, tpot, itl, e2el and s in
  mean, std, min, p50 (the median), p90, p99, max; None when there is no sample.
- counts: num_submitted, num_completed, num_aborted, num_rejected,
  rejected_reasons (reason template -> count), total_input_tokens,
  total_output_tokens (both over completed requests).
- duration_s (alias makespan_s): last finish - first arrival over the records
  that have a finish time; 0.0 when there is none.
- request_throughput (req/s), output_throughput and total_token_throughput
  (tok/s): over completed requests; 0.0 when duration_s is 0.
- slo (the thresholds given, ms), num_good, request_goodput (req/s); the last
  two are None when no SLO is given.
- total_preemptions, num_preempted_requests, prefix_cache_hit_rate (None when
  no scheduled request had a prompt token).
- from steps: num_steps, kv_usage_mean, kv_usage_max, batch_tokens_mean,
  prompt_tokens_mean, running_mean, running_max, waiting_mean, waiting_max;
  per-step (not time-weighted) figures, None when no steps are given.

Nothing is ever NaN or infinite, so the summary always serialises as strict JSON.
"""

from __future__ import annotations

import re
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, fields
from itertools import chain
from typing import TYPE_CHECKING, Any

from deepinfer.records import RequestRecord, StepRecord
from deepinfer.step_log import column

if TYPE_CHECKING:
    import numpy as np

LATENCY_METRICS = ("ttft", "tpot", "itl", "e2el")
STATS = ("mean", "std", "min", "p50", "p90", "p99", "max")
_PERCENTILES = {"p50": 50.0, "p90": 90.0, "p99": 99.0}
# Rejection reasons carry sizes ("prompt of 40000 tokens ..."); more distinct
# templates than this are folded into "other" so the summary stays readable.
MAX_REASON_GROUPS = 8


@dataclass(frozen=True)
class SLO:
    """Service-level objectives in milliseconds; None means "not checked"."""

    ttft_ms: float | None = None
    tpot_ms: float | None = None
    e2el_ms: float | None = None

    def is_empty(self) -> bool:
        return all(getattr(self, f.name) is None for f in fields(self))

    def to_dict(self) -> dict[str, float]:
        return {
            f.name: getattr(self, f.name) for f in fields(self) if getattr(self, f.name) is not None
        }


def parse_slo(text: str) -> SLO:
    """Parse `"ttft:500,tpot:50"` (values in ms; keys ttft, tpot, e2el) into an SLO.

    Raises ValueError naming the offending part for an unknown key, a missing
    or non-numeric value, a non-positive value, or a repeated key.
    """
    values: dict[str, float] = {}
    for raw in text.split(","):
        part = raw.strip()
        if not part:
            continue  # tolerate "ttft:500," and the empty string (no SLO)
        key, sep, value = part.partition(":")
        key = key.strip().lower()
        if not sep:
            raise ValueError(f"SLO part {part!r}: expected NAME:MS, e.g. 'ttft:500'")
        if key not in ("ttft", "tpot", "e2el"):
            raise ValueError(f"SLO part {part!r}: unknown metric {key!r} (ttft, tpot, e2el)")
        if key in values:
            raise ValueError(f"SLO part {part!r}: {key} given twice")
        try:
            ms = float(value)
        except ValueError:
            raise ValueError(f"SLO part {part!r}: {value.strip()!r} is not a number") from None
        if not ms > 0 or ms == float("inf"):  # also rejects nan
            raise ValueError(f"SLO part {part!r}: threshold must be a positive finite number")
        values[key] = ms
    return SLO(**{f"{k}_ms": v for k, v in values.items()})


def _stats(samples_s: Sequence[float] | np.ndarray, prefix: str) -> dict[str, float | None]:
    """mean/std/min/percentiles/max of samples given in seconds, reported in ms."""
    import numpy as np

    if not len(samples_s):
        return {f"{prefix}_ms_{s}": None for s in STATS}
    a = np.asarray(samples_s, dtype=np.float64) * 1000.0
    lo, hi = float(a.min()), float(a.max())
    # Rounding can put the mean of equal samples one ulp outside [min, max]
    # (mean([0.1] * 3) > 0.1); clamp so the summary never contradicts itself.
    out: dict[str, float | None] = {
        f"{prefix}_ms_mean": min(max(float(a.mean()), lo), hi),
        f"{prefix}_ms_std": float(a.std()),
        f"{prefix}_ms_min": lo,
    }
    # One partition for every percentile (each the value it is on its own).
    for name, value in zip(_PERCENTILES, np.percentile(a, list(_PERCENTILES.values()))):
        out[f"{prefix}_ms_{name}"] = min(max(float(value), lo), hi)
    out[f"{prefix}_ms_max"] = hi
    return out


def _gaps(token_times: list[list[float]]) -> np.ndarray:
    """Every gap between consecutive times of each list (later minus earlier), the lists'
    gaps one after another: [sum over lists of max(len - 1, 0)]. One array of every time
    and one subtraction: a run has hundreds of thousands of tokens, and no float object
    is made per gap."""
    import numpy as np

    lengths = np.fromiter(map(len, token_times), dtype=np.intp, count=len(token_times))
    total = int(lengths.sum())
    times = np.fromiter(chain.from_iterable(token_times), dtype=np.float64, count=total)
    within = np.ones(total, dtype=bool)  # [j]: times j - 1 and j are of one list
    within[(np.cumsum(lengths) - lengths)[lengths > 0]] = False
    return (times[1:] - times[:-1])[within[1:]]


def _reason_template(reason: str | None) -> str:
    """The key that groups rejection reasons differing only in their numbers."""
    if not reason:
        return "unspecified"
    return re.sub(r"\d+(\.\d+)?", "N", reason.strip())


def _group_reasons(records: list[RequestRecord]) -> dict[str, int]:
    """Reasons that differ only in their numbers counted together, each group shown by its
    first reason in full (numbers and all), marked when others differ in their numbers."""
    counts: Counter[str] = Counter()
    example: dict[str, str] = {}
    variants: dict[str, set[str]] = {}
    for r in records:
        key = _reason_template(r.reason)
        counts[key] += 1
        example.setdefault(key, (r.reason or "unspecified").strip())
        variants.setdefault(key, set()).add(r.reason or "")
    shown = {
        key: example[key] + (" (and others like it)" if len(variants[key]) > 1 else "")
        for key in counts
    }
    ranked = sorted(
        ((shown[k], n) for k, n in counts.items()), key=lambda kv: (-kv[1], kv[0])
    )  # deterministic order
    if len(ranked) <= MAX_REASON_GROUPS:
        return dict(ranked)
    head = dict(ranked[: MAX_REASON_GROUPS - 1])
    head["other"] = head.get("other", 0) + sum(n for _, n in ranked[MAX_REASON_GROUPS - 1 :])
    return head


def _is_good(ttft_s: float, tpot_s: float | None, e2el_s: float, slo: SLO) -> bool:
    """vLLM's goodput rule: a request is good if it meets every threshold given.

    TPOT is undefined for a 1-token output; vLLM records it as 0 there, so it
    always meets the TPOT objective.
    """
    if slo.ttft_ms is not None and ttft_s * 1000.0 > slo.ttft_ms:
        return False
    if slo.tpot_ms is not None and tpot_s is not None and tpot_s * 1000.0 > slo.tpot_ms:
        return False
    return not (slo.e2el_ms is not None and e2el_s * 1000.0 > slo.e2el_ms)


def _step_summary(steps: Sequence[StepRecord] | None) -> dict[str, Any]:
    import numpy as np

    keys = (
        "kv_usage_mean",
        "kv_usage_max",
        "batch_tokens_mean",
        "prompt_tokens_mean",
        "running_mean",
        "running_max",
        "waiting_mean",
        "waiting_max",
    )
    if not steps:
        return {"num_steps": 0, **{k: None for k in keys}}
    n = len(steps)

    def array(name: str, dtype: type) -> np.ndarray:  # (a list's values, as np.array reads them)
        return np.fromiter(column(steps, name), dtype=dtype, count=n)

    kv = array("kv_usage", np.float64)
    running = array("num_running", np.float64)
    waiting = array("num_waiting", np.float64)
    return {
        "num_steps": n,
        "kv_usage_mean": float(kv.mean()),
        "kv_usage_max": float(kv.max()),
        "batch_tokens_mean": float(np.mean(array("num_batched_tokens", np.int64))),
        "prompt_tokens_mean": float(np.mean(array("num_prompt_tokens", np.int64))),
        "running_mean": float(running.mean()),
        "running_max": int(running.max()),
        "waiting_mean": float(waiting.mean()),
        "waiting_max": int(waiting.max()),
    }


def _latencies(r: RequestRecord) -> tuple[float, float | None, float]:
    """A completed request's TTFT, TPOT (None with one output token) and E2EL, seconds."""
    assert r.first_token is not None and r.finish is not None
    ttft = r.first_token - r.arrival
    e2el = r.finish - r.arrival
    tpot = (e2el - ttft) / (r.num_output_tokens - 1) if r.num_output_tokens > 1 else None
    return ttft, tpot, e2el


def good_tokens(records: list[RequestRecord], slo: SLO) -> tuple[int, int]:
    """(input, output) tokens of the finished requests that met every limit of `slo`."""
    num_in = num_out = 0
    for r in records:
        done = r.status == "finished" and r.first_token is not None and r.finish is not None
        if done and _is_good(*_latencies(r), slo):
            num_in += r.num_prompt_tokens
            num_out += r.num_output_tokens
    return num_in, num_out


def summarize(
    records: list[RequestRecord],
    steps: Sequence[StepRecord] | None = None,
    slo: SLO | None = None,
) -> dict[str, Any]:
    """Summarise one run; see the module docstring for every key and its unit."""
    finished = [r for r in records if r.status == "finished"]
    aborted = [r for r in records if r.status == "aborted"]
    rejected = [r for r in records if r.status == "rejected"]

    # A finished request always has both timestamps; skip a malformed one
    # rather than poison every statistic with a None.
    completed = [r for r in finished if r.first_token is not None and r.finish is not None]
    ttfts: list[float] = []
    tpots: list[float] = []
    e2els: list[float] = []
    num_good = 0
    for r in completed:
        ttft, tpot, e2el = _latencies(r)
        ttfts.append(ttft)
        e2els.append(e2el)
        if tpot is not None:
            tpots.append(tpot)
        if slo is not None and _is_good(ttft, tpot, e2el, slo):
            num_good += 1

    # The run spans from the first arrival to the last finish among requests with
    # a finish time (rejected ones may have none); a clock glitch never makes it < 0.
    spans = [(r.arrival, r.finish) for r in records if r.finish is not None]
    duration = max(max(f for _, f in spans) - min(a for a, _ in spans), 0.0) if spans else 0.0

    def per_s(x: float) -> float:
        return x / duration if duration > 0 else 0.0

    total_in = sum(r.num_prompt_tokens for r in completed)
    total_out = sum(r.num_output_tokens for r in completed)
    scheduled = [r for r in records if r.first_scheduled is not None]
    prompt_sched = sum(r.num_prompt_tokens for r in scheduled)
    has_slo = slo is not None and not slo.is_empty()

    summary: dict[str, Any] = {
        "num_submitted": len(records),
        "num_completed": len(completed),
        "num_aborted": len(aborted),
        "num_rejected": len(rejected),
        "rejected_reasons": _group_reasons(rejected),
        "total_input_tokens": total_in,
        "total_output_tokens": total_out,
        "duration_s": duration,
        "makespan_s": duration,
        "request_throughput": per_s(len(completed)),
        "output_throughput": per_s(total_out),
        "total_token_throughput": per_s(total_in + total_out),
        "slo": slo.to_dict() if slo is not None else {},
        "num_good": num_good if has_slo else None,
        "request_goodput": per_s(num_good) if has_slo else None,
    }
    itls = _gaps([r.token_times for r in completed])
    latencies: tuple[Sequence[float] | np.ndarray, ...] = (ttfts, tpots, itls, e2els)
    for name, samples in zip(LATENCY_METRICS, latencies, strict=True):
        summary.update(_stats(samples, name))
    summary.update(
        {
            "total_preemptions": sum(r.num_preemptions for r in records),
            "num_preempted_requests": sum(1 for r in records if r.num_preemptions > 0),
            "prefix_cache_hit_rate": (
                sum(r.num_cached_tokens for r in scheduled) / prompt_sched if prompt_sched else None
            ),
        }
    )
    summary.update(_step_summary(steps))
    return summary
