"""Profile the real executor: whole engine steps over a grid of step shapes.

Each point is one SchedulerOutput built to a shape (decode: B requests of one token over
a context; prefill: a chunk of P tokens after C cached ones; mixed: D decodes beside a
prefill chunk; many short prompts; when speculating, verify: B requests each scoring
1 + k tokens), run through `executor.execute` exactly as `EngineCore.step` runs it:
input preparation, the forward (a CUDA graph where the engine would replay one), the
sampler and its host sync, and, where the point says so, the MTP drafter's proposal
after the step (a speculating engine drafts after every step). Decode and verify
requests advance between the timed runs as the scheduler would move them (by the tokens
each step accepted, drafts taken from the drafter's last proposal). Host work outside
the executor (the scheduler, output processing) is measured separately from a short
real run through `EngineCore`. The result is the profile JSON the simulator's profiled
cost model fits.

A point: kind; groups, each [count, query, context, is_prompt] plus, for verify
requests, the drafts each verifies (the last tokens of its query); median_s, p10_s,
p90_s over its timed runs (reps); kernel variants compiled while it ran; and for steps
followed by the drafter, `drafter` (drafts it proposes) and `draft_s` (its median
seconds, inside median_s); `pipelined_s`, seconds a step with each launched before the
one before it is read (async scheduling), for every point but prompt chunks followed
by the drafter (priced by the plain fit). On CUDA, for the points without the drafter
that have `pipelined_s`: `launch_s`, the host's seconds inside the launch
(`execute_async`) of those pipelined steps, and `device_s`, the device's own seconds for
the step, timed with every kernel of it queued before the device reaches the first
(`_device_only`); None where the launch waited on the device, so its kernels could not
all be queued first (a one-off stall in one run does it too). A step bound by its launch
(the host issuing a piecewise step's eager attention layer by layer) has `device_s` well
under `pipelined_s`: the simulator keeps the host busy for its launch and prices the
device's own work apart (sim/cost_model.py, `CostModel.launch_seconds`).

A shape's requests and how they advance: executors/profile_session.py. Where the numbers
come from (device, versions, commit): executors/profile_env.py.
"""

from __future__ import annotations

import functools
import random
import statistics
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import torch

from deepinfer.engine import EngineCore
from deepinfer.outputs import SchedulerOutput
from deepinfer.request import Request
from deepinfer.sampling_params import SamplingParams
from executors.profile_grid import StepShape
from executors.profile_session import StepSession
from kernels.compile_stats import total_compiled


class _TimedDrafter:
    """The runner's MTP drafter, timed: the seconds of its work after each step. On the
    host path from the sampler's host sync to the drafts on the host (its last pass
    syncs); on the device path by CUDA events around its kernels (read once the step
    is: timing it with synchronisations would add their gaps to the step)."""

    def __init__(self, inner: Any) -> None:
        self.inner = inner
        self.host_seconds = 0.0
        self._events: list[tuple[Any, Any]] = []

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)

    def reset(self) -> None:
        self.host_seconds = 0.0
        self._events = []

    @property
    def seconds(self) -> float:
        """The drafter's time since `reset` (its events must have completed)."""
        return self.host_seconds + sum(a.elapsed_time(b) for a, b in self._events) / 1e3

    def step_inputs(self, *args: Any) -> Any:
        t0 = time.perf_counter()
        try:
            return self.inner.step_inputs(*args)
        finally:
            self.host_seconds += time.perf_counter() - t0

    def propose(self, inputs: Any, num_drafts: int | None = None) -> Any:
        t0 = time.perf_counter()
        try:
            return self.inner.propose(inputs, num_drafts)
        finally:
            self.host_seconds += time.perf_counter() - t0

    def propose_on_device(self, *args: Any, **kwargs: Any) -> Any:
        """The drafter of a step on the device
        (SpeculativeDecoder.verify_and_draft_on_device)."""
        if self.inner.device.type != "cuda":  # (there the call does the work)
            t0 = time.perf_counter()
            try:
                return self.inner.propose_on_device(*args, **kwargs)
            finally:
                self.host_seconds += time.perf_counter() - t0
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        try:
            return self.inner.propose_on_device(*args, **kwargs)
        finally:
            end.record()
            self._events.append((start, end))


