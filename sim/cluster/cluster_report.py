"""A cluster run's records end to end, and what its report says beyond one engine's:
per instance, per stage of a disaggregated request, and the plan's cost."""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import numpy as np

from deepinfer.metrics import SLO, good_tokens
from deepinfer.records import RequestRecord
from deepinfer.request import Request
from deepinfer.step_log import column
from sim.cluster.description import ClusterSpec, PoolSpec
from sim.data_parallel import RankGroup
from sim.traces import Trace

if TYPE_CHECKING:
    from sim.cluster.cluster import Cluster
    from sim.cluster.instance import Instance


def merge_records(requests: list[Request], hub: Cluster) -> list[RequestRecord]:
    """One record per request, in trace order, from arrival to its end wherever it ended.
    A handed-over request: queued and prefilled on its prefill instance (its first
    schedule and prefix hits are there), its tokens from the decode instance (which
    computes the first token again from the arrived KV, as vLLM's disaggregation does)."""
    entry = {r.req_id: r for inst in hub.entry for r in inst.core.records}
    decode = {r.req_id: r for inst in hub.decode for r in inst.core.records}
    out = []
    for req in requests:
        first = entry[req.request_id]
        ho = hub.handovers.get(req.request_id)
        second = decode.get(req.request_id) if ho is not None and not ho.cancelled else None
        if second is None:
            out.append(first)
            continue
        out.append(
            dataclasses.replace(
                second,
                arrival=first.arrival,
                first_scheduled=first.first_scheduled,
                num_cached_tokens=first.num_cached_tokens,
                num_preemptions=first.num_preemptions + second.num_preemptions,
                reason=f"on the decode instance: {second.reason}" if second.reason else None,
            )
        )
    return out


def _stats(values: Sequence[float]) -> dict[str, float | None]:
    if not values:
        return {"mean": None, "p50": None, "p99": None}
    return {
        "mean": sum(values) / len(values),
        "p50": float(np.percentile(values, 50)),
        "p99": float(np.percentile(values, 99)),
    }


def cluster_meta(
    trace: Trace,
    spec: ClusterSpec,
    hub: Cluster,
    summary: dict[str, Any],
    slo: SLO | None,
    pools: Sequence[tuple[PoolSpec, dict[str, Any], int]],
    kv_tiers: dict[str, Any] | None = None,
    records: list[RequestRecord] | None = None,
) -> dict[str, Any]:
    """kv_tiers: the KV tiers' figures over every instance (sim/kv_tiers.py); records:
    the requests end to end (the cost counts the tokens of those meeting the SLO)."""
    instances = []
    for inst in hub.entry + hub.decode:
        steps = inst.core.steps
        usage = column(steps, "kv_usage")
        instances.append(
            {
                "name": inst.name,
                "role": inst.role,
                "requests": len(inst.core.records),
                "steps": len(steps),
                "kv_usage_mean": sum(usage) / len(usage) if usage else None,
                "kv_usage_max": max(usage) if usage else None,
                **_prefix_counts(inst),
            }
        )
    meta: dict[str, Any] = {
        "trace": trace.name,
        "num_requests": len(trace),
        "cluster": spec.source,
        "model": spec.model,
        "router": {"policy": spec.router.policy, **spec.router.options},
        "pools": [
            {
                "name": p.name,
                "role": p.role,
                "count": p.count,
                "hardware": p.hardware,
                "gpus": p.num_gpus,
                "num_gpu_blocks": blocks,
                "engine": p.engine.to_dict(),
                **{k: v for k, v in cost_meta.items() if k in ("cost_model", "profile")},
            }
            for p, cost_meta, blocks in pools
        ],
        "instances": instances,
        "num_steps": sum(i["steps"] for i in instances),
        "cost": plan_cost(spec, summary, slo, records),
    }
    if kv_tiers is not None:
        meta["kv_tiers"] = kv_tiers
    if spec.disaggregated:
        meta["decode_router"] = {
            "policy": (spec.decode_router or spec.router).policy,
            **(spec.decode_router or spec.router).options,
        }
        meta["disaggregation"] = _stages(hub)
    return meta


