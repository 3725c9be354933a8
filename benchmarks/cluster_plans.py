"""Cluster plans over one trace: colocated replicas under each router, and prefill/decode
disaggregation at several P:D ratios, all with the same number of GPUs.

    deepinfer bench cluster-plans --trace AzureLLMInferenceTrace_conv.csv --time-scale 0.0625
    deepinfer bench cluster-plans --trace traces/mooncake_conversation_small.jsonl \\
        --model deepseek-v2-lite --instances 4

--host-gib adds two colocated plans whose instances keep prefix blocks evicted from HBM
in that much host DRAM (sim/kv_tiers.py). Prints one markdown row per plan: TTFT and TPOT p50/p99, the share of requests meeting
the SLO, the plan's US$ per million output tokens counted over those requests, and the
wall seconds the simulation took (one process). --time-scale < 1 compresses the trace's
arrivals, so a cluster sized for it is loaded as one instance is by the trace itself.
"""

from __future__ import annotations

import argparse
import time
from typing import Any

from deepinfer.config import EngineConfig
from deepinfer.metrics import parse_slo
from sim.cluster import simulate_cluster
from sim.cluster.description import ClusterSpec, cluster_from_dict
from sim.traces import load_trace

ROUTERS = ("round-robin", "least-requests", "power-of-two", "prefix-affinity", "least-kv")


def plans(
    n: int, model: str, hardware: str, only: str | None, host_gib: float = 0.0
) -> list[tuple[str, dict[str, Any]]]:
    out: list[tuple[str, dict[str, Any]]] = []
    if only in (None, "colocated"):
        for router in ROUTERS:
            pool = {"name": "replicas", "count": n, "hardware": hardware}
            out.append((f"colocated x{n}", {"model": model, "router": router, "pools": [pool]}))
        if host_gib > 0:  # the same plans with a host-DRAM tier per instance
            for router in ("least-requests", "prefix-affinity"):
                pool = {"name": "replicas", "count": n, "hardware": hardware}
                raw = {"model": model, "router": router, "pools": [pool]}
                raw["kv_tiers"] = {"host": {"size_gib": host_gib}}
                out.append((f"colocated x{n}, host {host_gib:g} GiB", raw))
    if only in (None, "pd"):
        for p in sorted({n // 2, max(1, round(n / 3)), max(1, n // 4)}, reverse=True):
            pools = [
                {"name": "prefill", "role": "prefill", "count": p, "hardware": hardware},
                {"name": "decode", "role": "decode", "count": n - p, "hardware": hardware},
            ]
            raw = {"model": model, "router": "least-requests", "pools": pools}
            out.append((f"PD {p}:{n - p}", raw | {"decode_router": "least-requests"}))
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--trace", required=True, help="a trace file (any format simulate reads)")
    ap.add_argument("--time-scale", type=float, default=1.0, help="multiply arrival times")
    ap.add_argument("--max-requests", type=int, default=None)
    ap.add_argument("--model", default="moonlight-16b-a3b")
    ap.add_argument("--hardware", default="h200")
    ap.add_argument("--instances", type=int, default=16, help="instances per plan (GPUs)")
    ap.add_argument("--slo", default="ttft:2000,tpot:100", help="per-request limits, ms")
    ap.add_argument("--only", choices=["colocated", "pd"], default=None)
    ap.add_argument(
        "--host-gib",
        type=float,
        default=0.0,
        help="also run two colocated plans with this much host DRAM per instance (KV tier)",
    )
    args = ap.parse_args(argv)
    trace = load_trace(args.trace, time_scale=args.time_scale, max_requests=args.max_requests)
    slo = parse_slo(args.slo)
    print(
        f"{trace.name}: {len(trace)} requests over {trace.duration:.0f} s (time scale "
        f"{args.time_scale:g}); {args.model} on {args.hardware}; SLO {args.slo} ms"
    )
    print(
        "| plan | router | TTFT p50 / p99 ms | TPOT p50 / p99 ms | meet SLO | $ / M out tok | wall s |"
    )
    print("|---|---|---|---|---|---|---|")
    for name, raw in plans(args.instances, args.model, args.hardware, args.only, args.host_gib):
        spec: ClusterSpec = cluster_from_dict(raw, source=name, base_engine=EngineConfig())
        t0 = time.perf_counter()
        result = simulate_cluster(trace, spec, slo=slo)
        wall = time.perf_counter() - t0
        s, cost = result.summary, result.meta["cost"]
        router = raw["router"] + (f" / {raw['decode_router']}" if "decode_router" in raw else "")
        good = s["num_good"] / s["num_submitted"] if s["num_submitted"] else 0.0
        per = cost["per_million_output_tokens"]
        print(
            f"| {name} | {router} | {s['ttft_ms_p50']:.0f} / {s['ttft_ms_p99']:.0f} | "
            f"{s['tpot_ms_p50']:.1f} / {s['tpot_ms_p99']:.1f} | {good:.1%} | "
            f"{'-' if per is None else f'{per:.2f}'} | {wall:.0f} |",
            flush=True,
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
