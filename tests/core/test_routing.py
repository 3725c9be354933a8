"""The routing policies (deepinfer.routing): each one's choice from its bookkeeping and
the instances' reports, the eligibility rule, and the registry's refusals."""

from __future__ import annotations

import pytest

from deepinfer.config import EngineConfig
from deepinfer.kv_cache.hashing import update_block_hashes
from deepinfer.routing import ROUTERS, InstanceLoad, InstanceView, make_router
from deepinfer.routing.instance_report import InstanceReport, report_of, take_report, view_of
from deepinfer.routing.policies import LeastLoadRouter
from tests.factories import make_engine, make_request


def views(n: int, max_prompt: int = 1000) -> list[InstanceView]:
    return [InstanceView(i, 4, max_prompt) for i in range(n)]


def route_n(name: str, vs: list[InstanceView], k: int, **options: object) -> list[int]:
    router = make_router(name, len(vs), **options)  # type: ignore[arg-type]
    return [router.route(make_request(f"r{i}", 8), vs) for i in range(k)]


def test_round_robin_takes_each_instance_in_turn() -> None:
    assert route_n("round-robin", views(3), 7) == [0, 1, 2, 0, 1, 2, 0]


def test_round_robin_skips_an_instance_the_prompt_does_not_fit() -> None:
    vs = views(3)
    vs[1].max_prompt_tokens = 4  # the 8-token prompts would be rejected there
    assert route_n("round-robin", vs, 4) == [0, 2, 0, 2]


def test_least_requests_counts_placements_until_they_finish() -> None:
    vs = views(3)
    router = make_router("least-requests", 3)
    assert [router.route(make_request(f"r{i}", 8), vs) for i in range(4)] == [0, 1, 2, 0]
    take_report(router, vs, InstanceReport(1, InstanceLoad(), finished=("r1",)))
    assert router.outstanding == [2, 0, 1]
    assert router.route(make_request("r9", 8), vs) == 1


def test_least_kv_reads_the_reported_usage_then_outstanding() -> None:
    vs = views(3)
    router = make_router("least-kv", 3)
    for i, usage in enumerate([0.5, 0.2, 0.2]):
        take_report(router, vs, InstanceReport(i, InstanceLoad(0, 1, usage)))
    assert router.route(make_request("a", 8), vs) == 1
    assert router.route(make_request("b", 8), vs) == 2  # equal usage: fewer outstanding


def test_power_of_two_is_seeded_and_picks_the_less_loaded_of_its_pair() -> None:
    a = route_n("power-of-two", views(5), 40, seed=3)
    assert a == route_n("power-of-two", views(5), 40, seed=3)
    assert a != route_n("power-of-two", views(5), 40, seed=4)
    router = make_router("power-of-two", 2, seed=0)
    vs = views(2)
    picks = [router.route(make_request(f"r{i}", 8), vs) for i in range(6)]
    assert sorted(picks) == [0, 0, 0, 1, 1, 1]  # two instances: always the pair, alternating


def test_prefix_affinity_follows_the_cached_prefix_until_the_imbalance_limit() -> None:
    vs = views(2)
    shared = list(range(100, 112))  # three full blocks of 4
    warm = make_request("warm", shared)
    vs[1].apply_cache_changes({h: True for h in update_block_hashes(warm, 4)})
    router = make_router("prefix-affinity", 2, max_imbalance=2)
    picks = [router.route(make_request(f"r{i}", shared + [i]), vs) for i in range(4)]
    assert picks == [1, 1, 1, 0]  # the 4th would leave instance 1 three ahead of instance 0
    assert vs[1].cached_prefix_blocks(make_request("x", shared)) == 3
    assert vs[0].cached_prefix_blocks(make_request("y", shared)) == 0
    assert router.route(make_request("cold", [1, 2, 3, 4, 5]), vs) == 0  # no hit: least loaded


def test_least_load_spreads_a_burst_and_follows_reports() -> None:
    router = LeastLoadRouter(3)
    vs = views(3)
    assert [router.route(make_request(f"r{i}", 8), vs) for i in range(7)] == [0, 1, 2, 0, 1, 2, 0]
    router = LeastLoadRouter(3)
    for i, load in enumerate(
        [InstanceLoad(2, 1, 0.1), InstanceLoad(0, 4, 0.7), InstanceLoad(0, 1, 0.3)]
    ):
        router.on_report(i, load)
    assert router.route(make_request("a", 8), vs) == 2  # queues 2/0/0: lower KV usage
    assert router.route(make_request("b", 8), vs) == 1  # rank 2 now has one placed


def test_a_prompt_no_instance_fits_still_goes_somewhere_to_be_rejected() -> None:
    vs = views(2, max_prompt=4)
    assert route_n("least-requests", vs, 2) == [0, 1]


def test_unknown_routers_and_options_are_refused_by_name() -> None:
    with pytest.raises(ValueError, match="router 'fastest'"):
        make_router("fastest", 2)
    with pytest.raises(ValueError, match="unknown option 'max_imbalance'"):
        make_router("round-robin", 2, max_imbalance=3)
    with pytest.raises(ValueError, match="num_instances=0"):
        make_router("round-robin", 0)


def test_the_engine_config_checks_its_router_name() -> None:
    """The default is a policy (the config accepts it without importing the routers);
    another name must be one, and needs more than one rank to choose from."""
    assert EngineConfig().data_parallel_router in ROUTERS
    EngineConfig(data_parallel_size=2, data_parallel_router="round-robin")
    with pytest.raises(ValueError, match="'fastest': expected one of"):
        EngineConfig(data_parallel_size=2, data_parallel_router="fastest")
    with pytest.raises(ValueError, match="needs data_parallel_size > 1"):
        EngineConfig(data_parallel_router="round-robin")


def test_an_engine_reports_its_cached_prefix_changes() -> None:
    engine = make_engine(block_size=4, num_gpu_blocks=8)
    view = view_of(0, engine)
    assert view.max_prompt_tokens == engine.scheduler.max_prompt_tokens
    engine.add_request(make_request("a", list(range(9)), max_tokens=1))
    while engine.has_unfinished():
        engine.step()
    report = report_of(0, engine, ["a"])
    assert sum(report.cache_changes.values()) == 2  # two full prompt blocks now cached
    router = make_router("least-requests", 1)
    router.route(make_request("a", 9), [view])
    take_report(router, [view], report)
    assert view.cached_prefix_blocks(make_request("b", list(range(9)))) == 2
    assert router.outstanding == [0]