@contextmanager
def drafted_by(runner: Any, drafter: Any) -> Iterator[None]:
    """Steps whose drafts come from `drafter` (a wrapper of the runner's MTP drafter), or
    with None without the drafter: what a non-speculating engine runs. The runner's
    speculative decoder and its drafter are given back after."""
    speculator = runner.speculator
    inner = None if speculator is None else speculator.drafter
    if drafter is None:
        runner.speculator = None
    else:
        assert speculator is not None
        speculator.drafter = drafter
    try:
        yield
    finally:
        runner.speculator = speculator
        if speculator is not None:
            speculator.drafter = inner


@contextmanager
def drafter_detached(runner: Any) -> Iterator[None]:
    """Steps without the MTP drafter: what a non-speculating engine runs."""
    with drafted_by(runner, None):
        yield


def profile_steps(
    executor: Any,
    shapes: list[StepShape],
    reps: int = 5,
    seed: int = 0,
    on_point: Callable[[dict[str, Any]], None] | None = None,
    rounds: int = 1,
) -> list[dict[str, Any]]:
    """Median, p10, p90 of `executor.execute` over `reps` runs of each shape in each of
    `rounds` passes over the grid (more than one on a shared machine: a burst of load
    then hits one round of a point, not all its runs); shapes with the drafter also
    record its median seconds (`draft_s`) and the drafts it proposes (`drafter`).
    Shapes without it run with the drafter detached."""
    if rounds < 1:
        raise ValueError(f"rounds={rounds}: must be >= 1")
    rng = random.Random(seed)
    runner = executor.runner
    inner = None if runner.speculator is None else runner.speculator.drafter
    for shape in shapes:
        if shape.drafter and inner is None:
            raise ValueError(
                f"a {shape.kind} point needs the MTP drafter: the engine must speculate "
                "(num_speculative_tokens > 0) on a model with an MTP layer"
            )
    fill_context_kv(runner.kv_cache, seed)
    runs: list[_Runs] = [_Runs() for _ in shapes]
    for r in range(rounds):
        for shape, got in zip(shapes, runs):
            timed = _TimedDrafter(inner) if shape.drafter else None
            with drafted_by(runner, timed):
                _run_shape(executor, shape, reps, rng, timed, got)
            if r == rounds - 1 and on_point is not None:
                on_point(got.point(shape, timed))
    return [got.point(shape, inner if shape.drafter else None) for shape, got in zip(shapes, runs)]


def fill_context_kv(kv_cache: Any, seed: int) -> None:
    """Random latents in every block (MTP layers too), as if real text had been cached.

    A point's context is never prefilled: its requests attend to whatever the blocks
    hold. Zeros (a fresh cache) give every request the same attention output, so the
    requests of a decode point route to the same few experts, and on a MoE model a
    step that reads a few experts' weights instead of all of them is much faster than
    served steps of its shape."""
    gen = torch.Generator(device=kv_cache.layers[0].device).manual_seed(seed)
    for layer in [*kv_cache.layers, *kv_cache.mtp_layers]:
        layer.normal_(generator=gen)


