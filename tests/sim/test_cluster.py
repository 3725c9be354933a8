"""The cluster simulation (sim/cluster): its reductions to one engine, the
disaggregated handover, routing shares, the description's errors, and the fast-forward's
exactness over several instances."""

from __future__ import annotations

import math
import subprocess
import sys
from pathlib import Path

import pytest

from deepinfer.config import EngineConfig
from sim import simulate
from sim.cluster import ClusterError, replicas, simulate_cluster
from sim.cluster.description import RouterSpec, cluster_from_dict, load_cluster
from sim.traces import Trace, TraceRequest, load_trace

ROOT = Path(__file__).resolve().parents[2]
ROUTERS = [
    "round-robin",
    "least-requests",
    "least-kv",
    "power-of-two",
    "prefix-affinity",
    "least-load",
]


def _trace(n: int = 120) -> Trace:
    return load_trace(ROOT / "traces" / "azure_code_small.json", max_requests=n)


def _steps(steps: list) -> list[dict]:  # type: ignore[type-arg]
    return [s.__dict__ for s in steps]


@pytest.mark.parametrize("policy", ROUTERS)
def test_one_colocated_instance_is_simulate_step_for_step(policy: str) -> None:
    trace = _trace()
    engine = EngineConfig(num_gpu_blocks=400)
    one = simulate(trace, engine=engine)
    cluster = replicas(1, engine, "moonlight-16b-a3b", "h200", RouterSpec(policy))
    many = simulate_cluster(trace, cluster)
    assert _steps(many.steps["replicas[0]"]) == _steps(one.steps)
    assert [r.__dict__ for r in many.requests] == [r.__dict__ for r in one.requests]


def test_round_robin_gives_identical_replicas_exactly_their_share() -> None:
    reqs = [TraceRequest(f"r{i}", i * 0.5, 64 + 32 * (i % 2), 8) for i in range(24)]
    cluster = replicas(3, EngineConfig(), "moonlight-16b-a3b", "h200", RouterSpec("round-robin"))
    result = simulate_cluster(reqs, cluster)
    assert [i["requests"] for i in result.meta["instances"]] == [8, 8, 8]


def _pd(link: dict | None = None, **extra: object) -> dict:  # type: ignore[type-arg]
    raw: dict = {  # type: ignore[type-arg]
        "pools": [
            {"name": "p", "role": "prefill", "count": 1},
            {"name": "d", "role": "decode", "count": 1},
        ],
        **extra,
    }
    if link is not None:
        raw["links"] = {"inter_node": link}
    return raw


def test_with_an_infinitely_fast_link_a_decode_starts_when_its_prefill_ends() -> None:
    reqs = [TraceRequest(f"r{i}", i * 2.0, 300 + 10 * i, 5) for i in range(10)]
    cluster = cluster_from_dict(_pd({"bandwidth_gb_s": math.inf, "latency_us": 0}))
    result = simulate_cluster(reqs, cluster)
    decode = {r.req_id: r for r in result.decode_records}
    for rec in result.requests:
        ho = result.handovers[rec.req_id]
        assert ho.kv_arrived == ho.ready
        assert decode[rec.req_id].first_scheduled == ho.ready  # spaced out: no queue
        assert rec.status == "finished" and rec.num_output_tokens == 5


def test_a_slow_link_delays_every_decode_by_its_transfer() -> None:
    reqs = [TraceRequest(f"r{i}", i * 2.0, 1000, 5) for i in range(4)]
    raw = _pd({"bandwidth_gb_s": 1, "latency_us": 500}, kv_transfer={"layerwise": False})
    result = simulate_cluster(reqs, cluster_from_dict(raw))
    per_token = result.meta["disaggregation"]["kv_bytes_per_token"]
    for ho in result.handovers.values():
        # The prompt's KV but its last token's, as the executor exports it: the decode
        # engine computes that token in its first step.
        assert ho.kv_bytes == 999 * per_token
        assert ho.kv_arrived == pytest.approx(ho.ready + 500e-6 + 999 * per_token / 1e9)
    for rec in result.requests:
        assert rec.first_token is not None
        assert rec.first_token > result.handovers[rec.req_id].kv_arrived


