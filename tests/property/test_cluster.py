"""Properties of a simulated cluster (sim/cluster) over random clusters, traces and
routers: every request ends in exactly one terminal state somewhere in the cluster; KV
blocks are conserved on every instance (its invariants checked after every step, and
nothing held at the end); a router never sends a request to an instance that must reject
it while another could serve it, and a request some instance can serve is served; a
disaggregated request's decode never starts before its KV has arrived, and exactly the
requests whose prefill finished are handed over, once each."""

from __future__ import annotations

import math
from collections import Counter

from hypothesis import given
from hypothesis import strategies as st

from deepinfer.routing import ROUTERS
from sim.cluster import simulate_cluster
from sim.cluster.description import cluster_from_dict
from sim.data_parallel import RankGroup
from sim.traces import TraceRequest
from tests.property.strategies import scaled

BLOCK = 16


@st.composite
def clusters(draw: st.DrawFn) -> dict:  # type: ignore[type-arg]
    """Colocated (1-3 pools) or disaggregated (prefill and decode pools), small caches
    that differ between pools (so some prompts fit only some instances), any router."""
    pd = draw(st.booleans())
    roles = ["prefill", "decode"] if pd else ["colocated"] * draw(st.integers(1, 3))
    pools = []
    for i, role in enumerate(roles):
        ranks = draw(st.sampled_from([1, 1, 2]))  # instances of data-parallel ranks too
        engine = {
            "block_size": BLOCK,
            "num_gpu_blocks": draw(st.integers(6, 40)),
            "max_num_seqs": draw(st.integers(1, 8)),
            "max_num_batched_tokens": draw(st.sampled_from([64, 256, 2048])),
            "async_scheduling": ranks == 1 and draw(st.booleans()),  # (refused over ranks)
            "enable_prefix_caching": draw(st.booleans()),
            "data_parallel_size": ranks,
        }
        pools.append(
            {"name": f"{role}{i}", "role": role, "count": draw(st.integers(1, 3)), "engine": engine}
        )
    raw = {
        "router": draw(st.sampled_from(sorted(ROUTERS))),
        "pools": pools,
        "seed": draw(st.integers(0, 3)),
    }
    ranked = any(p["engine"]["data_parallel_size"] > 1 for p in pools)
    if all(p["engine"]["enable_prefix_caching"] for p in pools) and not ranked:
        # (refused with instances of several ranks) Tiers of a few blocks (Moonlight's 16-token blocks are ~500 kB): a host tier per
        # instance, a store all of them share, or both.
        tiers = {}
        for name in draw(st.sampled_from([(), ("host",), ("store",), ("host", "store")])):
            tiers[name] = {"size_gib": draw(st.sampled_from([0.001, 0.004, 0.02]))}
        if tiers:
            raw["kv_tiers"] = tiers
    if pd:
        raw["decode_router"] = draw(st.sampled_from(sorted(ROUTERS)))
        raw["links"] = {
            "inter_node": {
                "bandwidth_gb_s": draw(st.sampled_from([0.01, 1.0, float("inf")])),
                "latency_us": draw(st.sampled_from([0, 100])),
            }
        }
        raw["kv_transfer"] = {"layerwise": draw(st.booleans())}
    return raw


@st.composite
def traces(draw: st.DrawFn) -> list[TraceRequest]:
    n = draw(st.integers(1, 14))
    t = 0.0
    out = []
    for i in range(n):
        t += draw(st.sampled_from([0.0, 0.0, 0.001, 0.01, 0.2]))
        prompt = draw(st.integers(1, 700))
        shared = draw(st.sampled_from([(), (1,), (1, 2)]))  # leading blocks shared by id
        blocks = shared + tuple(
            1000 * (i + 1) + k for k in range(-(-prompt // BLOCK) - len(shared))
        )
        out.append(
            TraceRequest(
                f"r{i}", t, prompt, draw(st.integers(1, 40)),
                prefix_blocks=blocks[: -(-prompt // BLOCK)], prefix_block_size=BLOCK,
            )
        )  # fmt: skip
    return out


@scaled(0.3)
@given(raw=clusters(), trace=traces(), ff=st.booleans())
def test_a_cluster_ends_every_request_once_and_conserves_its_blocks(
    raw: dict,  # type: ignore[type-arg]
    trace: list[TraceRequest],
    ff: bool,
) -> None:
    spec = cluster_from_dict(raw)
    result = simulate_cluster(trace, spec, "unit", check_invariants=True, fast_forward=ff)
    by_id = {r.id: r for r in trace}
    assert [r.req_id for r in result.requests] == [r.id for r in trace]
    hub_instances = list(result.instances.values())
    engines = {
        i.name: i.core.cores if isinstance(i.core, RankGroup) else [i.core] for i in hub_instances
    }
    # Exactly one terminal state, and the tokens asked for (or up to max_model_len).
    limits = {
        c.max_model_len for i in hub_instances if i.role != "prefill" for c in engines[i.name]
    }
    for rec in result.requests:
        assert rec.status in ("finished", "rejected"), rec
        if rec.status == "finished":
            n = rec.num_output_tokens
            assert n == by_id[rec.req_id].output_len or rec.num_prompt_tokens + n in limits
    # Every instance holds nothing at the end (its invariants held after every step).
    for inst in hub_instances:
        assert all(c.scheduler.kv.usage == 0.0 for c in engines[inst.name]), inst.name
        assert not inst.core.has_unfinished()
    # Routing: rejected only where no instance of the pool could serve the prompt.
    entry = [i for i in hub_instances if i.role != "decode"]
    decode = [i for i in hub_instances if i.role == "decode"]
    fits_entry = max(c.scheduler.max_prompt_tokens for i in entry for c in engines[i.name])
    fits_decode = max(
        (c.scheduler.max_prompt_tokens for i in decode for c in engines[i.name]), default=0
    )
    for rec in result.requests:
        prompt = by_id[rec.req_id].prompt_len
        can_serve = prompt <= fits_entry and (not decode or prompt <= fits_decode)
        assert (rec.status == "finished") == can_serve, (rec, fits_entry, fits_decode)
    if not decode:
        return
    # Disaggregation: handed over once each, when the prefill first ran it; the KV goes
    # only once the prefill is done and the decode instance reserved its blocks (a
    # request the decode instance rejects never has its KV sent); the decode starts only
    # once the KV is there.
    entry_records = {r.req_id: r for i in entry for r in i.core.records}
    assert set(result.handovers) == {k for k, r in entry_records.items() if r.status == "finished"}
    counts = Counter(r.req_id for r in result.decode_records)
    assert set(counts) == set(result.handovers) and set(counts.values()) <= {1}
    for rec in result.decode_records:
        ho = result.handovers[rec.req_id]
        if rec.status == "rejected":
            assert math.isnan(ho.reserved) and math.isnan(ho.kv_arrived), ho
            continue
        assert ho.prefill_started <= ho.reserved <= ho.kv_arrived, ho
        assert ho.kv_arrived >= ho.ready
        if rec.first_scheduled is not None:
            assert rec.first_scheduled >= ho.kv_arrived