@dataclass
class _Runs:
    """The timed runs of one shape, over the rounds."""

    times: list[float] = field(default_factory=list)
    drafting: list[float] = field(default_factory=list)
    pipelined: list[float] = field(default_factory=list)  # per round (no prompt beside drafts)
    launches: list[float] = field(default_factory=list)  # host seconds of pipelined launches
    devices: list[float | None] = field(default_factory=list)  # `_device_only`, per run
    compiled: int = 0

    def point(self, shape: StepShape, drafter: Any) -> dict[str, Any]:
        times = sorted(self.times)
        point: dict[str, Any] = {
            "kind": shape.kind,
            # [count, query, context, is_prompt] (+ drafts verified, where there are any)
            "groups": [list(g) if g[4] else list(g[:4]) for g in shape.groups],
            "num_reqs": shape.num_reqs,
            "num_tokens": shape.num_tokens,
            "median_s": statistics.median(times),
            "p10_s": times[int(0.1 * (len(times) - 1))],
            "p90_s": times[round(0.9 * (len(times) - 1))],
            "reps": len(times),
            "compiled": self.compiled,
        }
        if drafter is not None:
            point["drafter"] = drafter.k  # drafts it proposes after the step
            point["draft_s"] = statistics.median(self.drafting)
        if self.pipelined:
            point["pipelined_s"] = statistics.median(self.pipelined)
        if self.pipelined and self.launches and self.devices:
            point["launch_s"] = statistics.median(self.launches)
            valid = [d for d in self.devices if d is not None]
            # (None: some launch waited on the device, which a queued step cannot do)
            point["device_s"] = (
                statistics.median(valid) if len(valid) == len(self.devices) else None
            )
        return point


def _run_shape(
    executor: Any,
    shape: StepShape,
    reps: int,
    rng: random.Random,
    timed: _TimedDrafter | None,
    got: _Runs,
) -> None:
    session = StepSession(shape, executor.runner, rng, reps)
    compiled = total_compiled()
    # The first run builds the requests' state and warms caches.
    session.advance(executor.execute(SchedulerOutput(step_id=-1, scheduled=session.first)))
    for _ in range(reps):
        out = session.next_step()
        if timed is not None:
            timed.reset()
        t0 = time.perf_counter()
        res = executor.execute(out)
        got.times.append(time.perf_counter() - t0)
        if timed is not None:
            got.drafting.append(timed.seconds)
        session.advance(res)
    if timed is None and not any(session.drafts.values()):
        got.pipelined.append(_pipelined(executor, session, reps, got.launches))
        got.devices += _device_only(executor, session, reps, got.launches)
    elif timed is not None and not any(g[3] for g in shape.groups):
        # (the timer's synchronisations would end the overlap; a speculating engine's
        # launches are not priced apart: no launch or device-only times)
        with drafted_by(executor.runner, timed.inner):
            got.pipelined.append(_pipelined(executor, session, reps))
    executor.execute(session.finish())
    got.compiled += total_compiled() - compiled


def _pipelined(
    executor: Any, session: StepSession, reps: int, launches: list[float] | None = None
) -> float:
    """Seconds per step with each step launched before the one before it is read (async
    scheduling, ModelRunner.launch): the runner's host work overlaps the device's, so
    this is the longer of the two. The median of `reps` gaps between consecutive results
    once the pipeline is full, each with the next step launched in it: one stall (a
    collection, another tenant's burst) moves it little, where a mean over the run would
    carry it into the point. On a CPU each launch does its step's work, so a gap is one
    step there. launches (CUDA): gets the host's seconds inside each launch."""
    in_flight = executor.execute_async(session.next_step(pipelined=True))
    stamps: list[float] = []
    timed = launches if _on_cuda(executor) else None
    for _ in range(reps + 1):
        out = session.next_step(pipelined=True)
        t0 = time.perf_counter()
        launched = executor.execute_async(out)
        if timed is not None:
            timed.append(time.perf_counter() - t0)
        session.settle(in_flight.result())
        stamps.append(time.perf_counter())  # a result read with the next step queued
        in_flight = launched
    session.settle(in_flight.result())
    return statistics.median(b - a for a, b in zip(stamps, stamps[1:]))


def _on_cuda(executor: Any) -> bool:
    """The torch executor (the one `profile_steps` drives: it reads `executor.runner`)
    runs on CUDA."""
    return bool(executor.device.type == "cuda")


