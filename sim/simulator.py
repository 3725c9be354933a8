"""simulate(): replay a trace through the real EngineCore in simulated time.

The simpy process is deliberately thin: it admits arrivals and drives the
engine's own loop (`EngineCore.step_events`), advancing the clock by the cost
model's price of each step. Every batching decision is the shared scheduler's,
and the stall rule and async overlap are the engine loop's.
"""

from __future__ import annotations

import gc
import warnings
from collections import deque
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import simpy

from deepinfer import envs
from deepinfer.config import EngineConfig
from deepinfer.engine import EngineCore
from deepinfer.metrics import SLO, summarize
from deepinfer.model_config import ModelConfig, load_model_config
from deepinfer.records import RequestRecord, StepRecord
from deepinfer.request import Request
from deepinfer.sampling_params import SamplingParams
from sim.acceptance import AcceptanceModel
from sim.cost_model import CostModel, prices_decode_runs
from sim.cost_model_registry import engine_cost_model
from sim.engine_loop import Clock, FastForwardStats, PendingArrivals, serve_engine
from sim.hardware import HardwareSpec, get_hardware
from sim.kv_capacity import engine_kv_blocks, kv_bytes_per_token
from sim.kv_tiers import KVTierSpec, kv_tiers_meta
from sim.sim_executor import SimExecutor
from sim.traces import SyntheticPrompt, Trace, TraceRequest


@dataclass
class SimResult:
    requests: list[RequestRecord]  # one per trace request, in trace order
    steps: Sequence[StepRecord]
    summary: dict[str, Any]
    meta: dict[str, Any] = field(default_factory=dict)


def build_requests(trace: Trace, vocab_size: int) -> list[Request]:
    """Engine requests for a trace: synthetic prompts that share content where
    the trace's prefix blocks say so; each stops after its trace output_len. A
    `structured` request carries no schema (no tokens here): its grammar masks are
    priced by the cost model's host time. Requests of one output length share their
    SamplingParams, validated once (nothing changes a request's params).

    The garbage collector pauses meanwhile: every object made here stays alive, so the
    passes that their growing number triggers (each over all of them) would free nothing."""
    out = []
    params_of: dict[int, SamplingParams] = {}  # output_len -> its requests' params
    collecting = gc.isenabled()
    gc.disable()
    try:
        for i, tr in enumerate(trace.requests):
            params = params_of.get(tr.output_len)
            if params is None:
                params = params_of[tr.output_len] = SamplingParams(
                    temperature=0.0, max_tokens=tr.output_len, ignore_eos=True
                )
            prompt = SyntheticPrompt.for_request(tr, salt=i, vocab_size=vocab_size)
            out.append(
                Request(
                    tr.id, prompt, params, tr.arrival, priority=tr.priority,
                    structured=tr.structured,
                )
            )  # fmt: skip
    finally:
        if collecting:
            gc.enable()
    return out


