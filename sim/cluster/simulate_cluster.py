"""simulate_cluster(): a trace through a cluster of simulated instances.

Every instance is the real EngineCore over a SimExecutor, driven by the same engine
loop as `simulate()` (sim/engine_loop.py), each with its pool's model, GPU, engine
configuration and cost model, all in one simpy environment (sim/cluster/cluster.py).
"""

from __future__ import annotations

from collections.abc import Callable, Generator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import simpy

from deepinfer.engine import EngineCore
from deepinfer.kv_cache.tiers import TierLRU
from deepinfer.metrics import SLO, summarize
from deepinfer.model_config import ModelConfig, load_model_config
from deepinfer.records import RequestRecord, StepRecord
from deepinfer.routing import make_router
from deepinfer.step_log import MergedSteps
from sim.acceptance import AcceptanceModel
from sim.cluster.cluster import Cluster, Handover
from sim.cluster.cluster_report import cluster_meta, merge_records
from sim.cluster.description import ClusterSpec, PoolSpec
from sim.cluster.instance import Instance, Served, instance_view
from sim.cluster.pool_routing import PoolRouting
from sim.cost_model import CostModel, prices_decode_runs
from sim.cost_model_registry import engine_cost_model
from sim.data_parallel import DataParallelStats, RankGroup, rank_group, serve_data_parallel
from sim.engine_loop import Clock, FastForwardStats, serve_engine
from sim.expert_parallel_cost import ExpertParallelCost
from sim.hardware import get_hardware
from sim.kv_capacity import engine_kv_blocks, kv_bytes_per_token
from sim.kv_tiers import kv_tiers_meta
from sim.sim_executor import SimExecutor
from sim.simulator import build_requests
from sim.traces import Trace, TraceRequest


@dataclass
class ClusterResult:
    requests: list[RequestRecord]  # one per trace request, in trace order, end to end
    steps: dict[str, Sequence[StepRecord]]  # instance name -> its engine's step records
    summary: dict[str, Any]
    meta: dict[str, Any] = field(default_factory=dict)
    handovers: dict[str, Handover] = field(default_factory=dict)  # PD: req id -> its handover
    decode_records: list[RequestRecord] = field(default_factory=list)  # PD: the decode side
    instances: dict[str, Instance] = field(default_factory=dict)  # name -> its engine and state


@dataclass
class _Pool:
    spec: PoolSpec
    model: ModelConfig
    cost: CostModel
    cost_meta: dict[str, Any]
    num_blocks: int
    block_bytes: int  # KV bytes of one block (what a tier holds and a load moves)


def simulate_cluster(
    trace: Trace | list[TraceRequest],
    cluster: ClusterSpec,
    cost_model: str | None = None,
    *,
    profile: str | Path | None = None,
    slo: SLO | None = None,
    acceptance_rate: float | AcceptanceModel = 0.7,
    check_invariants: bool = False,
    on_progress: Callable[[int], None] | None = None,
    fast_forward: bool = True,
) -> ClusterResult:
    """Run `trace` through `cluster` to completion (SchedulerStalled if an instance
    stalls). cost_model / profile: as `simulate()`'s, for every pool."""
    if not isinstance(trace, Trace):
        trace = Trace("requests", "python", list(trace))
    pools = [_resolve(p, cluster, cost_model, profile) for p in cluster.pools]
    if any(r.structured for r in trace.requests):
        raise ValueError(
            "structured requests in a cluster: grammar masks are priced by simulate() on "
            "one engine only; drop so_args / structured from the trace"
        )
    env = simpy.Environment()
    entry_model = next(p.model for p in pools if p.spec.role != "decode")
    requests = build_requests(trace, entry_model.vocab_size)
    hub = Cluster(
        env,
        cluster,
        requests,
        entry_model.kv_bytes_per_token,
        entry_model.num_hidden_layers,
        on_progress,
    )
    store = _shared_store(cluster, pools)
    bytes_of: dict[str, int] = {}  # instance -> its KV block's bytes
    groups: dict[bool, list[tuple[_Pool, Served, Clock, str]]] = {False: [], True: []}
    rounds: dict[str, ExpertParallelCost] = {}  # instance of data-parallel ranks -> its rounds
    for pool in pools:
        tiers = cluster.pool_tiers(pool.spec)
        for i in range(pool.spec.count):
            name = f"{pool.spec.name}[{i}]"
            bytes_of[name] = pool.block_bytes
            clock = Clock()
            core: Served
            if pool.spec.engine.data_parallel_size > 1:
                core, rounds[name] = _rank_group(
                    env, pool, cluster, acceptance_rate, check_invariants
                )
            else:
                executor = SimExecutor(
                    pool.spec.engine, pool.num_blocks, acceptance_rate=acceptance_rate
                )
                core = EngineCore(
                    pool.spec.engine,
                    executor,
                    clock=clock,
                    model_max_len=pool.model.max_position_embeddings,
                    check_invariants=check_invariants,
                    kv_tiers=tiers.build(pool.block_bytes, store),
                )
            groups[pool.spec.role == "decode"].append((pool, core, clock, name))
    runs: dict[str, FastForwardStats] = {}
    dp_stats: dict[str, DataParallelStats] = {}
    for is_decode, members in groups.items():
        if not members:
            continue
        rspec = (cluster.decode_router or cluster.router) if is_decode else cluster.router
        router = make_router(rspec.policy, len(members), seed=cluster.seed, **rspec.options)
        routing = PoolRouting(router, [instance_view(i, m[1]) for i, m in enumerate(members)])
        target = hub.decode if is_decode else hub.entry
        if is_decode:
            hub.decode_routing = routing
        else:
            hub.entry_routing = routing
        for i, (pool, core, clock, name) in enumerate(members):
            inst = Instance(hub, name, pool.spec.role, i, core, clock, routing)
            target.append(inst)
            stats = FastForwardStats() if fast_forward else None
            if stats is not None and not prices_decode_runs(pool.cost):
                stats.reason = (
                    f"the cost model ({type(pool.cost).__name__}) prices single steps only"
                )
            if stats is not None:
                runs[name] = stats
            hw = get_hardware(pool.spec.hardware)
            if isinstance(core, RankGroup):
                dp = dp_stats[name] = DataParallelStats()
                loop = serve_data_parallel(env, core, inst, clock, pool.cost, rounds[name], dp)
            else:
                loads = cluster.pool_tiers(pool.spec).load_pricing(pool.block_bytes)
                loop = serve_engine(
                    env, clock, core, inst, pool.cost, 0.0, None, hw.runs_on_host, stats, loads
                )
            env.process(_then_ended(hub, inst, loop))
    hub.entry_running = len(hub.entry)
    env.run()
    _check_drained(hub)
    records = merge_records(requests, hub)
    steps = {inst.name: inst.core.steps for inst in hub.entry + hub.decode}
    all_steps = MergedSteps(steps.values())
    summary = summarize(records, all_steps, slo)
    tiers_meta = cluster.kv_tiers.to_meta(pools[0].block_bytes)
    for p in pools:  # each pool's host tier (its engine's size)
        host = cluster.pool_tiers(p.spec).to_meta(p.block_bytes).get("host")
        if host is not None:
            tiers_meta.setdefault("host_per_pool", {})[p.spec.name] = host
    tiers_meta.pop("host", None)
    engines = [
        (core.scheduler.kv, bytes_of[inst.name])
        for inst in hub.entry + hub.decode
        for core in (inst.core.cores if isinstance(inst.core, RankGroup) else [inst.core])
    ]
    meta = cluster_meta(
        trace, cluster, hub, summary, slo, [(p.spec, p.cost_meta, p.num_blocks) for p in pools],
        kv_tiers_meta(tiers_meta, engines), records,
    )  # fmt: skip
    if dp_stats:
        meta["data_parallel"] = {name: st.to_meta() for name, st in dp_stats.items()}
    meta["fast_forward"] = (
        {
            "enabled": True,
            "runs": sum(s.runs for s in runs.values()),
            "steps": sum(s.steps for s in runs.values()),
        }
        if fast_forward
        else {"enabled": False}
    )
    decode_records = [r for inst in hub.decode for r in inst.core.records]
    instances = {inst.name: inst for inst in hub.entry + hub.decode}
    return ClusterResult(records, steps, summary, meta, hub.handovers, decode_records, instances)


