"""Why a lone prefill served by the engine is slower on the device than the profile's
prefill point of the same shape (issue 46: lone prefills priced 10-35% low).

    python -m benchmarks.investigations.lone_prefill [--model moonlight-16b-a3b]
        [--quantization fp8] [--sizes 64,147,694,2648] [--reps 5] [--idle 0.05]

For each prompt size, in one process on one executor, `--reps` times each:
- grid: the profiler's way (executors/profile_session.py: the same request's prompt sent
  again whole, one step at a time);
- engine: a fresh request of that size through EngineCore (async scheduling, as served),
  after `--idle` seconds with nothing running; then the same with the collector off.
Each row gives medians of the step's wall (launch to result), its device span (CUDA
events around the launch), the host's time inside the launch (`runner.launch`), and the
device allocations (cudaMalloc) made during the step.

With `--mixed N`, the same for a chunk beside N decoding requests (at a 4,096-token
context): the profiler's own timing of the mixed point (`executors/profiler.py`: its
sequential and pipelined seconds), and through the engine, N requests decoding when a
prompt arrives (the mixed step that starts it).
"""

from __future__ import annotations

import argparse
import cProfile
import gc
import pstats
import random
import statistics
import time
from typing import Any

import torch

from benchmarks.step_events import StepEvents
from deepinfer.config import EngineConfig
from deepinfer.engine import EngineCore
from deepinfer.outputs import SchedulerOutput
from deepinfer.request import Request
from deepinfer.sampling_params import SamplingParams
from executors.profile_grid import StepShape
from executors.profile_session import StepSession
from executors.profiler import _run_shape, _Runs
from executors.torch_executor import TorchExecutor


def _allocs() -> int:
    return int(torch.cuda.memory_stats().get("num_device_alloc", 0))


class _LaunchTimer:
    """The host's seconds inside `runner.launch`, by step id; `profile`: also run each
    launch of a step with prompt tokens under it (where the host's time goes)."""

    def __init__(self, runner: Any, profile: cProfile.Profile | None = None) -> None:
        self.runner, self.inner = runner, runner.launch
        self.seconds: dict[int, float] = {}

        def timed(out: SchedulerOutput) -> Any:
            prof = profile if any(sr.is_prompt for sr in out.scheduled) else None
            t0 = time.perf_counter()
            handle = self.inner(out) if prof is None else prof.runcall(self.inner, out)
            self.seconds[out.step_id] = time.perf_counter() - t0
            return handle

        runner.launch = timed


def grid_rows(ex: TorchExecutor, size: int, reps: int) -> list[tuple[float, float, float, int]]:
    """(wall, device span, host launch, allocations) of `reps` profiler-style steps."""
    shape = StepShape("prefill", ((1, size, 0, True, 0),))
    session = StepSession(shape, ex.runner, random.Random(size), reps=reps + 1)
    session.advance(ex.execute(SchedulerOutput(-1, session.first)))
    rows = []
    timer = _LaunchTimer(ex.runner)
    try:
        for i in range(reps):
            out = session.next_step()
            out.step_id = 10_000 + i
            torch.cuda.synchronize()
            a0 = _allocs()
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            t0 = time.perf_counter()
            start.record()
            handle = ex.execute_async(out)
            end.record()
            res = handle.result()
            wall = time.perf_counter() - t0
            torch.cuda.synchronize()
            session.advance(res)
            rows.append(
                (wall, start.elapsed_time(end) / 1e3, timer.seconds[out.step_id], _allocs() - a0)
            )
    finally:
        del ex.runner.launch
    ex.execute(session.finish())
    return rows


SHORT = SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True)


def _prompt_step(
    engine: EngineCore, ex: TorchExecutor, timer: _LaunchTimer, req: Request
) -> tuple[float, float, float, int]:
    """Add `req` and step the engine until it ends: (wall, device span, host launch,
    allocations) of the step that ran its prompt."""
    engine.add_request(req)
    first = len(engine.steps)
    a0 = _allocs()
    with StepEvents(ex) as events:
        while not req.is_finished:
            engine.step()
    allocs = _allocs() - a0
    rec = next(r for r in engine.steps[first:] if r.num_prompt_tokens)
    got = events.step(rec.step_id)
    return rec.duration, got[0] if got else float("nan"), timer.seconds[rec.step_id], allocs


def engine_rows(
    engine: EngineCore, ex: TorchExecutor, size: int, reps: int, idle: float, tag: str
) -> list[tuple[float, float, float, int]]:
    """The same for fresh requests through the engine, each after `idle` seconds."""
    rows = []
    vocab = ex.config.vocab_size
    rng = random.Random(f"{tag}-{size}")  # (prompts of their own: no prefix hit)
    timer = _LaunchTimer(ex.runner)
    try:
        for i in range(reps):
            time.sleep(idle)
            prompt = [rng.randrange(10, vocab - 10) for _ in range(size)]
            rows.append(
                _prompt_step(engine, ex, timer, Request(f"{tag}-{size}-{i}", prompt, SHORT))
            )
    finally:
        del ex.runner.launch
    return rows


