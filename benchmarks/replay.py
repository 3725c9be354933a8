"""Replay trace requests through the real engine in wall-clock time.

Shared by `fidelity.py` and `model_speed_steps.py` (the served-trace figure). Requests are built exactly as the
simulator builds them (`sim.simulator.build_requests`: the trace's prefix blocks become
identical token ids, `ignore_eos`, `max_tokens` = the trace's output length), with
the token ids written out for the real model. Arrivals are admitted between steps once
their time has come, as the simulator admits them; the engine sleeps when idle.
"""

from __future__ import annotations

import argparse
import contextlib
import time
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from deepinfer.config import EngineConfig
from deepinfer.engine import EngineCore, StepEventKind
from deepinfer.kv_cache.manager import KVCacheManager
from deepinfer.outputs import SchedulerOutput
from deepinfer.records import RequestRecord, StepRecord
from deepinfer.request import Request
from deepinfer.step_log_file import StepLogWriter
from sim.simulator import build_requests
from sim.traces import Trace, TraceRequest, offline, poisson, retimed

__all__ = ["ReplayResult", "StepSample", "offline", "poisson", "replay", "retimed"]


@dataclass
class StepSample:
    """One real step: its shape, and where its wall time went."""

    requests: list[tuple[int, int, bool]]  # (tokens, context, is_prompt) per request
    wall_s: float  # the whole round: schedule, execute, process
    execute_s: float
    idle_before_s: float  # time since the previous step ended (the engine slept)
    step_id: int = -1
    # On CUDA (benchmarks/step_events.py): the device's span of the step's work, and the
    # device idle before it (queued after the step before had finished).
    device_s: float | None = None
    device_idle_before_s: float | None = None
    launch_s: float | None = None  # the host's seconds inside its launch

    @property
    def kind(self) -> str:
        return shape_kind(self.requests)


def shape_kind(requests: list[Any]) -> str:
    """The kind of a step of `requests`, (tokens, context, is_prompt) each: decode (every
    request one token), verify (no prompt chunk, and a decode of more tokens than one:
    it verifies that many less one drafts), prefill (only prompt chunks), else mixed."""
    if all(q == 1 for q, _, _ in requests):
        return "decode"
    if not any(p for _, _, p in requests):
        return "verify"
    if all(p for _, _, p in requests):
        return "prefill"
    return "mixed"


@dataclass
class ReplayResult:
    records: list[RequestRecord]  # in the order of the requests given
    steps: list[StepSample] = field(default_factory=list)
    wall_s: float = 0.0
    engine_steps: list[StepRecord] = field(default_factory=list)  # the engine's own log
    # Drafts accepted over drafts verified (None: the engine did not speculate).
    draft_acceptance: float | None = None
    # The engine's KV manager after the run: its prefix hits per tier and its tiers' copies.
    kv: KVCacheManager | None = None
    output_tokens: list[list[int]] = field(default_factory=list)  # per request, in order


def materialized_requests(trace: Trace, vocab_size: int) -> list[Request]:
    """The simulator's requests for `trace`, with their prompts as explicit token ids."""
    out = []
    for req in build_requests(trace, vocab_size):
        ids = (
            req.prompt
            if isinstance(req.prompt, list)
            else req.prompt.token_ids(0, req.num_prompt_tokens)
        )
        out.append(
            Request(
                req.request_id,
                list(ids),
                req.sampling_params,
                req.arrival_time,
                priority=req.priority,
            )
        )
    return out


def replay(
    executor: Any,
    cfg: EngineConfig,
    trace: Trace | list[TraceRequest],
    model_max_len: int | None = None,
    step_writer: StepLogWriter | None = None,
) -> ReplayResult:
    """Run every request of `trace` through a fresh EngineCore over `executor`;
    step_writer: the engine writes its steps to that step log (closed at the end)."""
    if not isinstance(trace, Trace):
        trace = Trace("requests", "python", list(trace))
    requests = materialized_requests(trace, executor.config.vocab_size)
    t0 = time.monotonic()
    engine = EngineCore(
        cfg, executor, clock=lambda: time.monotonic() - t0, model_max_len=model_max_len,
        step_writer=step_writer,
    )  # fmt: skip
    pending = deque(sorted(requests, key=lambda r: r.arrival_time))
    result = ReplayResult(records=[])
    device = getattr(executor, "device", None)
    timer = None
    if device is not None and device.type == "cuda":
        from benchmarks.step_events import StepEvents  # (torch: a real executor's run only)

        timer = StepEvents(executor)
    with timer or contextlib.nullcontext(), step_writer or contextlib.nullcontext():
        _run(engine, pending, result)
    if timer is not None:
        for sample in result.steps:
            got = timer.step(sample.step_id)
            if got is not None:
                sample.device_s, sample.device_idle_before_s = got
            sample.launch_s = timer.launch_seconds.get(sample.step_id)
    result.wall_s = time.monotonic() - t0
    result.engine_steps = list(engine.steps)
    result.kv = engine.scheduler.kv
    drafts = engine.scheduler.num_draft_tokens
    result.draft_acceptance = engine.scheduler.num_accepted_drafts / drafts if drafts else None
    by_id = {r.req_id: r for r in engine.records}
    result.records = [by_id[r.request_id] for r in requests]
    result.output_tokens = [list(r.output_token_ids) for r in requests]
    return result


def _run(engine: EngineCore, pending: deque[Request], result: ReplayResult) -> None:
    """`replay`'s loop: admit arrivals, step, sample each applied step."""
    last_end = time.perf_counter()
    scheduled: dict[int, SchedulerOutput] = {}  # step id -> the step, until its result
    while pending or engine.has_unfinished():
        now = engine.clock()
        while pending and pending[0].arrival_time <= now:
            engine.add_request(pending.popleft())
        if not engine.has_unfinished():
            time.sleep(max(0.0, pending[0].arrival_time - engine.clock()))
            continue
        start = time.perf_counter()
        num_steps = len(engine.steps)
        for kind, out in engine.step_events():
            if kind is StepEventKind.SCHEDULED:
                scheduled[out.step_id] = out
        end = time.perf_counter()
        if len(engine.steps) > num_steps:  # (under async scheduling: the step before the
            # one this round scheduled)
            rec = engine.steps[-1]
            for step_id in [i for i in scheduled if i < rec.step_id]:  # failed ones
                del scheduled[step_id]
            step = scheduled.pop(rec.step_id)
            shape = [(r.num_tokens, r.num_computed_tokens, r.is_prompt) for r in step.scheduled]
            result.steps.append(
                StepSample(shape, end - start, rec.duration, start - last_end, rec.step_id)
            )
        last_end = end


def add_replay_options(p: argparse.ArgumentParser) -> None:
    """The options of a benchmark that replays requests through the real engine beside
    the simulator: where its results go, the model and device, and the simulator's
    hardware and profile."""
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--model", default="moonlight-16b-a3b")
    p.add_argument("--device", default=None)
    p.add_argument("--dtype", default=None)
    p.add_argument("--hardware", default=None, help="simulator hardware (default: detected)")
    p.add_argument("--profile", type=Path, default=None, help="profile for the simulator")
