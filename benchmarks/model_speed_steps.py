"""The sweep's step rows beyond pure prefill and decode (`benchmarks/model_speed.py`).

- mixed: one prompt chunk of P tokens beside D decodes at context C, timed as the
  profiler times its points (`profile_steps`: whole `executor.execute` steps, the same
  requests again each repetition, contexts of random latents);
- short prompts: N prompts of L tokens in one step, timed the same way;
- served: the bundled Azure code trace replayed in wall-clock time at a fixed rate of
  Poisson arrivals (`benchmarks/replay.py`), as a user serves it: throughput, TTFT and
  TPOT p50 / p99.

Each against its roofline (`benchmarks/step_roofline.py`: the larger of its FLOPs over the
matmul rate and the bytes it must read over the copy bandwidth); the served figure against
the summed rooflines of the steps it ran, over the time those steps took.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np

from benchmarks.replay import poisson, replay
from benchmarks.step_roofline import step_roofline_s
from deepinfer.config import EngineConfig
from deepinfer.model_config import ModelConfig
from executors.profile_grid import StepShape
from executors.profiler import profile_steps
from executors.torch_executor import TorchExecutor
from sim import load_trace
from sim.traces import Trace

TRACES = Path(__file__).resolve().parents[1] / "traces"


def step_rows(
    ex: TorchExecutor,
    spec: ModelConfig,
    mixed: list[tuple[int, int]],
    short: list[tuple[int, int]],
    context: int,
    bw: float,
    peak: float,
    reps: int = 10,
) -> list[dict[str, Any]]:
    """mixed: (decodes D, prompt tokens P) pairs at decode context `context`; short:
    (prompts N, tokens L) pairs."""
    shapes: list[tuple[dict[str, Any], tuple[tuple[int, ...], ...]]] = []
    for d, p in mixed:
        groups = ((d, 1, context, False, 0), (1, p, 0, True, 0))
        shapes.append((dict(kind="mixed", decodes=d, prompt=p, context=context), groups))
    for n, length in short:
        groups = ((n, length, 0, True, 0),)
        shapes.append((dict(kind="short_prompts", prompts=n, tokens=length), groups))
    points = profile_steps(ex, [StepShape(r["kind"], g) for r, g in shapes], reps)
    rows = []
    for (row, groups), point in zip(shapes, points, strict=True):
        roof = step_roofline_s(spec, [list(g) for g in groups], bw, peak)
        row |= dict(ours_step_ms=1e3 * point["median_s"], roofline_step_ms=1e3 * roof)
        rows.append(row)
        print(row, flush=True)
    return rows


def served_row(
    ex: TorchExecutor,
    cfg: EngineConfig,
    spec: ModelConfig,
    rate: float,
    num_requests: int,
    bw: float,
    peak: float,
    trace_name: str = "azure_code_small.json",
) -> dict[str, Any]:
    """The bundled trace at `rate` requests/s (Poisson, seeded), served for real."""
    base = load_trace(TRACES / trace_name)
    limit = min(ex.max_model_len, ex.num_kv_blocks() * cfg.block_size)
    fitting = [r for r in base.requests if r.prompt_len + r.output_len <= limit]
    trace = Trace(base.name, base.source, fitting[:num_requests])
    real = replay(ex, cfg, poisson(trace, rate, seed=cfg.seed), model_max_len=ex.max_model_len)
    done = [r for r in real.records if r.status == "finished" and r.first_token is not None]
    if not done:
        raise ValueError(f"served {trace_name}: no request finished ({len(trace)} fit the cache)")
    ttft = [r.first_token - r.arrival for r in done]
    tpot = [
        (r.finish - r.first_token) / (r.num_output_tokens - 1)
        for r in done
        if r.finish is not None and r.num_output_tokens > 1
    ]
    busy = sum(s.wall_s for s in real.steps)
    roof = sum(
        step_roofline_s(spec, [[1, q, c, p] for q, c, p in s.requests], bw, peak)
        for s in real.steps
    )
    tokens = sum(r.num_output_tokens for r in done)
    row = dict(
        kind="served", trace=trace_name, rate=rate, requests=len(done),
        output_tok_s=tokens / real.wall_s, req_s=len(done) / real.wall_s,
        ttft_p50_ms=1e3 * float(np.percentile(ttft, 50)),
        ttft_p99_ms=1e3 * float(np.percentile(ttft, 99)),
        tpot_p50_ms=1e3 * float(np.percentile(tpot, 50)) if tpot else float("nan"),
        tpot_p99_ms=1e3 * float(np.percentile(tpot, 99)) if tpot else float("nan"),
        steps=len(real.steps), busy_s=busy, roofline_s=roof,
    )  # fmt: skip
    print(row, flush=True)
    return row


def print_step_table(rows: list[dict[str, Any]]) -> None:
    steps = [r for r in rows if r["kind"] in ("mixed", "short_prompts")]
    if steps:
        print("\n| step | deepinfer ms | roofline ms | roofline / deepinfer |")
        print("|---|---:|---:|---:|")
    for r in steps:
        if r["kind"] == "mixed":
            name = f"mixed: {r['decodes']} decodes @ {r['context']:,} + prompt {r['prompt']:,}"
        else:
            name = f"{r['prompts']} prompts of {r['tokens']} tokens"
        ours, roof = r["ours_step_ms"], r["roofline_step_ms"]
        print(f"| {name} | {ours:.2f} | {roof:.2f} | {roof / ours:.2f} |")
    for r in rows:
        if r["kind"] == "served":
            print(
                f"\nserved {r['trace']} at {r['rate']} req/s ({r['requests']} requests): "
                f"{r['output_tok_s']:,.0f} output tok/s, {r['req_s']:.2f} req/s; TTFT p50 / p99 "
                f"{r['ttft_p50_ms']:.0f} / {r['ttft_p99_ms']:.0f} ms, TPOT p50 / p99 "
                f"{r['tpot_p50_ms']:.1f} / {r['tpot_p99_ms']:.1f} ms; its {r['steps']} steps "
                f"took {r['busy_s']:.2f} s against a summed roofline of {r['roofline_s']:.2f} s "
                f"({r['roofline_s'] / r['busy_s']:.2f})"
            )