def test_a_full_decode_instance_reserves_blocks_before_the_kv_is_sent() -> None:
    """Its cache holds one request at a time: each KV waits for its blocks (reserved
    in arrival order as the one before ends) and goes only then, so the decode instance
    never runs short (no preemption) and never receives a KV it has no room for."""
    reqs = [TraceRequest(f"r{i}", 0.0, 100, 40) for i in range(4)]
    raw = _pd({"bandwidth_gb_s": 1, "latency_us": 500}, kv_transfer={"layerwise": False})
    raw["pools"][1]["engine"] = {"num_gpu_blocks": 9, "block_size": 16}  # 140 tokens of KV
    result = simulate_cluster(reqs, cluster_from_dict(raw), fast_forward=False)
    wire = 500e-6 + 99 * result.meta["disaggregation"]["kv_bytes_per_token"] / 1e9
    decode = {r.req_id: r for r in result.decode_records}
    order = sorted(result.handovers.values(), key=lambda ho: ho.reserved)
    assert [ho.req_id for ho in order] == ["r0", "r1", "r2", "r3"]
    for before, ho in zip([None, *order], order):
        assert ho.kv_arrived == pytest.approx(max(ho.ready, ho.reserved) + wire)
        if before is not None:  # its blocks were free only once the one before ended
            assert ho.reserved >= decode[before.req_id].finish > ho.ready
    assert all(r.num_preemptions == 0 and r.status == "finished" for r in result.requests)
    assert result.meta["disaggregation"]["decode_reservation_s"]["p99"] > 0


@pytest.mark.parametrize("ranks", [1, 2])
@pytest.mark.parametrize("admitted", [False, True])
def test_a_prefill_that_ends_a_request_unfinished_withdraws_it_from_its_decode(
    monkeypatch: pytest.MonkeyPatch, ranks: int, admitted: bool
) -> None:
    """Not reachable from a trace (a started prefill always finishes), so forced: the
    prefill instance aborts r0 just after the decode router's turn. It ends once
    (aborted), is counted once, and the decode router hears of its end."""
    from sim.cluster import cluster as cluster_module

    hand_over = cluster_module.Cluster._hand_over

    def then_abort(self: cluster_module.Cluster, ho: cluster_module.Handover, at: float) -> None:
        hand_over(self, ho, at)
        if ho.req_id == "r0":
            if admitted:
                self.decode[0].admit(at)
            self.entry[0].core.abort("r0")
            self._cancel(ho)  # as its prefill's report says, before or after admission

    monkeypatch.setattr(cluster_module.Cluster, "_hand_over", then_abort)
    reqs = [TraceRequest("r0", 0.0, 400, 20), TraceRequest("r1", 0.0, 300, 20)]
    raw = _pd()
    for pool in raw["pools"]:  # (chunks: r0 is live on its prefill at the router's turn)
        pool["engine"] = {"data_parallel_size": ranks, "max_num_batched_tokens": 64}
    ended: list[int] = []
    result = simulate_cluster(reqs, cluster_from_dict(raw), on_progress=ended.append)
    assert [(r.req_id, r.status) for r in result.requests] == [
        ("r0", "aborted"),
        ("r1", "finished"),
    ]
    assert sum(ended) == 2
    assert result.handovers["r0"].cancelled and math.isnan(result.handovers["r0"].kv_arrived)
    routing = result.instances["d[0]"].routing
    for queue in routing.queued:
        routing._take(queue, math.inf)
    assert routing.router.outstanding == [0]