def _stages(hub: Cluster) -> dict[str, Any]:
    """Queueing at each stage, and the KV's transfer, over the handed-over requests:
    prefill queue (arrival to its first prefill step), decode reservation (the decode
    router's turn, at that step, to its blocks reserved), the transfer left once the KV
    could go (the later of the prefill's end and the reservation, to its arrival), and
    the decode queue (arrival of the KV to its first decode step)."""
    entry = {r.req_id: r for inst in hub.entry for r in inst.core.records}
    decode = {r.req_id: r for inst in hub.decode for r in inst.core.records}
    prefill_queue: list[float] = []
    reservation: list[float] = []
    transfer: list[float] = []
    decode_queue: list[float] = []
    wire_bytes = 0.0
    # (one the decode instance rejected, or withdrawn, was never sent)
    handed = [(r, ho) for r, ho in hub.handovers.items() if not math.isnan(ho.kv_arrived)]
    for req_id, ho in handed:
        first = entry[req_id]
        if first.first_scheduled is not None:
            prefill_queue.append(first.first_scheduled - first.arrival)
        reservation.append(ho.reserved - ho.prefill_started)
        transfer.append(ho.kv_arrived - max(ho.ready, ho.reserved))
        wire_bytes += ho.kv_bytes
        second = decode.get(req_id)
        if second is not None and second.first_scheduled is not None:
            decode_queue.append(second.first_scheduled - ho.kv_arrived)
    link = hub.link
    return {
        "handovers": len(handed),  # KV sent (not those the decode instance rejected)
        "kv_bytes_per_token": hub.kv_bytes_per_token,
        "kv_bytes_moved": wire_bytes,
        "link": {"bandwidth_bytes_s": link.bandwidth, "latency_s": link.latency_s},
        "layerwise": hub.spec.layerwise,
        "prefill_queue_s": _stats(prefill_queue),
        "decode_reservation_s": _stats(reservation),
        "kv_transfer_s": _stats(transfer),
        "decode_queue_s": _stats(decode_queue),
    }


def plan_cost(
    spec: ClusterSpec,
    summary: dict[str, Any],
    slo: SLO | None,
    records: list[RequestRecord] | None = None,
) -> dict[str, Any]:
    """GPU-hours over the run (every GPU is held from the first arrival to the last
    finish), and the cost per million tokens of the requests that count: all completed
    ones, or with an SLO (and the records) only the tokens of those that met it."""
    hours = summary["duration_s"] / 3600.0
    gpu_hours = {p.name: p.num_gpus * hours for p in spec.pools}
    dollars = sum(gpu_hours[p.name] * spec.prices[p.hardware] for p in spec.pools)
    counted_out = summary["total_output_tokens"]
    counted_in = summary["total_input_tokens"]
    if slo is not None and records is not None:
        counted_in, counted_out = good_tokens(records, slo)
    return {
        "gpus": spec.num_gpus,
        "gpu_hours": sum(gpu_hours.values()),
        "gpu_hours_per_pool": gpu_hours,
        "prices_per_gpu_hour": {p.hardware: spec.prices[p.hardware] for p in spec.pools},
        "dollars": dollars,
        "counted": "requests meeting the SLO" if slo is not None else "completed requests",
        "per_million_output_tokens": dollars / counted_out * 1e6 if counted_out else None,
        "per_million_input_tokens": dollars / counted_in * 1e6 if counted_in else None,
    }


def _prefix_counts(inst: Instance) -> dict[str, Any]:
    """Evictions and prefix lookups, summed over an instance's engines (its ranks)."""
    cores = inst.core.cores if isinstance(inst.core, RankGroup) else [inst.core]
    hits: dict[str, int] = {}
    for c in cores:
        for tier, n in c.scheduler.kv.prefix_hit_blocks.items():
            hits[tier] = hits.get(tier, 0) + n
    return {
        "prefix_evictions": sum(c.scheduler.kv.pool.num_evictions for c in cores),
        "prompt_blocks_looked_up": sum(c.scheduler.kv.num_prefix_blocks_looked_up for c in cores),
        "prefix_hit_blocks": hits,
    }
