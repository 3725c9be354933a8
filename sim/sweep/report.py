"""The sweep's terminal table and PNG plots, read from the rows alone.

rich and matplotlib are imported inside the functions, so importing the sweep is cheap.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from sim.sweep.slo import SweepSLO

MAX_PLOTTED = 10  # configs drawn in the plot: more lines than this cannot be told apart


def cost_model_text(row: dict[str, Any]) -> str:
    name = row.get("cost_model")
    if name is None:
        return "-"
    return name if row.get("calibrated") else f"{name} (uncalibrated)"


def print_table(configs: list[dict[str, Any]], title: str, console: Any = None) -> None:
    """The ranked configs, best first, with the cost model each used."""
    from rich.console import Console
    from rich.table import Table

    table = Table(title=title, title_justify="left")
    plans = any(r.get("gpus") is not None for r in configs)
    columns = [
        ("#", "right"),
        ("config", "left"),
        ("max req/s", "right"),
        ("tok/s out", "right"),
        ("TTFT p50/p99 ms", "right"),
        ("TPOT p50/p99 ms", "right"),
        ("KV max", "right"),
    ]
    if plans:
        columns += [("GPUs", "right"), ("$/Mtok out", "right")]
    columns += [("cost model", "left"), ("points", "right"), ("note", "left")]
    for name, justify in columns:
        # The config names the knobs: folding it mid-name makes it unreadable.
        table.add_column(name, justify=justify, no_wrap=name == "config")  # type: ignore[arg-type]
    for r in configs:
        cells = [
            str(r["rank"]),
            r["config"] or "-",
            _num(r["max_rate"], "{:.3g}") if r["max_rate"] is not None else "none",
            _num(r.get("output_throughput"), "{:.0f}"),
            f"{_num(r.get('ttft_ms_p50'))} / {_num(r.get('ttft_ms_p99'))}",
            f"{_num(r.get('tpot_ms_p50'))} / {_num(r.get('tpot_ms_p99'))}",
            _num(r.get("kv_usage_max"), "{:.0%}"),
        ]
        if plans:
            cells += [
                _num(r.get("gpus"), "{:d}"),
                _num(r.get("per_million_output_tokens"), "{:.3f}"),
            ]
        cells += [cost_model_text(r), str(r.get("points", 0)), _note(r)]
        table.add_row(*cells)
    (console or Console(width=160)).print(table)


def plot_sweep(
    path: Path, configs: list[dict[str, Any]], points: list[dict[str, Any]], slo: SweepSLO
) -> None:
    """Each SLO metric (and throughput) against the rate, one line per config, the SLO as
    a dashed line and each config's knee (its max rate) as a star."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels: list[tuple[str, str, float | None]] = [
        (key, f"{key.replace('_ms_', ' ')} (ms)", limit) for key, limit in slo.limits.items()
    ]
    if slo.goodput is not None:
        panels.append(("good_fraction", "requests meeting the SLO (fraction)", slo.goodput))
    panels.append(("request_throughput", "throughput (req/s)", None))
    shown = [c for c in configs if c.get("max_rate") is not None][:MAX_PLOTTED]
    fig, axes = plt.subplots(1, len(panels), figsize=(5.5 * len(panels), 4.5), squeeze=False)
    for ax, (key, ylabel, limit) in zip(axes[0], panels, strict=True):
        for c in shown:
            mine = [
                p for p in points if p["config_key"] == c["config_key"] and p.get(key) is not None
            ]
            if not mine:
                continue
            xs = [p["rate"] for p in mine]
            (line,) = ax.plot(
                xs, [p[key] for p in mine], marker=".", label=f"#{c['rank']} {c['config']}"
            )
            knee = (
                next(p for p in mine if p["rate"] == c["max_rate"]) if c["max_rate"] in xs else None
            )
            if knee is not None:
                ax.plot([knee["rate"]], [knee[key]], marker="*", ms=12, color=line.get_color())
        if limit is not None:
            ax.axhline(limit, ls="--", color="black", lw=1, label="SLO")
        ax.set_xscale("log")
        if key.endswith(("_p50", "_p99", "_p90", "_mean", "_max")):
            ax.set_yscale("log")
        ax.set_xlabel("request rate (req/s, Poisson)")
        ax.set_ylabel(ylabel)
        ax.grid(True, which="both", alpha=0.3)
    axes[0][0].legend(fontsize=7, loc="upper left")
    more = len([c for c in configs if c.get("max_rate") is not None]) - len(shown)
    title = f"sweep: SLO {slo.text}; star = max rate meeting the SLO"
    fig.suptitle(
        title + (f" (best {MAX_PLOTTED} configs; {more} more in configs.csv)" if more > 0 else "")
    )
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def plot_pareto(path: Path, configs: list[dict[str, Any]]) -> None:
    """Cluster plans at their max rate meeting the SLO: cost per million output tokens
    against that rate, and output throughput per GPU against TPOT p99; the plans no other
    plan beats on both axes (the Pareto front) joined by a line."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    plans = [
        c
        for c in configs
        if c.get("max_rate") is not None and c.get("per_million_output_tokens") is not None
    ]
    fig, axes = plt.subplots(1, 2, figsize=(12, 4.8))
    panels = (
        ("max_rate", "per_million_output_tokens", "max request rate meeting the SLO (req/s)",
         "US$ per million output tokens", (False, True)),
        ("tpot_ms_p99", "per_gpu", "TPOT p99 at that rate (ms)",
         "output tokens/s per GPU", (True, False)),
    )  # fmt: skip
    for ax, (xk, yk, xlabel, ylabel, (x_low, y_low)) in zip(axes, panels, strict=True):
        pts = []
        for c in plans:
            y = (
                c["output_throughput"] / c["gpus"]
                if yk == "per_gpu" and c.get("output_throughput") and c.get("gpus")
                else c.get(yk)
            )
            if c.get(xk) is not None and y is not None:
                pts.append((c[xk], y, c))
        for x, y, c in pts:
            ax.plot([x], [y], "o", color="tab:blue")
            ax.annotate(
                f"#{c['rank']}", (x, y), fontsize=7, xytext=(3, 3), textcoords="offset points"
            )
        front = _pareto([(x, y) for x, y, _ in pts], x_low, y_low)
        if front:
            ax.plot(*zip(*front, strict=True), "-", color="tab:orange", label="Pareto front")
            ax.legend(fontsize=8)
        ax.set_xlabel(xlabel)
        ax.set_ylabel(ylabel)
        ax.grid(True, alpha=0.3)
    fig.suptitle("cluster plans at their max rate meeting the SLO (#: rank in configs.csv)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _pareto(pts: list[tuple[float, float]], x_low: bool, y_low: bool) -> list[tuple[float, float]]:
    """The points no other point beats on both axes (lower or higher as each says)."""

    def beats(a: tuple[float, float], b: tuple[float, float]) -> bool:
        bx = a[0] <= b[0] if x_low else a[0] >= b[0]
        by = a[1] <= b[1] if y_low else a[1] >= b[1]
        return bx and by and a != b

    return sorted(p for p in pts if not any(beats(q, p) for q in pts))


def _note(row: dict[str, Any]) -> str:
    note, status = row.get("note") or "", row["status"]
    if status == "ok" or note.startswith(status):
        return note
    return f"{status}: {note}" if note else status


def _num(v: Any, fmt: str = "{:.1f}") -> str:
    return "-" if v is None else fmt.format(v)
