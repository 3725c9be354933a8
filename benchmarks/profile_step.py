"""Where one engine step spends its time: torch.profiler over real-executor steps.

    python -m benchmarks.profile_step [--model moonlight-16b-a3b] [--prefill 16384]
        [--batches 1,64] [--context 1024] [--rows 25] [--trace-dir DIR] [--batch-invariant]
        [--async-scheduling]

For each case it runs the step once to warm up, then profiles a second identical
step and prints the CUDA kernels by total device time, plus the step's wall time
against the sum of device time (a large gap means the step is launch- or
host-bound). `--trace-dir` also writes Chrome traces (open in Perfetto).

The host's parts of a step (the scheduler, the runner's batch building, the forward's
launch, sampling, the drafter, the engine's output processing) are marked as profiler
regions, and the GPU's idle time is charged to the region the host was in when the
GPU ran dry: "GPU idle by host region" says what to move off the critical path.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import time
from collections import Counter
from pathlib import Path

import torch
from torch.autograd import DeviceType
from torch.profiler import ProfilerActivity, profile, record_function

from benchmarks.model_speed import build, random_prompts, sweep_config
from deepinfer.config import EngineConfig
from deepinfer.engine import EngineCore
from deepinfer.request import Request
from deepinfer.sampling_params import SamplingParams


def run_case(
    ex,
    cfg: EngineConfig,
    prompts: list[list[int]],
    decode_steps: int,
    tag: str,
    rows: int,
    trace_dir: Path | None,
    sort_by: str = "self_cuda_time_total",
) -> None:
    """Prefill `prompts` (profiled when decode_steps == 0), else profile decode steps."""
    for attempt in ("warm", "prof"):
        core = EngineCore(cfg, ex, model_max_len=ex.max_model_len)
        # The first prompts decode while the last ones prefill: each request generates
        # one token a prefill step more (and one for the decodes that share the budget
        # meanwhile), so that none finishes before the batch is whole. A prefill case
        # stops at one token: a second would add a decode step to the one profiled
        # (under async scheduling it is launched before the prefill is read).
        extra = 0
        if decode_steps:
            extra = -(-sum(map(len, prompts)) // cfg.max_num_batched_tokens) + 1
        sp = SamplingParams(temperature=0.0, max_tokens=decode_steps + extra + 1, ignore_eos=True)
        for i, p in enumerate(prompts):
            core.add_request(Request(f"{tag}-{attempt}-{i}", p, sp))
        while core.has_unfinished() and (decode_steps == 0 or not _all_decoding(core)):
            if decode_steps == 0 and attempt == "prof":
                break
            core.step()
        if attempt == "warm":
            while core.has_unfinished():
                core.step()
            continue
        batch = len(core.scheduler.running) or len(prompts)  # (a prefill: all waiting)
        torch.cuda.synchronize()
        with (
            _mark_regions(core, ex),
            profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof,
        ):
            t0 = time.perf_counter()
            n = 0
            while core.has_unfinished() and (n < max(decode_steps, 1)):
                core.step()
                batch = min(batch, len(core.scheduler.running) or batch)
                n += 1
            torch.cuda.synchronize()
            wall = (time.perf_counter() - t0) / n
        _print_idle(prof, n)
        events = prof.key_averages()
        # Kernels only (aten ops on the CPU side would count their kernels twice).
        device_us = (
            sum(e.self_device_time_total for e in events if e.device_type == DeviceType.CUDA) / n
        )
        print(
            f"\n== {tag}: {n} step(s) of {batch} requests, wall {wall * 1e3:.2f} ms/step, "
            f"device busy {device_us / 1e3:.2f} ms/step ({device_us / 1e6 / wall:.0%})"
        )
        print(events.table(sort_by=sort_by, row_limit=rows, max_name_column_width=60))
        if trace_dir is not None:
            trace_dir.mkdir(parents=True, exist_ok=True)
            prof.export_chrome_trace(str(trace_dir / f"{tag}.json"))


# (object, method) pairs whose calls become profiler regions; the innermost region the
# host is in when the GPU runs out of work is charged with the idle time.
def _mark_regions(core: EngineCore, ex, extra: tuple = ()) -> contextlib.ExitStack:
    stack = contextlib.ExitStack()
    runner = ex.runner
    targets = [
        *extra,
        (core, "schedule"),
        (core, "apply_results"),
        (runner, "update_states"),
        (runner.inputs, "collect"),
        (runner, "launch"),
        (runner, "_sample"),
        (runner, "_finish"),
    ]
    if runner.speculator is not None:
        targets.append((runner.speculator, "draft"))
    if runner.graphs is not None:
        targets += [(runner.graphs, "run"), (runner.graphs, "_load")]
    if runner.piecewise is not None:
        targets.append((runner.piecewise, "run"))
    for obj, name in targets:
        fn = getattr(obj, name)
        label = f"host:{type(obj).__name__}.{name}"

        @functools.wraps(fn)
        def marked(*a, _fn=fn, _label=label, **kw):
            with record_function(_label):
                return _fn(*a, **kw)

        setattr(obj, name, marked)
        stack.callback(delattr, obj, name)  # the instance attribute shadowed the method
    return stack


def _print_idle(prof, steps: int) -> None:
    """GPU idle gaps between kernels, each moment charged to the innermost host region
    then running ("(engine)" outside them: the engine's own loop)."""
    events = [e for e in prof.events() if e.time_range is not None]
    kernels = sorted(
        (e.time_range.start, e.time_range.end)
        for e in events
        if e.device_type == DeviceType.CUDA
        and not e.name.startswith("host:")  # (the regions' device-side twins)
        and e.time_range.end > e.time_range.start
    )
    regions = [
        (e.time_range.start, e.time_range.end, e.name)
        for e in events
        if e.device_type == DeviceType.CPU and e.name.startswith("host:")
    ]
    if not kernels:
        return
    idle: Counter[str] = Counter()
    end = kernels[0][1]
    for start, stop in kernels[1:]:
        if start > end:  # idle from `end` to `start`: split it at the regions' edges
            cuts = sorted({end, start} | {t for r in regions for t in r[:2] if end < t < start})
            for a, b in zip(cuts, cuts[1:]):
                mid = (a + b) / 2
                inside = [r for r in regions if r[0] <= mid < r[1]]
                label = min(inside, key=lambda r: r[1] - r[0])[2] if inside else "(engine)"
                idle[label] += b - a
        end = max(end, stop)
    total = sum(idle.values())
    print(f"GPU idle between kernels: {total / steps / 1e3:.3f} ms/step, by host region:")
    for label, us in idle.most_common(10):
        print(f"  {label:<40} {us / steps / 1e3:8.3f} ms/step")


def _all_decoding(core: EngineCore) -> bool:
    """True once no request is waiting or still prefilling."""
    sched = core.scheduler
    return not sched.waiting and all(
        r.num_computed_tokens >= r.num_prompt_tokens for r in sched.running
    )


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default="moonlight-16b-a3b")
    p.add_argument("--prefill", default="16384")
    p.add_argument("--batches", default="1,64")
    p.add_argument("--context", type=int, default=1024)
    p.add_argument("--decode-steps", type=int, default=4)
    p.add_argument("--rows", type=int, default=25)
    p.add_argument("--trace-dir", type=Path, default=None)
    p.add_argument(
        "--sort",
        default="self_cuda_time_total",
        help="profiler table order, e.g. self_cpu_time_total for host-bound steps",
    )
    p.add_argument(
        "--batch-invariant", action="store_true", help="profile steps in batch-invariant mode"
    )
    p.add_argument(
        "--async-scheduling", action="store_true", help="launch step N+1 while step N runs"
    )
    p.add_argument("--quantization", default=None, help="fp8: the weights quantized at load time")
    args = p.parse_args()
    dev = torch.device("cuda")
    batches = [int(x) for x in args.batches.split(",") if x]
    prefills = [int(x) for x in args.prefill.split(",") if x]
    # A cache that holds the largest batch whole (as the sweep sizes it): with too few
    # blocks some requests would wait or be preempted and the step would not be batch B.
    cfg = sweep_config(
        max([*batches, 256]), args.context, args.decode_steps + 1, max([*prefills, 1])
    ).replace(
        batch_invariant=args.batch_invariant,
        async_scheduling=args.async_scheduling,
        quantization=args.quantization,
    )
    ex, _, spec = build(args.model, dev, cfg, with_hf=False)
    for n in prefills:
        prompts = random_prompts(max(n // 1024, 1), min(n, 1024), spec.vocab_size, n)
        run_case(
            ex,
            cfg.replace(max_num_batched_tokens=max(n, 1024)),
            prompts,
            0,
            f"prefill{n}",
            args.rows,
            args.trace_dir,
            args.sort,
        )
    for b in batches:
        prompts = random_prompts(b, args.context, spec.vocab_size, b)
        run_case(
            ex,
            cfg,
            prompts,
            args.decode_steps,
            f"decode_b{b}",
            args.rows,
            args.trace_dir,
            args.sort,
        )


if __name__ == "__main__":
    main()
