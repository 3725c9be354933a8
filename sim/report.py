"""Human- and machine-readable reports of a run: table, JSON file, PNG figure.

Everything here reads the dict that `deepinfer.metrics.summarize` returns and
the raw records; no figure is computed twice. rich and matplotlib are imported
inside the functions so that importing `sim.report` stays cheap.
"""

from __future__ import annotations

import dataclasses
import json
import math
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from deepinfer.records import RequestRecord, StepRecord

if TYPE_CHECKING:
    from matplotlib.axes import Axes
    from rich.console import Console

MAX_TIMELINE_POINTS = 5000
_WIDTH = 50  # the width of vLLM's benchmark printout, so the two line up
_LATENCY_SECTIONS = (
    ("ttft", "TTFT", "Time to First Token"),
    ("tpot", "TPOT", "Time per Output Token (excl. 1st token)"),
    ("itl", "ITL", "Inter-token Latency"),
    ("e2el", "E2EL", "End-to-end Latency"),
)


def _fmt(value: Any, pct: bool = False) -> str:
    if value is None:
        return "n/a"
    if isinstance(value, int):  # bool included
        return str(value)
    if isinstance(value, float):
        return f"{value * 100:.2f}" if pct else f"{value:.2f}"
    return str(value)


def format_summary(summary: dict[str, Any], title: str = "Serving Benchmark Result") -> str:
    """The summary as a fixed-width table laid out like `vllm bench serve` prints it.

    Missing keys print as "n/a", so a partial summary still formats.
    """
    lines: list[str] = [f" {title} ".center(_WIDTH, "=")]
    get = summary.get

    def row(label: str, value: Any, pct: bool = False) -> None:
        lines.append(f"{label + ':':<40} {_fmt(value, pct)}")

    def section(name: str) -> None:
        lines.append(f"{name}".center(_WIDTH, "-"))

    row("Submitted requests", get("num_submitted"))
    row("Successful requests", get("num_completed"))
    row("Aborted requests", get("num_aborted"))
    row("Rejected requests", get("num_rejected"))
    for reason, count in (get("rejected_reasons") or {}).items():
        lines.append(f"  {count:>6} x {reason}")
    row("Benchmark duration (s)", get("duration_s"))
    row("Total input tokens", get("total_input_tokens"))
    row("Total generated tokens", get("total_output_tokens"))
    row("Request throughput (req/s)", get("request_throughput"))
    if get("request_goodput") is not None:
        row("Request goodput (req/s)", get("request_goodput"))
        slo = ", ".join(f"{k.removesuffix('_ms')} <= {v:g} ms" for k, v in get("slo", {}).items())
        lines.append(f"  SLO: {slo}")
    row("Output token throughput (tok/s)", get("output_throughput"))
    row("Total token throughput (tok/s)", get("total_token_throughput"))
    for key, short, long_name in _LATENCY_SECTIONS:
        section(long_name)
        row(f"Mean {short} (ms)", get(f"{key}_ms_mean"))
        row(f"Median {short} (ms)", get(f"{key}_ms_p50"))
        row(f"P90 {short} (ms)", get(f"{key}_ms_p90"))
        row(f"P99 {short} (ms)", get(f"{key}_ms_p99"))
    section("Cache")
    row("Prefix cache hit rate (%)", get("prefix_cache_hit_rate"), pct=True)
    row("Mean KV cache usage (%)", get("kv_usage_mean"), pct=True)
    row("Max KV cache usage (%)", get("kv_usage_max"), pct=True)
    section("Scheduler")
    row("Engine steps", get("num_steps"))
    row("Mean batched tokens per step", get("batch_tokens_mean"))
    row("Mean running requests", get("running_mean"))
    row("Mean waiting requests", get("waiting_mean"))
    section("Preemption")
    row("Total preemptions", get("total_preemptions"))
    row("Requests preempted at least once", get("num_preempted_requests"))
    lines.append("=" * _WIDTH)
    return "\n".join(lines)


def print_summary(
    summary: dict[str, Any],
    title: str = "Serving Benchmark Result",
    console: Console | None = None,
) -> None:
    """Print `format_summary` through rich (markup off: reasons may contain brackets)."""
    from rich.console import Console

    console = console or Console()
    console.print(format_summary(summary, title), markup=False, highlight=False, soft_wrap=True)


def downsample(items: Sequence[Any], max_points: int = MAX_TIMELINE_POINTS) -> list[Any]:
    """At most `max_points` items, evenly spaced by index, always keeping first and last.

    A sample, not an aggregate: peaks between samples may be skipped (the
    summary's maxima are computed over every step).
    """
    n = len(items)
    if n <= max_points:
        return list(items)
    if max_points < 2:
        return [items[-1]] if max_points == 1 else []
    stride = (n - 1) / (max_points - 1)
    return [items[round(i * stride)] for i in range(max_points)]


