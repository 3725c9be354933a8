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
by the drafter (priced by the plain fit).
"""

from __future__ import annotations

import dataclasses
import random
import statistics
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import torch

from deepinfer import envs
from deepinfer.engine import EngineCore
from deepinfer.outputs import (
    DRAFT_PLACEHOLDER,
    ModelRunnerOutput,
    ScheduledRequest,
    SchedulerOutput,
)
from deepinfer.request import Request
from deepinfer.sampling_params import SamplingParams
from executors.profile_grid import StepShape, run_slack
from kernels.compile_stats import total_compiled

# Replayed traces (and the fidelity benchmark) sample greedily: so do the profiled steps.
GREEDY = SamplingParams(temperature=0.0)


class StepSession:
    """The requests of one shape on a model runner, stepped as the scheduler would: run
    `first` once (it sends their tables), then `next_step()` and `advance(result)` up to
    `reps` times, then finish them. Prompt chunks are sent again whole (their table
    resets the runner's state); decode and verify requests move on by the tokens each
    step gave them, verifying the drafter's latest proposal (random tokens where it made
    none)."""

    def __init__(self, shape: StepShape, runner: Any, rng: random.Random, reps: int) -> None:
        block_size, num_blocks = runner.block_size, runner.kv_cache.num_blocks
        max_blocks = -(-runner.max_model_len // block_size)
        vocab = runner.vocab_size
        self.rng, self.vocab = rng, vocab
        self.first: list[ScheduledRequest] = []
        self.drafts: dict[str, int] = {}  # req_id -> drafts verified each step
        cursor = 0
        for gi, (count, q, ctx, is_prompt, k) in enumerate(shape.groups):
            # Room for the step, the runs after it and the drafter's chained positions
            # (never wider than a graph's table: a wider one would not replay graphs).
            n = min(max_blocks, -(-(ctx + run_slack(q, k, reps)) // block_size))
            for i in range(count):
                table = [(cursor + j) % num_blocks for j in range(n)]
                cursor += n
                rid = f"p{gi}.{i}"
                tokens = [rng.randrange(vocab) for _ in range(q)]
                self.first.append(ScheduledRequest(
                    req_id=rid, num_tokens=q, num_computed_tokens=ctx,
                    is_prompt=is_prompt, samples=True, new_block_ids=[], block_table=table,
                    token_ids=tokens, draft_token_ids=tokens[q - k :] if k else [],
                    sampling_params=GREEDY,
                    num_prompt_tokens=ctx + q if is_prompt else ctx,
                ))  # fmt: skip
                self.drafts[rid] = k
        self.computed = {sr.req_id: sr.num_computed_tokens for sr in self.first}
        self.live: dict[str, str] = {}  # prompt request -> its copy in the runner (pipelined)
        self.copies = 0
        self.last = {sr.req_id: sr.token_ids[-1] for sr in self.first if sr.token_ids}
        self.proposed: dict[str, list[int]] = {}

    def advance(self, res: ModelRunnerOutput) -> None:
        for rid, toks in res.sampled_token_ids.items():
            if toks and rid in self.computed:  # (a caller's own requests aside)
                self.computed[rid] += len(toks)
                self.last[rid] = toks[-1]
        self.proposed = res.draft_token_ids

    def settle(self, res: ModelRunnerOutput) -> None:
        """A pipelined step read: its requests are as far on as the tokens it gave, not
        as every draft accepted, which the steps built after it assumed (the scheduler's
        correction when it applies a step)."""
        for rid, toks in res.sampled_token_ids.items():
            if rid in self.computed:
                self.computed[rid] -= 1 + self.drafts[rid] - len(toks)

    def finish(self) -> SchedulerOutput:
        """The step that drops the shape's requests from the runner."""
        done = {sr.req_id for sr in self.first} | set(self.live.values())
        return SchedulerOutput(step_id=-1, scheduled=[], finished_req_ids=done)

    def next_step(self, pipelined: bool = False) -> SchedulerOutput:
        """The shape's next step. pipelined (async scheduling): it is built before the
        step before it is read, as the scheduler builds it: each decode or verify request
        one token further plus its drafts (every draft assumed accepted), its newest token
        and drafts left to the runner (taken from the step in flight on the device, the
        rows moved back by the drafts it rejected); prompt chunks come as new requests (a
        chunk sent again whole would make the runner read the step in flight first)."""
        scheduled = []
        finished: set[str] = set()
        for sr in self.first:
            if sr.is_prompt:
                if pipelined:
                    self.copies += 1
                    rid = f"{sr.req_id}#{self.copies}"
                    finished.add(self.live.pop(sr.req_id, sr.req_id))
                    self.live[sr.req_id] = rid
                    sr = dataclasses.replace(sr, req_id=rid)
                scheduled.append(sr)
                continue
            k = self.drafts[sr.req_id]
            if pipelined:
                start = self.computed[sr.req_id]
                self.computed[sr.req_id] += 1 + k
                scheduled.append(ScheduledRequest(
                    req_id=sr.req_id, num_tokens=1 + k, num_computed_tokens=start,
                    is_prompt=False, samples=True, new_block_ids=[], token_ids=[],
                    draft_token_ids=[DRAFT_PLACEHOLDER] * k,
                    num_prompt_tokens=sr.num_prompt_tokens,
                ))  # fmt: skip
                continue
            drafts = list(self.proposed.get(sr.req_id, ()))[:k]
            drafts += [self.rng.randrange(self.vocab) for _ in range(k - len(drafts))]
            scheduled.append(ScheduledRequest(
                req_id=sr.req_id, num_tokens=1 + k, num_computed_tokens=self.computed[sr.req_id],
                is_prompt=False, samples=True, new_block_ids=[],
                token_ids=[self.last[sr.req_id]] + drafts, draft_token_ids=drafts,
                num_prompt_tokens=sr.num_prompt_tokens,
            ))  # fmt: skip
        return SchedulerOutput(step_id=-1, scheduled=scheduled, finished_req_ids=finished)


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
        """The drafter of a step on the device (ModelRunner._verify_on_device)."""
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
def drafter_detached(runner: Any) -> Iterator[None]:
    """Steps without the MTP drafter: what a non-speculating engine runs."""
    drafter = runner.drafter
    runner.drafter = None
    try:
        yield
    finally:
        runner.drafter = drafter


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
    inner = runner.drafter
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
            runner.drafter = timed
            try:
                _run_shape(executor, shape, reps, rng, timed, got)
            finally:
                runner.drafter = inner
            if r == rounds - 1 and on_point is not None:
                on_point(got.point(shape, timed))
    return [got.point(shape, inner if shape.drafter else None) for shape, got in zip(shapes, runs)]