def profiler_mixed(ex: TorchExecutor, decodes: int, size: int, reps: int) -> tuple[float, float]:
    """(sequential, pipelined) medians of the mixed point as `deepinfer profile` times it."""
    shape = StepShape("mixed", ((decodes, 1, 4096, False, 0), (1, size, 0, True, 0)))
    runs = _Runs()
    _run_shape(ex, shape, reps, random.Random(size), None, runs)
    return statistics.median(runs.times), statistics.median(runs.pipelined)


def engine_mixed(
    engine: EngineCore,
    ex: TorchExecutor,
    decodes: int,
    size: int,
    reps: int,
    tag: str = "m",
    profile: cProfile.Profile | None = None,
) -> list[tuple[float, float, float, int]]:
    """`decodes` requests (4,096-token prompts) decoding, then a prompt of `size` tokens
    arrives, `reps` times: the mixed step that starts it, as `engine_rows` reports
    (`tag`: prompts of their own, no prefix hit; `profile`: its launches run under it)."""
    vocab = ex.config.vocab_size
    rng = random.Random(f"{tag}-{decodes}-{size}")
    long = SamplingParams(temperature=0.0, max_tokens=10_000, ignore_eos=True)
    decoding = []
    for i in range(decodes):
        prompt = [rng.randrange(10, vocab - 10) for _ in range(4096)]
        decoding.append(Request(f"d-{tag}-{size}-{i}", prompt, long))
        engine.add_request(decoding[-1])
    while not all(r.output_token_ids for r in decoding):  # (their prompts done)
        engine.step()
    rows = []
    timer = _LaunchTimer(ex.runner, profile)
    try:
        for i in range(reps):
            prompt = [rng.randrange(10, vocab - 10) for _ in range(size)]
            rows.append(
                _prompt_step(engine, ex, timer, Request(f"{tag}-{size}-{i}", prompt, SHORT))
            )
    finally:
        del ex.runner.launch
    for r in decoding:
        engine.abort(r.request_id)
    while engine.has_unfinished():
        engine.step()
    return rows


def _line(name: str, size: int, rows: list[tuple[float, float, float, int]]) -> str:
    med = [statistics.median(col) for col in zip(*rows)]
    spans = sorted(1e3 * r[1] for r in rows)
    return (
        f"{name:14s} {size:6d} tokens: wall {1e3 * med[0]:7.2f} ms  device {1e3 * med[1]:7.2f} ms "
        f"(min {spans[0]:.2f} max {spans[-1]:.2f})  host launch {1e3 * med[2]:6.2f} ms  "
        f"cudaMalloc {sum(r[3] for r in rows)}"
    )


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default="moonlight-16b-a3b")
    p.add_argument("--quantization", default=None)
    p.add_argument("--sizes", default="64,147,694,2648")
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--idle", type=float, default=0.05)
    p.add_argument("--mixed", type=int, default=0, help="decodes beside the chunk (0: none)")
    args = p.parse_args()
    cfg = EngineConfig(
        num_gpu_blocks=20000, max_num_seqs=256, max_num_batched_tokens=8192,
        block_size=64, async_scheduling=True, quantization=args.quantization,
    )  # fmt: skip
    ex = TorchExecutor(cfg, args.model, load_format="dummy")
    engine = EngineCore(cfg, ex)
    sizes = [int(s) for s in args.sizes.split(",")]
    if args.mixed:
        for size in sizes:
            engine_mixed(engine, ex, args.mixed, size, 1, "w")  # (warm-up)
            seq, pipe = profiler_mixed(ex, args.mixed, size, args.reps)
            print(
                f"profiler mixed {size:6d} tokens beside {args.mixed}: sequential "
                f"{1e3 * seq:7.2f} ms  pipelined {1e3 * pipe:7.2f} ms",
                flush=True,
            )
            rows = engine_mixed(engine, ex, args.mixed, size, args.reps)
            print(_line("engine mixed", size, rows), flush=True)
        # Where a mixed step's launch spends the host's time (cProfile's own overhead
        # inflates it: read the shares, not the sum).
        prof = cProfile.Profile()
        engine_mixed(engine, ex, args.mixed, sizes[0], args.reps, "p", prof)
        pstats.Stats(prof).sort_stats("tottime").print_stats(25)
        pstats.Stats(prof).sort_stats("cumulative").print_stats(30)
        return
    for size in sizes:  # warm-up: every path once
        grid_rows(ex, size, 1)
        engine_rows(engine, ex, size, 1, 0.0, "warm")
    for size in sizes:
        print(_line("grid", size, grid_rows(ex, size, args.reps)), flush=True)
        print(_line("engine", size, engine_rows(engine, ex, size, args.reps, args.idle, "e")))
        gc.disable()
        try:
            rows = engine_rows(engine, ex, size, args.reps, args.idle, "g")
        finally:
            gc.enable()
        print(_line("engine, gc off", size, rows))
        print(_line("engine, no idle", size, engine_rows(engine, ex, size, args.reps, 0.0, "n")))


if __name__ == "__main__":
    main()