def simulate(
    trace: Trace | list[TraceRequest],
    model: str | ModelConfig = "moonlight-16b-a3b",
    hardware: str | HardwareSpec = "h200",
    engine: EngineConfig | None = None,
    cost_model: str | CostModel | None = None,
    *,
    profile: str | Path | None = None,
    slo: SLO | None = None,
    acceptance_rate: float | str | Path | AcceptanceModel = 0.7,
    check_invariants: bool = False,
    on_progress: Callable[[int], None] | None = None,
    grammar_mask_per_token_s: float | None = None,
    fast_forward: bool = True,
    step_log: str | Path | None = None,
) -> SimResult:
    """Run `trace` to completion; raises deepinfer.SchedulerStalled if the engine stalls.

    cost_model None: the profiled model where a profile of (model, hardware) is shipped
    (or `profile` is given), else the analytic one, reported as uncalibrated.
    acceptance_rate: draft acceptance when speculating: one probability for every
    position, an AcceptanceModel, or an acceptance file (path or name under
    sim/data/acceptance/, written by `deepinfer measure-acceptance`).
    grammar_mask_per_token_s: host seconds per token mask of a `structured` request
    (None: the cost model's `grammar_mask_per_token_s`).
    fast_forward: advance decode runs the scheduler proves (docs/design.md,
    "Fast-forward") several steps at a time; the results are the same to the bit as
    with False, which runs every step (for comparison, or to time single steps).
    step_log: write every step to this step log file (deepinfer/step_log_file.py: its
    shape, the cost model's host price as its host time, its duration), in the format a
    real run writes, to compare with one or to fit a profile from; every step then runs
    on its own (no fast-forward).
    """
    if not isinstance(trace, Trace):
        trace = Trace("requests", "python", list(trace))
    engine = engine or EngineConfig()
    spec = model if isinstance(model, ModelConfig) else load_model_config(model)
    spec = spec.with_quantization(engine.quantization)
    hw = hardware if isinstance(hardware, HardwareSpec) else get_hardware(hardware)
    if engine.policy != "priority":  # (a trace may be replayed under both policies)
        ranked = sum(r.priority != 0 for r in trace.requests)
        if ranked:
            warnings.warn(
                f"trace {trace.name}: {ranked} request(s) carry a priority, which the "
                f"engine's policy {engine.policy!r} does not read; --policy priority "
                "schedules by them",
                stacklevel=2,
            )
    cost, cost_meta = engine_cost_model(cost_model, spec, hw, profile, engine)
    _check_profile(cost.meta, cost_meta.get("profile") or cost.profile_name, engine, hw)
    if grammar_mask_per_token_s is None:
        grammar_mask_per_token_s = cost.grammar_mask_per_token_s
    if not grammar_mask_per_token_s >= 0:
        raise ValueError(f"grammar_mask_per_token_s={grammar_mask_per_token_s}: must be >= 0")
    num_blocks = engine_kv_blocks(spec, hw, engine, check_fit=cost_model != "unit")
    spec.check_max_model_len(engine.max_model_len)
    acceptance = acceptance_rate
    if isinstance(acceptance, (str, Path)):
        acceptance = AcceptanceModel.load(acceptance)
    block_bytes = engine.block_size * kv_bytes_per_token(spec, engine.num_speculative_tokens > 0)
    tiers = KVTierSpec.of_engine(engine)
    if engine.data_parallel_size > 1:
        if tiers.configured:
            raise ValueError(
                f"kv_host_cache_gib={engine.kv_host_cache_gib} with data_parallel_size="
                f"{engine.data_parallel_size}: the ranks' lock-step rounds do not price loads "
                "from a host tier yet; simulate one rank, or a cluster of instances"
            )
        if step_log is not None:
            raise ValueError(
                f"step_log with data_parallel_size={engine.data_parallel_size}: a step log "
                "holds one engine's steps, and the ranks' lock-step rounds are not those"
            )
        ranks = _simulate_ranks(
            trace, spec, hw, engine, cost, cost_meta, num_blocks, acceptance,
            check_invariants, on_progress, slo, mask_s=float(grammar_mask_per_token_s),
        )  # fmt: skip
        single = FastForwardStats("data-parallel ranks run in lock-step rounds")
        ranks.meta["fast_forward"] = single.to_meta() if fast_forward else {"enabled": False}
        return ranks
    executor = SimExecutor(engine, num_blocks, acceptance_rate=acceptance)
    env = simpy.Environment()
    clock = Clock()
    writer = None
    if step_log is not None:
        from deepinfer.step_log_file import StepLogWriter, step_log_header

        if hw.runs_on_host and engine.async_scheduling:
            raise ValueError(
                f"step_log on {hw.name} under async scheduling: the simulated launch runs "
                "its step beside the one before it, so a step's recorded duration is not "
                "its own (the real engine's is); simulate with async_scheduling=False"
            )
        name = model if isinstance(model, str) else spec.name
        if Path(name).exists():  # a checkpoint directory or config: readable from anywhere
            name = str(Path(name).resolve())
        meta = dict(cost.meta) | {"hardware": hw.name, "cost_model": cost_meta}
        header = step_log_header(name, hw.name, engine, "sim", meta)
        writer = StepLogWriter(step_log, header, host_price=cost.cpu_time)
    try:
        core = EngineCore(
            engine,
            executor,
            clock=clock,
            model_max_len=spec.max_position_embeddings,
            check_invariants=check_invariants,
            kv_tiers=tiers.build(block_bytes),
            step_writer=writer,
        )
    except BaseException:  # (a refused option: the log holds its header only)
        if writer is not None:
            writer.close()
        raise
    requests = build_requests(trace, spec.vocab_size)
    mask_s = float(grammar_mask_per_token_s)
    runs = FastForwardStats() if fast_forward else None
    if runs is not None and not prices_decode_runs(cost):
        runs.reason = f"the cost model ({type(cost).__name__}) prices single steps only"
    if runs is not None and writer is not None:
        runs.reason = "a step log records every step"
    arrivals = PendingArrivals(core, deque(requests))
    env.process(
        serve_engine(
            env,
            clock,
            core,
            arrivals,
            cost,
            mask_s,
            on_progress,
            hw.runs_on_host,
            runs,
            tiers.load_pricing(block_bytes),
        )  # fmt: skip
    )
    try:
        env.run()
    finally:
        if writer is not None:
            writer.close()
    records = _in_trace_order(requests, [core])
    meta = _meta(trace, spec, hw, engine, cost_meta, num_blocks, [core], mask_s)
    meta["kv_tiers"] = kv_tiers_meta(tiers.to_meta(block_bytes), [(core.scheduler.kv, block_bytes)])
    meta["num_steps"] = len(core.steps)  # (under async scheduling some schedules are empty)
    meta["fast_forward"] = runs.to_meta() if runs is not None else {"enabled": False}
    if engine.num_speculative_tokens:
        drafts = executor.num_draft_tokens
        meta["draft_acceptance_rate"] = executor.num_accepted_tokens / drafts if drafts else None
        meta["acceptance_model"] = executor.acceptance.source
        meta["acceptance_per_position"] = list(executor.acceptance.per_position)
    return SimResult(records, core.steps, summarize(records, core.steps, slo), meta)