def _jsonable(obj: Any) -> Any:
    """Convert meta values (dataclasses, paths, numpy scalars, inf) into strict JSON."""
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        return _jsonable(dataclasses.asdict(obj))
    if isinstance(obj, dict):
        return {str(k): _jsonable(v) for k, v in obj.items()}
    if isinstance(obj, list | tuple | set | frozenset):
        return [_jsonable(v) for v in obj]
    if hasattr(obj, "item") and callable(obj.item):  # numpy scalar
        obj = obj.item()
    if isinstance(obj, float) and not math.isfinite(obj):
        return str(obj)  # "inf" (e.g. an unbounded request rate) rather than invalid JSON
    if obj is None or isinstance(obj, bool | int | float | str):
        return obj
    return str(obj)


def write_report(
    path: str | Path,
    summary: dict[str, Any],
    records: list[RequestRecord],
    steps: Sequence[StepRecord] | None,
    meta: dict[str, Any],
    *,
    include_token_times: bool = False,
    max_timeline_points: int = MAX_TIMELINE_POINTS,
) -> None:
    """Write `{"version", "meta", "summary", "requests", "timeline"}` as JSON to `path`.

    `requests` holds one `RequestRecord.to_dict()` per request; `token_times`
    is dropped unless `include_token_times` (it is most of the file's size on
    long outputs). `timeline` is at most `max_timeline_points` step records,
    sampled evenly by step index.
    """
    # Field by field rather than asdict(), which deep-copies each record's token_times
    # (most of a record) only for it to be dropped.
    names = [f.name for f in dataclasses.fields(RequestRecord)]
    if not include_token_times:
        names.remove("token_times")
    requests = [{k: getattr(r, k) for k in names} for r in records]
    timeline = [dataclasses.asdict(s) for s in downsample(steps or [], max_timeline_points)]
    # Records hold only str/int/float/None: converting them value by value (most of the
    # file) is needed only if one holds a non-finite float, which the strict dump refuses.
    doc = {
        "version": 1,
        "meta": _jsonable(meta),
        "summary": _jsonable(summary),
        "requests": requests,
        "timeline": timeline,
    }
    try:
        text = json.dumps(doc, allow_nan=False, separators=(",", ":"))
    except ValueError:
        text = json.dumps(_jsonable(doc), allow_nan=False, separators=(",", ":"))
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(text + "\n", encoding="utf-8")


def _cdf(ax: Axes, values_ms: list[float], metric: str) -> None:
    import numpy as np

    ax.set_title(f"{metric} CDF (n={len(values_ms)})")
    ax.set_xlabel(f"{metric} (ms)")
    ax.set_ylabel("fraction of requests")
    if not values_ms:
        _no_data(ax)
        return
    x = np.sort(np.asarray(values_ms, dtype=np.float64))
    y = np.arange(1, len(x) + 1) / len(x)
    # Prepend (x0, 0) so the curve rises from zero; a lone sample is otherwise invisible.
    marker = "." if len(x) <= 50 else None
    ax.step(np.r_[x[0], x], np.r_[0.0, y], where="post", marker=marker)
    ax.set_ylim(0, 1.02)
    # Latencies under load span orders of magnitude; a log axis keeps the body visible.
    if x[0] > 0 and x[-1] / x[0] > 100:
        ax.set_xscale("log")
    else:
        ax.ticklabel_format(axis="x", useOffset=False)  # no "1e-11+3e1" when values are equal
    ax.grid(True, alpha=0.3)


def _no_data(ax: Axes) -> None:
    ax.text(0.5, 0.5, "no data", transform=ax.transAxes, ha="center", va="center")