def fill_context_kv(kv_cache: Any, seed: int) -> None:
    """Random latents in every block (MTP layers too), as if real text had been cached.

    A point's context is never prefilled: its requests attend to whatever the blocks
    hold. Zeros (a fresh cache) give every request the same attention output, so the
    requests of a decode point route to the same few experts, and on a MoE model a
    step that reads 6 experts' weights instead of all of them measured up to 1.7x
    faster than served steps of its shape (Moonlight, batch 32, context 256: 5.96 ms
    profiled against 10.3 ms served)."""
    gen = torch.Generator(device=kv_cache.layers[0].device).manual_seed(seed)
    for layer in [*kv_cache.layers, *kv_cache.mtp_layers]:
        layer.normal_(generator=gen)


@dataclass
class _Runs:
    """The timed runs of one shape, over the rounds."""

    times: list[float] = field(default_factory=list)
    drafting: list[float] = field(default_factory=list)
    pipelined: list[float] = field(default_factory=list)  # per round (no prompt beside drafts)
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
        got.pipelined.append(_pipelined(executor, session, reps))
    elif timed is not None and not any(g[3] for g in shape.groups):
        runner = executor.runner  # (the timer's synchronisations would end the overlap)
        runner.drafter = timed.inner
        try:
            got.pipelined.append(_pipelined(executor, session, reps))
        finally:
            runner.drafter = timed
    executor.execute(session.finish())
    got.compiled += total_compiled() - compiled


def _pipelined(executor: Any, session: StepSession, reps: int) -> float:
    """Seconds per step with each step launched before the one before it is read (async
    scheduling, ModelRunner.launch): the runner's host work overlaps the device's, so
    this is the longer of the two. The median of `reps` gaps between consecutive results
    once the pipeline is full, each with the next step launched in it: one stall (a
    collection, another tenant's burst) moves it little, where a mean over the run
    carried it into the point (H200 points read up to 3x their sequential medians). On
    a CPU each launch does its step's work, so a gap is one step there."""
    in_flight = executor.execute_async(session.next_step(pipelined=True))
    stamps: list[float] = []
    for _ in range(reps + 1):
        launched = executor.execute_async(session.next_step(pipelined=True))
        session.settle(in_flight.result())
        stamps.append(time.perf_counter())  # a result read with the next step queued
        in_flight = launched
    session.settle(in_flight.result())
    return statistics.median(b - a for a, b in zip(stamps, stamps[1:]))


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
    sampled too (the cost model's host fit extrapolated from ~96 requests before)."""
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
        engine.process(out, res, t2 - t1)
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


def hardware_name(device: Any) -> str:
    """The simulator's hardware preset for this device ("h200", "h100", ...) or "cpu"."""
    if device.type != "cuda":
        return "cpu"
    import torch

    name = torch.cuda.get_device_name(device).lower()
    for key in ("h200", "h100", "h800", "b200", "a100"):
        if key in name:
            return key
    return name.replace("nvidia", "").strip().replace(" ", "-")


def environment(executor: Any) -> dict[str, Any]:
    """Device, software versions and commit: where a profile's numbers come from."""
    import platform
    import subprocess
    from pathlib import Path

    import torch

    try:
        import triton

        triton_version = triton.__version__
    except ImportError:
        triton_version = None
    root = Path(__file__).resolve().parents[1]

    def git(*cmd: str) -> str | None:
        try:
            run = subprocess.run(
                ["git", *cmd], cwd=root, capture_output=True, text=True, timeout=10
            )
        except (OSError, subprocess.SubprocessError):  # no git, or it hung
            return None
        return run.stdout.strip() if run.returncode == 0 else None

    commit = git("rev-parse", "HEAD") or None
    # Files that differ from that commit: the numbers are not the commit's alone (a copied
    # working tree, as on the device machine, keeps an older .git beside newer files).
    status = git("status", "--porcelain", "--untracked-files=no") if commit else None
    dev = executor.device
    backend = envs.kernel_backend()  # the kernels its steps ran (kernels.ops.use_triton)
    if backend == "auto":
        backend = "triton" if dev.type == "cuda" else "torch"
    return {
        "device": torch.cuda.get_device_name(dev)
        if dev.type == "cuda"
        else platform.processor() or platform.machine(),
        "hardware": hardware_name(dev),
        "torch": torch.__version__,
        "triton": triton_version,
        "python": platform.python_version(),
        "commit": commit,
        "commit_dirty": None if status is None else bool(status),
        "cpu_threads": torch.get_num_threads(),
        "kernel_backend": backend,
        "date": time.strftime("%Y-%m-%d %H:%M:%S", time.gmtime()),
    }