def _device_only(
    executor: Any, session: StepSession, reps: int, launches: list[float]
) -> list[float | None]:
    """The device's own seconds of `reps` steps (CUDA; empty elsewhere): each launched
    behind a sleeping kernel that outlasts its launch, so that every kernel of the step is
    queued before the device reaches the first, and the span of the launch's events
    (`execute_async`) holds no wait on the host. None for a run whose launch outlasted
    the sleep (the launch waited on the device: its span would hold the sleep's tail)."""
    if not launches or not _on_cuda(executor):
        return []
    # Twice the slowest launch seen, and 2 ms more (the sleep's cycles from its rate).
    sleep_s = 2 * max(launches) + 2e-3
    with torch.cuda.device(executor.device):
        cycles = int(sleep_s * _sleep_cycles_per_s())
    got: list[float | None] = []
    for _ in range(reps):
        out = session.next_step()
        with torch.cuda.device(executor.device):  # (the launch's stream's device)
            torch.cuda._sleep(cycles)
        t0 = time.perf_counter()
        handle = executor.execute_async(out)
        host = time.perf_counter() - t0
        res = handle.result()
        device = handle.device_seconds(wait=True)
        got.append(device if host < 0.8 * sleep_s and device is not None else None)
        session.advance(res)
    return got


@functools.cache
def _sleep_cycles_per_s() -> float:
    """`torch.cuda._sleep`'s cycles per second on this device (its clock, timed once a
    process)."""
    cycles = 10_000_000
    torch.cuda._sleep(cycles)  # (warm)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    torch.cuda._sleep(cycles)
    end.record()
    end.synchronize()
    return cycles / (start.elapsed_time(end) / 1e3)


def profile_host(
    engine: EngineCore,
    num_requests: int = 96,
    seed: int = 0,
    max_prompt: int = 1024,
    decode_batch: int = 0,
) -> list[dict[str, Any]]:
    """Host time of the core around each step (schedule, then output processing) in a
    real run: per step the request and token counts and the two times. A mixed wave of
    `num_requests` (prompts of 16..max_prompt tokens), then, with `decode_batch`, that
    many short prompts at once, so that decode steps of the engine's largest batches are
    sampled too, and the cost model's host fit need not extrapolate to them."""
    rng = random.Random(seed)
    vocab = engine.executor.config.vocab_size
    max_prompt = min(max_prompt, engine.scheduler.max_model_len // 2)
    samples = _host_wave(engine, rng, vocab, "h", num_requests, (16, max_prompt), (8, 48))
    if decode_batch:
        short = (16, min(64, max_prompt) + 1)
        samples += _host_wave(engine, rng, vocab, "d", decode_batch, short, (12, 24))
    return samples


def _host_wave(
    engine: EngineCore,
    rng: random.Random,
    vocab: int,
    tag: str,
    num_requests: int,
    prompt_range: tuple[int, int],
    new_range: tuple[int, int],
) -> list[dict[str, Any]]:
    """Submit `num_requests` at once and time the core around every step until done."""
    for i in range(num_requests):
        n = rng.randrange(*prompt_range)
        params = SamplingParams(max_tokens=rng.randrange(*new_range), ignore_eos=True)
        engine.add_request(Request(f"{tag}{i}", [rng.randrange(vocab) for _ in range(n)], params))
    samples = []
    while engine.has_unfinished():
        t0 = time.perf_counter()
        out = engine.schedule()
        t1 = time.perf_counter()
        res = engine.executor.execute(out)
        t2 = time.perf_counter()
        engine.apply_results(out, res, t2 - t1)
        t3 = time.perf_counter()
        samples.append(
            {
                "num_reqs": len(out.scheduled),
                "num_tokens": out.num_batched_tokens,
                "schedule_s": t1 - t0,
                "process_s": t3 - t2,
                "execute_s": t2 - t1,
            }
        )
    return samples