def _then_ended(hub: Cluster, inst: Instance, loop: Generator[Any, Any, None]) -> Any:
    """An instance's engine loop; an entry instance's end may end the decode side's wait."""
    yield from loop
    if inst.role != "decode":
        hub.entry_loop_ended(inst)


def _rank_group(
    env: simpy.Environment,
    pool: _Pool,
    cluster: ClusterSpec,
    acceptance: float | AcceptanceModel,
    check_invariants: bool,
) -> tuple[RankGroup, ExpertParallelCost]:
    hw = get_hardware(pool.spec.hardware)
    try:
        return rank_group(
            env, pool.model, hw, pool.spec.engine, pool.cost, pool.cost_meta, pool.num_blocks,
            acceptance, check_invariants,
        )  # fmt: skip
    except ValueError as e:
        raise ValueError(f"{cluster.source}: pool {pool.spec.name}: {e}") from None


def _resolve(
    pool: PoolSpec, cluster: ClusterSpec, cost_model: str | None, profile: str | Path | None
) -> _Pool:
    model = load_model_config(pool.model or cluster.model)
    hw = get_hardware(pool.hardware)
    try:
        cost, cost_meta = engine_cost_model(cost_model, model, hw, profile, pool.engine)
        num_blocks = engine_kv_blocks(model, hw, pool.engine, check_fit=cost_model != "unit")
        model.check_max_model_len(pool.engine.max_model_len)
    except ValueError as e:
        raise ValueError(f"{cluster.source}: pool {pool.name}: {e}") from None
    speculative = pool.engine.num_speculative_tokens > 0
    block_bytes = pool.engine.block_size * kv_bytes_per_token(model, speculative)
    return _Pool(pool, model, cost, cost_meta, num_blocks, block_bytes)


def _shared_store(cluster: ClusterSpec, pools: list[_Pool]) -> TierLRU | None:
    """The one store every instance shares (None: none configured). Its blocks are the
    instances' blocks, so they must all be of one size."""
    sizes = {p.block_bytes for p in pools}
    if cluster.kv_tiers.store is not None and len(sizes) > 1:
        raise ValueError(
            f"{cluster.source}: kv_tiers.store: the pools' KV blocks differ in size "
            f"({sorted(sizes)} bytes: model, block_size or MTP layer), so one store cannot "
            "hold blocks of all of them"
        )
    return cluster.kv_tiers.shared_store(pools[0].block_bytes)


def _check_drained(hub: Cluster) -> None:
    """Every instance's loop ended with nothing left: a request still held anywhere
    would be a hang the records could hide (its prefill record merged as its end)."""
    left = [
        f"{inst.name}: {len(inst.inbox)} undelivered, {len(inst.kv_inbox)} KV transfers, "
        f"unfinished={inst.core.has_unfinished()}"
        for inst in hub.entry + hub.decode
        if inst.inbox or inst.kv_inbox or inst.core.has_unfinished()
    ]
    if hub.pending or hub.arrivals:
        left.append(f"router: {len(hub.pending)} handovers, {len(hub.arrivals)} arrivals")
    if left:
        raise RuntimeError("the cluster simulation ended with work left: " + "; ".join(left))