@pytest.mark.parametrize("ranks", [1, 2])
def test_layer_by_layer_the_kv_goes_while_the_prefill_runs(ranks: int) -> None:
    """An idle decode instance reserves at its router's turn (the prefill's first step,
    also where the prefill instance is data-parallel ranks stepping in rounds): every
    layer but the last crosses while the prefill computes."""
    reqs = [TraceRequest(f"r{i}", i * 2.0, 4000, 3) for i in range(3)]
    raw = _pd({"bandwidth_gb_s": 5, "latency_us": 100}, kv_transfer={"layerwise": True})
    raw["pools"][0]["engine"] = {"data_parallel_size": ranks}
    raw["pools"][1]["engine"] = {"data_parallel_size": ranks}
    result = simulate_cluster(reqs, cluster_from_dict(raw))
    per_token = result.meta["disaggregation"]["kv_bytes_per_token"]
    layers = 27  # moonlight-16b-a3b
    wire = 3999 * per_token / 5e9  # (the prompt but its last token)
    for ho in result.handovers.values():
        assert ho.reserved == ho.prefill_started
        assert ho.kv_arrived == pytest.approx(
            max(ho.ready + 100e-6 + wire / layers, ho.prefill_started + 100e-6 + wire)
        )
        assert ho.kv_arrived < ho.ready + 100e-6 + wire  # sooner than whole


@pytest.mark.parametrize("policy", ["least-kv", "least-load", "prefix-affinity"])
def test_fast_forward_is_exact_over_several_instances(policy: str) -> None:
    trace = _trace(200)
    engine = EngineConfig(num_gpu_blocks=300, async_scheduling=False)
    for cluster in (
        replicas(3, engine, "moonlight-16b-a3b", "h200", RouterSpec(policy)),
        cluster_from_dict(
            {
                "router": policy,
                "decode_router": policy,
                "pools": [
                    {"name": "p", "role": "prefill", "count": 1},
                    {"name": "d", "role": "decode", "count": 2, "engine": {"num_gpu_blocks": 200}},
                ],
            }
        ),
    ):
        fast = simulate_cluster(trace, cluster)
        slow = simulate_cluster(trace, cluster, fast_forward=False)
        assert fast.meta["fast_forward"]["steps"] > 0
        assert [r.__dict__ for r in fast.requests] == [r.__dict__ for r in slow.requests]
        for name in fast.steps:
            assert _steps(fast.steps[name]) == _steps(slow.steps[name]), name


def test_the_plan_is_priced_per_million_tokens() -> None:
    cluster = replicas(2, EngineConfig(), "moonlight-16b-a3b", "h200", RouterSpec())
    result = simulate_cluster(_trace(50), cluster)
    cost = result.meta["cost"]
    hours = result.summary["duration_s"] / 3600
    assert cost["gpu_hours"] == pytest.approx(2 * hours)
    assert cost["dollars"] == pytest.approx(2 * hours * cost["prices_per_gpu_hour"]["h200"])
    per_out = cost["dollars"] / result.summary["total_output_tokens"] * 1e6
    assert cost["per_million_output_tokens"] == pytest.approx(per_out)