def plot_report(
    path: str | Path,
    records: list[RequestRecord],
    steps: Sequence[StepRecord] | None,
    title: str,
    *,
    max_points: int = MAX_TIMELINE_POINTS,
) -> None:
    """Draw one PNG: TTFT and TPOT CDFs, KV usage, queue lengths, batch tokens, progress."""
    # The object API with an Agg canvas touches no global pyplot state or backend.
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure
    from matplotlib.ticker import MaxNLocator

    done = [r for r in records if r.status == "finished" and r.first_token is not None]
    ttft = [(r.first_token - r.arrival) * 1000 for r in done if r.first_token is not None]
    tpot = [
        (r.finish - r.first_token) * 1000 / (r.num_output_tokens - 1)
        for r in done
        if r.finish is not None and r.first_token is not None and r.num_output_tokens > 1
    ]
    all_steps = steps or []
    picked = downsample(list(range(len(all_steps))), max_points)
    sampled = [all_steps[i] for i in picked]
    note = (
        f" (sampled {len(sampled)} of {len(all_steps)} steps)"
        if len(sampled) < len(all_steps)
        else ""
    )
    t = timeline_with_breaks(all_steps, picked)

    fig = Figure(figsize=(14, 13), layout="constrained")
    FigureCanvasAgg(fig)
    fig.suptitle(title, fontsize=14)
    ((a_ttft, a_tpot), (a_kv, a_queue), (a_batch, a_prog)) = fig.subplots(3, 2)
    _cdf(a_ttft, ttft, "TTFT")
    _cdf(a_tpot, tpot, "TPOT")

    a_kv.set_title("KV cache usage" + note)
    a_queue.set_title("Queue lengths" + note)
    a_batch.set_title("Tokens per step" + note)
    for ax in (a_kv, a_queue, a_batch):
        ax.set_xlabel("time (s)")
        ax.grid(True, alpha=0.3)
        if not sampled:
            _no_data(ax)
    if sampled:
        usage = [s.kv_usage * 100 for s in sampled]
        a_kv.plot(t, _gapped(usage, t), lw=0.8)
        # Scaled to the run's peak: a large cache used at 0.3% is not a flat line at zero.
        peak = max(usage)
        a_kv.set_ylim(0, max(peak * 1.1, 1.0))
        a_kv.axhline(peak, color="grey", lw=0.5, ls=":")
        a_kv.text(
            0.99,
            0.97,
            f"peak {peak:.2f}%",
            transform=a_kv.transAxes,
            ha="right",
            va="top",
            fontsize=8,
        )
        a_queue.plot(t, _gapped([s.num_running for s in sampled], t), lw=0.8, label="running")
        a_queue.plot(t, _gapped([s.num_waiting for s in sampled], t), lw=0.8, label="waiting")
        a_queue.legend(loc="upper right")
        a_batch.plot(t, _gapped([s.num_batched_tokens for s in sampled], t), lw=0.8, label="total")
        a_batch.plot(t, _gapped([s.num_prompt_tokens for s in sampled], t), lw=0.8, label="prompt")
        a_batch.legend(loc="upper right")
    a_kv.set_ylabel("blocks held by requests (%)")
    a_queue.set_ylabel("requests")
    a_batch.set_ylabel("batched tokens")

    # Arrivals against completions: the gap between the curves is the backlog.
    a_prog.set_title("Requests arrived vs ended")
    a_prog.set_xlabel("time (s)")
    a_prog.set_ylabel("cumulative requests")
    a_prog.grid(True, alpha=0.3)
    arrivals, ended = progress_curves(records)
    rejected = sum(r.status == "rejected" for r in records)
    ended_label = "ended" + (f" (incl. {rejected} rejected)" if rejected else "")
    for times, label in ((arrivals, "arrived"), (ended, ended_label)):
        if times:
            x, y = _cumulative(times, max_points)
            a_prog.step(x, y, where="post", label=label)
    if arrivals:
        a_prog.legend(loc="upper left")
    else:
        _no_data(a_prog)
    for ax in (a_queue, a_prog):
        ax.yaxis.set_major_locator(MaxNLocator(integer=True))

    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=100)


def progress_curves(records: list[RequestRecord]) -> tuple[list[float], list[float]]:
    """Sorted arrival times, and sorted end times of every request that ended: finished,
    aborted, or rejected (a rejected request ends when it arrives)."""
    arrivals = sorted(r.arrival for r in records)
    ended = sorted(
        r.finish if r.finish is not None else r.arrival
        for r in records
        if r.status in ("finished", "aborted", "rejected")
    )
    return arrivals, ended


def timeline_with_breaks(steps: Sequence[StepRecord], picked: list[int]) -> list[float]:
    """The times of the picked steps, with a NaN wherever the engine sat idle between two
    of them, so that a timeline breaks there instead of drawing a line across the gap.

    Idle before step i: step i - 1 left no request running or waiting, and step i began
    after it ended. (A gap alone is not idleness: between two steps the host schedules
    and applies results, a gap in every synchronous step log, real or simulated.)"""
    idle_seen, count = [], 0
    for i, st in enumerate(steps):
        prev = steps[i - 1] if i else None
        if (
            prev is not None
            and prev.num_running + prev.num_waiting == 0
            and st.time - st.duration > prev.time + 1e-9
        ):
            count += 1
        idle_seen.append(count)
    out: list[float] = []
    for k, i in enumerate(picked):
        if k and idle_seen[i] > idle_seen[picked[k - 1]]:
            out.append(float("nan"))
        out.append(steps[i].time)
    return out


def _gapped(values: list[Any], times: list[float]) -> list[Any]:
    """`values` aligned with `timeline_with_breaks` times (NaN at the breaks)."""
    out: list[Any] = []
    it = iter(values)
    for t in times:
        out.append(float("nan") if t != t else next(it))
    return out


def _cumulative(times: list[float], max_points: int) -> tuple[list[float], list[int]]:
    """A sorted list of event times as a step curve from 0 to len(times), sampled."""
    counts = downsample(list(range(1, len(times) + 1)), max_points)
    # Start at zero so a single event still draws a visible rise.
    return [times[0], *downsample(times, max_points)], [0, *counts]
