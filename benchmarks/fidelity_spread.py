"""The real engine's run-to-run spread beside the simulator's error, per workload.

The same requests run through the real engine several times give several values of
each headline figure (TTFT, TPOT, E2E at p50 and p99; makespan; throughput): their
range is the floor a simulator's error can be read against. The simulator is
deterministic, so it has one value; its error is taken against the real runs' median,
and a figure inside the real runs' [min, max] is as close as the engine is to itself.

`spread` computes the figures; `print_spread_table` prints them in the shape of the
results page (workload | TTFT | TPOT | E2E | makespan, signed error p50 / p99, each with
the real runs' half-range over their median).
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from deepinfer.records import RequestRecord

METRICS = ("ttft", "tpot", "e2e")
QUANTILES = (50, 99)
FIGURES = tuple(f"{m}_p{q}" for m in METRICS for q in QUANTILES) + ("makespan", "throughput")


def request_metrics(rec: RequestRecord) -> dict[str, float] | None:
    """A finished request's TTFT, TPOT (NaN with one output token) and E2E, seconds."""
    if rec.status != "finished" or rec.first_token is None or rec.finish is None:
        return None
    n = rec.num_output_tokens
    return {
        "ttft": rec.first_token - rec.arrival,
        "tpot": (rec.finish - rec.first_token) / (n - 1) if n > 1 else float("nan"),
        "e2e": rec.finish - rec.arrival,
    }


def figures(records: Sequence[RequestRecord]) -> dict[str, float]:
    """One run's headline figures (seconds; throughput in output tokens/s), and what it
    did besides: preemptions, prefix-cache hit rate (cached over prompt tokens)."""
    done = [r for r in records if r.status == "finished" and r.finish is not None]
    out: dict[str, float] = {}
    values: dict[str, list[float]] = {m: [] for m in METRICS}
    for x in (request_metrics(r) for r in done):
        for m in METRICS:
            if x is not None and np.isfinite(x[m]):
                values[m].append(x[m])
    for m in METRICS:
        for q in QUANTILES:
            v = values[m]
            out[f"{m}_p{q}"] = float(np.percentile(v, q)) if v else float("nan")
    if done:
        start = min(r.arrival for r in records)
        makespan = max(r.finish for r in done if r.finish is not None) - start
        out["makespan"] = makespan
        out["throughput"] = sum(r.num_output_tokens for r in done) / makespan
    else:
        out["makespan"] = out["throughput"] = float("nan")
    prompt = sum(r.num_prompt_tokens for r in records)
    out["preemptions"] = float(sum(r.num_preemptions for r in records))
    out["hit_rate"] = sum(r.num_cached_tokens for r in records) / prompt if prompt else 0.0
    out["finished"] = float(len(done))
    return out


def spread(
    real_runs: Sequence[Sequence[RequestRecord]], sim: Sequence[RequestRecord]
) -> dict[str, Any]:
    """Per figure: the real runs' values, median, min, max, coefficient of variation and
    half-range over the median; the simulator's value, its signed error against the
    median, and whether it lies inside [min, max]."""
    if not real_runs:
        raise ValueError("spread: no real run")
    reals = [figures(run) for run in real_runs]
    simulated = figures(sim)
    out: dict[str, Any] = {"runs": len(reals)}
    for key in (*FIGURES, "preemptions", "hit_rate"):
        v = np.array([f[key] for f in reals])
        s = simulated[key]
        if not np.isfinite(v).all() or not np.isfinite(s):
            continue
        med = float(np.median(v))
        row = {
            "real": v.tolist(),
            "real_median": med,
            "real_min": float(v.min()),
            "real_max": float(v.max()),
            "sim": s,
            "inside": bool(v.min() <= s <= v.max()),
        }
        if key in FIGURES:
            row["real_cv"] = float(v.std() / v.mean()) if v.mean() > 0 else float("nan")
            row["half_range"] = float((v.max() - v.min()) / 2 / med) if med > 0 else float("nan")
            row["err"] = (s - med) / med if med > 0 else float("nan")
        out[key] = row
    return out


def _cell(row: dict[str, Any] | None) -> tuple[str, str]:
    if row is None:
        return "-", "-"
    return f"{row['err']:+.0%}", f"±{row['half_range']:.0%}"


def spread_table_lines(results: Sequence[dict[str, Any]]) -> list[str]:
    """Markdown rows: per workload the simulator's signed error against the real runs'
    median at p50 / p99 (in parentheses: the real runs' half-range over their median),
    makespan likewise, and how many of the eight figures fell inside the real range."""
    lines = [
        "| workload | TTFT p50 / p99 | TPOT p50 / p99 | E2E p50 / p99 | makespan | "
        "throughput | inside real range | real runs |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in results:
        s = r.get("spread")
        if not s:
            continue
        cells = []
        for m in METRICS:
            (e50, h50), (e99, h99) = _cell(s.get(f"{m}_p50")), _cell(s.get(f"{m}_p99"))
            cells.append(f"{e50} / {e99} ({h50} / {h99})")
        for key in ("makespan", "throughput"):
            row = s.get(key)
            cells.append(
                f"{row['err']:+.1%} (±{row['half_range']:.1%})" if row is not None else "-"
            )
        inside = [k for k in FIGURES if s.get(k, {}).get("inside")]
        counted = sum(k in s for k in FIGURES)
        cells.append(f"{len(inside)} of {counted}")
        cells.append(str(s["runs"]))
        lines.append(f"| {r['workload']} | " + " | ".join(cells) + " |")
    return lines


def extras_lines(results: Sequence[dict[str, Any]]) -> list[str]:
    """What each workload did on both sides beside its timings: preemptions, prefix-cache
    hit rate, draft acceptance (real: the runs' median; sim)."""
    out = []
    for r in results:
        s = r.get("spread") or {}
        cells = []
        for key, fmt in (("preemptions", "{:.0f}"), ("hit_rate", "{:.0%}")):
            if key in s and (s[key]["real_median"] or s[key]["sim"]):
                cells.append(
                    f"{key} real {fmt.format(s[key]['real_median'])} "
                    f"(runs {fmt.format(s[key]['real_min'])}-{fmt.format(s[key]['real_max'])}),"
                    f" sim {fmt.format(s[key]['sim'])}"
                )
        acc = r.get("draft_acceptance")
        if acc:
            real = [a for a in acc["real"] if a is not None]
            sim = acc["sim"]
            cells.append(
                "draft acceptance real "
                + "/".join(f"{a:.2f}" for a in real)
                + (f", sim {sim:.2f}" if sim is not None else "")
            )
        if cells:
            out.append(f"  {r['workload'][:24]:24s} " + "; ".join(cells))
    return out


def print_spread_table(
    results: Sequence[dict[str, Any]], skipped: Sequence[dict[str, str]]
) -> None:
    print(
        "\nsimulated vs the real runs' median, signed error p50 / p99 (the real runs' "
        "half-range over their median)"
    )
    models = sorted({
        f"{c.get('cost_model')} ({Path(c['profile']).name})" if c.get("profile") else str(c.get("cost_model"))
        for c in (r.get("cost_model") for r in results) if c
    })  # fmt: skip
    if models:
        print("cost model: " + ", ".join(models))
    for line in spread_table_lines(results):
        print(line)
    extra = extras_lines(results)
    if extra:
        print("\nbeside the timings (real runs' median and range; simulated)")
        for line in extra:
            print(line)
    for s in skipped:
        print(f"skipped {s['workload']}: {s['reason']}")