@pytest.mark.parametrize(
    ("raw", "named"),
    [
        ({"pools": [{"name": "a", "count": 0}]}, "pools[0]: count 0"),
        ({"pools": [{"name": "a", "role": "mixed"}]}, "pools[0]: role 'mixed'"),
        ({"pools": [{"name": "a", "colour": 1}]}, "pools[0]: unknown key(s) ['colour']"),
        ({"pools": [{"name": "a", "engine": {"max_num_seq": 1}}]}, "pools[0].engine"),
        ({"pools": [{"name": "a"}], "router": "fastest"}, "router: policy 'fastest'"),
        (
            {
                "pools": [{"name": "a"}],
                "router": {"policy": "prefix-affinity", "max_imbalance": -1},
            },
            "router: max_imbalance=-1",
        ),
        (
            {
                "pools": [{"name": "a"}],
                "router": {"policy": "prefix-affinity", "max_imbalance": "x"},
            },
            "router: max_imbalance='x'",
        ),
        (
            {"pools": [{"name": "a"}], "router": {"policy": "round-robin", "x": 1}},
            "unknown option 'x'",
        ),
        ({"pools": [{"name": "a", "role": "prefill"}]}, "needs a prefill and a decode pool"),
        ({"pools": [{"name": "a"}], "kv_transfer": {"link": "ib"}}, "kv_transfer.link 'ib'"),
        ({"pools": [{"name": "a", "hardware": "h100"}], "prices": {"h100": -1}}, "prices.h100"),
        ({"pools": [{"name": "a"}], "tiers": {}}, "unknown key(s) ['tiers']"),
        ({"pools": [{"name": "a"}], "kv_tiers": {"disk": {}}}, "kv_tiers: unknown key(s) ['disk']"),
        (
            {
                "pools": [{"name": "a", "engine": {"data_parallel_size": 2}}],
                "kv_tiers": {"store": {"size_gib": 1}},
            },
            "pool a: KV tiers with data_parallel_size=2",
        ),
        (
            {"pools": [{"name": "a"}], "kv_tiers": {"host": {"size_gib": 1, "speed": 2}}},
            "kv_tiers.host: unknown key(s) ['speed']",
        ),
        ({"pools": [{"name": "a"}], "kv_tiers": {"host": {}}}, "kv_tiers.host: no size_gib"),
        ({"pools": [{"name": "a"}], "kv_tiers": {"store": {"size_gib": 0}}}, "store.size_gib 0"),
        (
            {"pools": [{"name": "a"}], "kv_tiers": {"store": {"size_gib": 1, "latency_us": "x"}}},
            "kv_tiers.store.latency_us 'x'",
        ),
        (
            {
                "pools": [{"name": "a", "engine": {"enable_prefix_caching": False}}],
                "kv_tiers": {"host": {"size_gib": 1}},
            },
            "kv_tiers.host: kv_host_cache_gib=1.0 with enable_prefix_caching=False",
        ),
        (
            {
                "pools": [{"name": "a", "engine": {"enable_prefix_caching": False}}],
                "kv_tiers": {"store": {"size_gib": 1}},
            },
            "kv_tiers.store: pool a has enable_prefix_caching=False",
        ),
    ],
)
def test_a_wrong_key_or_value_is_named(raw: dict, named: str) -> None:  # type: ignore[type-arg]
    with pytest.raises(ClusterError) as info:
        cluster_from_dict(raw, source="c.yaml")
    assert named in str(info.value) and str(info.value).startswith("c.yaml")