def _check_profile(
    meta: Mapping[str, Any], profile: object, engine: EngineConfig, hw: HardwareSpec
) -> None:
    """Warn where a profile's steps (its `meta`; empty for a model without one) were
    measured unlike the engine it prices: another block size (the attention kernels'
    speed by block size is not modelled), or other kernels (DEEPINFER_KERNEL_BACKEND:
    the torch twins are several times slower on a GPU)."""
    blocks = meta.get("engine", {}).get("block_size")
    if blocks is not None and blocks != engine.block_size:
        warnings.warn(
            f"block_size={engine.block_size}: profile {profile} was measured with blocks "
            f"of {blocks} tokens, and its step times price this engine's (the attention "
            "kernels' speed by block size is not modelled)",
            stacklevel=3,
        )
    kernels = meta.get("kernel_backend")  # (older profiles do not say)
    serving = envs.kernel_backend()
    if serving == "auto":
        serving = "torch" if hw.runs_on_host else "triton"
    if kernels is not None and kernels != serving:
        warnings.warn(
            f"profile {profile} was measured with the {kernels} kernels, and the engine "
            f"it predicts runs the {serving} ones (DEEPINFER_KERNEL_BACKEND="
            f"{envs.kernel_backend()}): its step times price other kernels",
            stacklevel=3,
        )


def _simulate_ranks(
    trace: Trace, spec: ModelConfig, hw: HardwareSpec, engine: EngineConfig, cost: CostModel,
    cost_meta: dict[str, Any], num_blocks: int, acceptance: float | AcceptanceModel,
    check_invariants: bool, on_progress: Callable[[int], None] | None, slo: SLO | None, *,
    mask_s: float,
) -> SimResult:  # fmt: skip
    """data_parallel_size ranks in lock-step (sim/data_parallel.py); num_blocks per rank."""
    # Imported here: a single engine, the usual run, needs neither the ranks nor their router.
    from sim.data_parallel import DataParallelStats, rank_group, serve_data_parallel

    n = engine.data_parallel_size
    if any(r.structured for r in trace.requests):  # as LLM refuses so_args over ranks
        raise ValueError(
            f"structured requests with data_parallel_size={n}: the engine does not serve "
            "structured outputs over several ranks yet (LLM refuses so_args there)"
        )
    env = simpy.Environment()
    group, rounds = rank_group(
        env, spec, hw, engine, cost, cost_meta, num_blocks, acceptance, check_invariants
    )
    requests = build_requests(trace, spec.vocab_size)
    stats = DataParallelStats()
    arrivals = PendingArrivals(group, deque(requests))
    env.process(
        serve_data_parallel(env, group, arrivals, Clock(), cost, rounds, stats, on_progress)
    )
    env.run()
    cores, steps = group.cores, group.steps
    records = _in_trace_order(requests, cores)
    meta = _meta(trace, spec, hw, engine, cost_meta, num_blocks, cores, mask_s)
    meta["num_steps"] = stats.num_rounds
    meta.update(stats.to_meta())
    # The link figure is the datasheet's until benchmarks/investigations/all_to_all.py measures it.
    meta["all_to_all_calibrated"] = False
    return SimResult(records, steps, summarize(records, steps, slo), meta)


def _in_trace_order(requests: list[Request], cores: list[EngineCore]) -> list[RequestRecord]:
    by_id = {r.req_id: r for c in cores for r in c.records}
    return [by_id[r.request_id] for r in requests]


def _meta(
    trace: Trace, spec: ModelConfig, hw: HardwareSpec, engine: EngineConfig,
    cost_meta: dict[str, Any], num_blocks: int, cores: list[EngineCore], mask_s: float,
) -> dict[str, Any]:  # fmt: skip
    """What every report says of the run (num_steps is the caller's)."""
    return {
        "trace": trace.name,
        "num_requests": len(trace),
        "model": spec.name,
        "hardware": hw.name,
        "num_gpu_blocks": num_blocks,
        "max_model_len": cores[0].scheduler.max_model_len,
        "engine": engine.to_dict() | {"async_scheduling": engine.async_scheduling},  # as run
        **cost_meta,
        "num_evictions": sum(c.scheduler.kv.pool.num_evictions for c in cores),
        "grammar_mask_per_token_s": mask_s,
    }
