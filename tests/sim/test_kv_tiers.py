"""The simulator's KV tiers (sim/kv_tiers.py): sizes in GiB as blocks, a step's loads
priced (bytes / bandwidth + latency, the slower tier), the report's hit rates and bytes
per tier, and a shared store serving a prefix across instances."""

from __future__ import annotations

import pytest

from deepinfer.config import EngineConfig
from deepinfer.outputs import KVLoad, KVSave, SchedulerOutput
from sim.cluster import simulate_cluster
from sim.cluster.description import cluster_from_dict
from sim.cost_model import KVLoadPricing
from sim.kv_tiers import GIB, TierSpec
from sim.simulator import simulate
from sim.traces import TraceRequest

MODEL = "moonlight-16b-a3b"


def test_a_tier_size_is_blocks_of_the_models_kv() -> None:
    tier = TierSpec(1.0, bandwidth=50e9, latency_s=1e-5)
    assert tier.capacity_blocks(1 << 20) == 1024
    assert TierSpec(1e-9, 1.0, 0.0).capacity_blocks(GIB) == 1  # never below one block


def test_a_steps_loads_cost_the_slower_tier() -> None:
    pricing = KVLoadPricing(1000, {"host": (1e6, 1e-3), "store": (1e5, 2e-3)})
    out = SchedulerOutput(1, [])
    assert pricing.seconds(out) == 0.0
    out.kv_loads = (*(KVLoad("host", i, i, i) for i in range(3)), KVLoad("store", 9, 9, 0))
    host, store = 1e-3 + 3 * 1000 / 1e6, 2e-3 + 1000 / 1e5
    assert pricing.seconds(out) == pytest.approx(max(host, store))


def test_a_load_from_the_steps_own_save_crosses_no_link() -> None:
    """A block the step evicted and found again is a device copy from its save in the
    executor (the core's `step_copies`): priced nothing, beside the loads that do cross."""
    pricing = KVLoadPricing(1000, {"host": (1e6, 1e-3)})
    out = SchedulerOutput(1, [])
    out.kv_saves = (KVSave("host", 4, 40, 0),)
    out.kv_loads = (KVLoad("host", 5, 40, 0),)
    assert pricing.seconds(out) == 0.0
    out.kv_loads = (KVLoad("host", 5, 40, 0), KVLoad("host", 6, 61, 1))
    assert pricing.seconds(out) == pytest.approx(1e-3 + 1000 / 1e6)


def _reuse_trace() -> list[TraceRequest]:
    """Two prompts of one 8-block prefix, far apart, with others between them that push it
    out of a small HBM."""
    out = []
    for i in range(6):
        blocks = (1, 2, 3, 4, 5, 6, 7, 8) if i in (0, 5) else tuple(100 * i + k for k in range(8))
        out.append(TraceRequest(f"r{i}", 0.5 * i, 128, 4, blocks, 16))
    return out


def test_simulate_loads_a_prefix_from_the_host_and_reports_it() -> None:
    """The sixth request's prefix was pushed out of HBM: with a host tier it is loaded
    (7 blocks: the last token is computed), and it starts sooner than recomputed."""
    runs = {}
    for gib in (0.0, 1.0):
        engine = EngineConfig(block_size=16, num_gpu_blocks=24, kv_host_cache_gib=gib)
        runs[gib] = simulate(_reuse_trace(), MODEL, "h200", engine, "analytic")
    tiers = runs[1.0].meta["kv_tiers"]
    assert tiers["hit_blocks"] == {"hbm": 0, "host": 7, "store": 0}
    assert tiers["prompt_blocks_looked_up"] == 6 * 7
    assert tiers["hit_rate"]["host"] == pytest.approx(7 / 42)
    block_bytes = tiers["bytes_loaded"]["host"] / 7
    assert tiers["tiers"]["host"]["capacity_blocks"] == GIB // block_bytes
    assert runs[0.0].meta["kv_tiers"]["hit_blocks"]["host"] == 0
    assert runs[0.0].meta["kv_tiers"]["tiers"] == {}
    ttft = {g: r.requests[5].first_token - r.requests[5].arrival for g, r in runs.items()}
    assert ttft[1.0] < ttft[0.0]


def test_a_shared_store_serves_a_prefix_computed_on_another_instance() -> None:
    """Round robin: r0 (the prefix) and r2..r4 on instance 0 and 1 alternately; r0's blocks
    leave instance 0's small HBM for the store, where r5, on instance 1, finds them."""
    raw = {
        "router": "round-robin",
        "pools": [{"name": "r", "count": 2, "engine": {"block_size": 16, "num_gpu_blocks": 12}}],
        "kv_tiers": {"store": {"size_gib": 1}},
    }
    result = simulate_cluster(_reuse_trace(), cluster_from_dict(raw), "unit", check_invariants=True)
    by_name = {i["name"]: i for i in result.meta["instances"]}
    assert by_name["r[1]"]["prefix_hit_blocks"]["store"] == 7
    tiers = result.meta["kv_tiers"]
    assert tiers["hit_blocks"]["store"] == 7 and tiers["bytes_loaded"]["store"] > 0
    assert "store" in tiers["tiers"] and "host_per_pool" not in tiers["tiers"]


def test_data_parallel_ranks_refuse_a_host_tier() -> None:
    engine = EngineConfig(block_size=16, num_gpu_blocks=64, data_parallel_size=2,
                          kv_host_cache_gib=1)  # fmt: skip
    with pytest.raises(ValueError, match="kv_host_cache_gib=1 with data_parallel_size=2"):
        simulate(_reuse_trace(), MODEL, "h200", engine, "unit")