def test_the_cli_runs_a_cluster_file_and_refuses_a_bad_one(tmp_path: Path) -> None:
    good = tmp_path / "c.yaml"
    good.write_text(
        "router: prefix-affinity\npools:\n  - {name: prefill, role: prefill, count: 1}\n"
        "  - {name: decode, role: decode, count: 2}\n"
    )
    run = [sys.executable, "-m", "deepinfer", "simulate", "--no-progress", "--max-requests", "40"]
    out = subprocess.run([*run, "--cluster", str(good)], capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    assert (
        "disaggregation: 40 KV handovers" in out.stdout
        and "per million output tokens" in out.stdout
    )
    bad = tmp_path / "bad.yaml"
    bad.write_text("pools:\n  - {name: a, count: two}\n")
    out = subprocess.run([*run, "--cluster", str(bad)], capture_output=True, text=True)
    assert out.returncode == 2 and "pools[0]: count 'two'" in out.stderr
    assert load_cluster(good).disaggregated


def test_the_cluster_plans_benchmark_prints_a_row_per_plan(
    capsys: pytest.CaptureFixture[str],
) -> None:
    from benchmarks.cluster_plans import main

    trace = str(ROOT / "traces" / "azure_code_small.json")
    assert main(["--trace", trace, "--max-requests", "30", "--instances", "4"]) == 0
    rows = [line for line in capsys.readouterr().out.splitlines() if line.startswith("| ")]
    assert len(rows) == 1 + 5 + 2  # header, five routers, PD 2:2 and 1:3
    assert rows[-1].startswith("| PD 1:3 | least-requests / least-requests |")


def test_an_instance_of_data_parallel_ranks_is_simulate_round_for_round() -> None:
    trace = _trace(100)
    one = simulate(trace, "deepseek-v2-lite", engine=EngineConfig(data_parallel_size=2))
    raw = {
        "model": "deepseek-v2-lite",
        "pools": [{"name": "g", "engine": {"data_parallel_size": 2}}],
    }
    many = simulate_cluster(trace, cluster_from_dict(raw))
    assert _steps(many.steps["g[0]"]) == _steps(one.steps)
    assert [r.__dict__ for r in many.requests] == [r.__dict__ for r in one.requests]
    assert many.meta["pools"][0]["gpus"] == 2 and "g[0]" in many.meta["data_parallel"]


def test_disaggregated_pools_of_expert_parallel_ranks_serve_every_request() -> None:
    raw = {
        "model": "deepseek-v2-lite",
        "router": "least-kv",
        "pools": [
            {"name": "p", "role": "prefill", "engine": {"data_parallel_size": 2}},
            {
                "name": "d",
                "role": "decode",
                "count": 2,
                "engine": {"data_parallel_size": 4, "enable_expert_parallel": True},
            },
        ],
    }
    result = simulate_cluster(_trace(60), cluster_from_dict(raw), check_invariants=True)
    assert result.summary["num_completed"] == 60
    assert result.meta["cost"]["gpus"] == 2 + 2 * 4
    assert result.meta["data_parallel"]["d[0]"]["all_to_all_seconds"] > 0


def test_fast_forward_is_exact_under_prefix_affinity_when_runs_evict_cached_prefixes() -> None:
    """A decode run's blocks evict cached prefix blocks, which prefix-affinity reads: runs
    end before its next decision, so the placements equal single steps' (a small cache
    and shared prefixes, where a run that outlived an arrival placed requests apart)."""
    import random

    for seed in (23, 33):
        rng = random.Random(seed)
        reqs, t = [], 0.0
        for i in range(rng.randint(6, 14)):
            t += rng.expovariate(1 / 0.05)
            nblk = rng.randint(1, 6)
            pref = tuple(rng.choice([100, 101, 102]) * 10 + k for k in range(nblk))
            plen = nblk * 16 + rng.randint(0, 20)
            rest = tuple(10000 + i * 100 + k for k in range((plen - 1) // 16 + 1 - nblk))
            reqs.append(TraceRequest(f"r{i}", t, plen, rng.randint(1, 200), pref + rest, 16))
        engine = EngineConfig(
            num_gpu_blocks=30, block_size=16, async_scheduling=False, max_model_len=512
        )
        router = RouterSpec("prefix-affinity", {"max_imbalance": 3})
        cluster = replicas(2, engine, "moonlight-16b-a3b", "h200", router)
        fast = simulate_cluster(reqs, cluster, cost_model="unit")
        slow = simulate_cluster(reqs, cluster, cost_model="unit", fast_forward=False)
        assert [r.__dict__ for r in fast.requests] == [r.__dict__ for r in slow.requests], seed


def test_with_an_slo_the_plan_costs_the_tokens_of_the_requests_that_met_it() -> None:
    from deepinfer.metrics import SLO, good_tokens

    cluster = replicas(1, EngineConfig(), "moonlight-16b-a3b", "h200", RouterSpec())
    slo = SLO(ttft_ms=60.0)  # some of the bundled trace's requests miss it
    result = simulate_cluster(_trace(80), cluster, slo=slo)
    good_in, good_out = good_tokens(result.requests, slo)
    assert 0 < good_out < result.summary["total_output_tokens"]
    cost = result.meta["cost"]
    assert cost["per_million_output_tokens"] == pytest.approx(cost["dollars"] / good_out * 1e6)
    assert cost["per_million_input_tokens"] == pytest.approx(cost["dollars"] / good_in * 1e6)
