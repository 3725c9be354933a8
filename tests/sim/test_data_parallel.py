"""The simulator's data-parallel / expert-parallel layout: per-rank schedulers (the same
core), the real front-end's balancer, lock-step rounds priced by the slowest rank plus
the all-to-all of the MoE layers."""

from __future__ import annotations

import dataclasses

import pytest

from deepinfer.config import EngineConfig
from deepinfer.model_config import load_model_config
from deepinfer.outputs import ScheduledRequest, SchedulerOutput
from sim import simulate
from sim.analytic_cost_model import AnalyticCostModel
from sim.cost_coefficients import load_cost_coefficients
from sim.expert_parallel_cost import ExpertParallelCost, draft_pass_rows
from sim.hardware import get_hardware
from sim.kv_capacity import kv_capacity_blocks, mtp_own_weight_bytes
from sim.traces import TraceRequest

MOONLIGHT = load_model_config("moonlight-16b-a3b")  # 64 routed experts, top-6, 26 MoE layers
H200 = get_hardware("h200")


def _cost(ranks: int, ep: bool = True, analytic: bool = False) -> ExpertParallelCost:
    a = AnalyticCostModel(MOONLIGHT, H200, load_cost_coefficients()) if analytic else None
    return ExpertParallelCost(MOONLIGHT, H200, ranks, expert_parallel=ep, analytic=a, seed=1)


def test_h200_lists_its_nvlink_with_the_source() -> None:
    assert H200.nvlink_bandwidth == 450e9  # 900 GB/s bidirectional
    assert "NVLink 900 GB/s" in H200.source


def test_without_expert_parallelism_a_round_is_its_slowest_rank() -> None:
    rc = _cost(3, ep=False).round([10, 0, 300], [0.004, 0.0, 0.009])
    assert (rc.seconds, rc.all_to_all_seconds) == (0.009, 0.0)


def test_idle_ranks_still_pay_the_all_to_all_latency_of_every_moe_layer() -> None:
    rc = _cost(4).round([0, 0, 0, 0], [0.0] * 4)
    assert rc.all_to_all_seconds == pytest.approx(26 * 4 * H200.all_to_all_latency_s)
    assert rc.seconds == rc.all_to_all_seconds and rc.pairs_received == [0, 0, 0, 0]


def test_all_to_all_time_is_the_busiest_links_bytes_over_the_bandwidth() -> None:
    """8 ranks of 4096 tokens each: a rank sends 7/8 of its 4096 x 6 pairs away and
    receives as many; at uniform routing the busiest link is within a few % of that."""
    tokens = [4096] * 8
    rc = _cost(8).round(tokens, [0.01] * 8)
    crossing = 4096 * 6 * 7 / 8 * MOONLIGHT.hidden_size * 2  # bytes out of one rank a layer
    ideal = 26 * 2 * (2 * H200.all_to_all_latency_s + crossing / 450e9)
    assert ideal <= rc.all_to_all_seconds <= 1.05 * ideal
    assert sum(rc.pairs_received) == 8 * 4096 * 6
    assert rc.seconds == pytest.approx(0.01 + rc.all_to_all_seconds)


def test_the_rank_whose_experts_drew_most_pairs_is_the_straggler() -> None:
    """With the analytic model a rank's routed-expert time follows the pairs its experts
    received (from every rank), not its own tokens: an idle rank still computes."""
    cost = _cost(4, analytic=True)
    rc = cost.round([256] * 4, [0.02] * 4)  # equal batches: only the routing differs
    order = sorted(range(4), key=lambda r: rc.pairs_received[r])
    assert [rc.rank_seconds[r] for r in order] == sorted(rc.rank_seconds)
    assert rc.pairs_received[order[-1]] > rc.pairs_received[order[0]]
    assert rc.seconds == pytest.approx(max(rc.rank_seconds) + rc.all_to_all_seconds)
    idle = cost.round([2048, 0, 0, 0], [0.02, 0.0, 0.0, 0.0])
    assert min(idle.rank_seconds[1:]) > 0.0  # serving rank 0's tokens on its experts


def test_a_rank_holding_1_over_n_of_the_experts_has_room_for_more_kv() -> None:
    one = kv_capacity_blocks(MOONLIGHT, H200, 64, 0.9)
    eight = kv_capacity_blocks(MOONLIGHT, H200, 64, 0.9, expert_parallel_size=8)
    assert eight > one


def test_a_speculating_rank_holds_1_over_n_of_the_mtp_layers_experts_too() -> None:
    v3 = load_model_config("deepseek-v3")  # one MTP layer of 256 routed experts
    routed = v3.n_routed_experts * v3.expert_params * v3.dtype_bytes
    assert mtp_own_weight_bytes(v3) - mtp_own_weight_bytes(v3, 8) == routed - routed // 8


def _trace(n: int, out: int = 8) -> list[TraceRequest]:
    return [TraceRequest(f"r{i}", 0.001 * i, 64 + 16 * i, out + (i % 5)) for i in range(n)]


def test_simulated_ranks_use_the_front_ends_balancer_and_keep_their_invariants() -> None:
    """Invariants checked on every rank every step; placement as the balancer places."""
    cfg = EngineConfig(num_gpu_blocks=64, block_size=16, data_parallel_size=4,
                       enable_expert_parallel=True)  # fmt: skip
    result = simulate(_trace(24), engine=cfg, cost_model="unit", check_invariants=True)
    assert all(r.status == "finished" for r in result.requests)
    assert [r.num_output_tokens for r in result.requests] == [8 + i % 5 for i in range(24)]
    assert sum(result.meta["dp_requests_per_rank"]) == 24
    assert min(result.meta["dp_requests_per_rank"]) >= 4  # spread, not piled on rank 0
    assert result.meta["num_gpu_blocks"] == 64  # per rank
    # Every round: 1 ms (the unit model's step) plus the all-to-all of 26 MoE layers.
    a2a_floor = 26 * 4 * H200.all_to_all_latency_s
    assert all(s.duration >= 0.001 + a2a_floor for s in result.steps)
    assert result.meta["all_to_all_seconds"] >= result.meta["dp_rounds"] * a2a_floor
    assert result.meta["dp_rounds"] == len(result.steps)


def test_two_ranks_serve_a_burst_faster_than_one_and_ep_adds_the_exchange() -> None:
    trace = _trace(40, out=30)
    cfg = EngineConfig(num_gpu_blocks=2000, max_num_seqs=8)
    one = simulate(trace, engine=cfg, cost_model="analytic")
    dp = simulate(trace, engine=cfg.replace(data_parallel_size=2), cost_model="analytic")
    ep = simulate(trace, engine=cfg.replace(data_parallel_size=2, enable_expert_parallel=True),
                  cost_model="analytic")  # fmt: skip
    assert dp.summary["makespan_s"] < one.summary["makespan_s"]
    assert ep.meta["all_to_all_seconds"] > 0 and dp.meta["all_to_all_seconds"] == 0
    for r in (dp, ep):
        assert [x.num_output_tokens for x in r.requests] == [
            x.num_output_tokens for x in one.requests
        ]


def test_a_request_finishes_on_one_rank_while_the_other_is_busy() -> None:
    trace = [TraceRequest("short", 0.0, 32, 2), TraceRequest("long", 0.0, 32, 40)]
    cfg = EngineConfig(num_gpu_blocks=64, block_size=16, data_parallel_size=2,
                       enable_expert_parallel=True)  # fmt: skip
    result = simulate(trace, engine=cfg, cost_model="unit", check_invariants=True)
    short, long = result.requests
    assert result.meta["dp_requests_per_rank"] == [1, 1]
    assert short.finish is not None and long.finish is not None
    assert short.finish < long.token_times[10]
    assert result.meta["dp_steps_per_rank"][0] < result.meta["dp_steps_per_rank"][1]


def test_unsupported_simulated_layouts_are_refused() -> None:
    trace = _trace(2)
    with pytest.raises(ValueError, match="64 routed experts do not split evenly over 3"):
        simulate(trace, engine=EngineConfig(data_parallel_size=3, enable_expert_parallel=True))
    with pytest.raises(ValueError, match="does not model async overlap"):
        simulate(trace, engine=EngineConfig(data_parallel_size=2, async_scheduling=True),
                 cost_model="unit")  # fmt: skip
    cpu = dataclasses.replace(get_hardware("cpu"))
    with pytest.raises(ValueError, match="lists no nvlink_bandwidth"):
        ExpertParallelCost(MOONLIGHT, cpu, 2, expert_parallel=True, analytic=None)


def test_structured_requests_over_several_ranks_are_refused_as_the_llm_refuses_them() -> None:
    """LLM refuses so_args with data_parallel_size > 1; the simulator ran them."""
    trace = [dataclasses.replace(r, structured=True) for r in _trace(4)]
    cfg = EngineConfig(num_gpu_blocks=64, block_size=16, data_parallel_size=2)
    with pytest.raises(ValueError, match="structured.*data_parallel_size=2"):
        simulate(trace, engine=cfg, cost_model="unit")
    one = simulate(trace, engine=cfg.replace(data_parallel_size=1), cost_model="unit")
    assert [r.status for r in one.requests] == ["finished"] * 4


def _step(
    sampling: list[bool], num_tokens: int = 4, num_proposals: int | None = None
) -> SchedulerOutput:
    reqs = [ScheduledRequest(f"r{i}", num_tokens, 10, False, s, []) for i, s in enumerate(sampling)]
    return SchedulerOutput(step_id=0, scheduled=reqs, num_proposals=num_proposals)


def test_a_drafting_step_runs_pass_1_over_its_tokens_then_one_row_a_sampling_request() -> None:
    """The real drafter's passes (executors/mtp_drafter.py): pass 1 over the step's
    tokens, then k - 1 chained passes of one row per request that sampled; pass 1 alone
    when none sampled or the step asks for no drafts (variable-length); none without
    speculation or tokens."""
    assert draft_pass_rows(_step([True, True, False]), 3) == [12, 2, 2]
    assert draft_pass_rows(_step([False]), 3) == [4]  # a prompt chunk that samples nothing
    assert draft_pass_rows(_step([True], num_proposals=2), 4) == [4, 1]
    assert draft_pass_rows(_step([True], num_proposals=0), 4) == [4]
    assert draft_pass_rows(_step([True]), 0) == [] and draft_pass_rows(_step([]), 3) == []


def test_a_round_runs_the_most_mtp_passes_any_rank_drafts_and_pads_the_others() -> None:
    """Four ranks drafting 3, 1, 0 passes and nothing at all (an idle rank): the round
    runs 3 MTP passes on every rank, each with an all-to-all of its own, and the ranks
    that pad a pass still serve the pairs their experts receive in it; the model's
    layers are priced as without drafts (routing drawn first, from the same seed)."""
    tokens, seconds = [256, 64, 32, 0], [0.03, 0.01, 0.008, 0.0]
    draft_rows = [[256, 8, 8], [64], [32], []]
    plain = _cost(4, analytic=True).round(tokens, seconds)
    rc = _cost(4, analytic=True).round(tokens, seconds, draft_rows)
    assert (rc.draft_passes, plain.draft_passes) == (3, 0)
    assert rc.pairs_received == plain.pairs_received
    one_pass_floor = 4 * H200.all_to_all_latency_s
    assert rc.all_to_all_seconds >= plain.all_to_all_seconds + 3 * one_pass_floor
    assert rc.seconds == pytest.approx(max(rc.rank_seconds) + rc.all_to_all_seconds)
    # The idle rank serves rank 0's pass-1 pairs on its experts (and pass 2's and 3's):
    assert rc.rank_seconds[3] > plain.rank_seconds[3] > 0.0
    # (A drafting rank's own passes are in its step's seconds, priced over all E experts;
    # the round moves them to the pairs its E/N experts received, as for the layers.)
    # Without expert parallelism the ranks draft alone: the round is its slowest rank.
    assert _cost(4, ep=False).round(tokens, seconds, draft_rows).seconds == 0.03


def test_simulated_expert_parallel_ranks_speculate_in_lockstep_rounds() -> None:
    """Speculating ranks: every round runs the most passes any rank drafts (a rank
    decoding drafts 3, a rank whose requests ended pads them), each pass adding its
    all-to-all; outputs are the requests' lengths, as without drafts."""
    trace = _trace(12, out=16)
    cfg = EngineConfig(num_gpu_blocks=256, block_size=16, data_parallel_size=4,
                       enable_expert_parallel=True, num_speculative_tokens=3)  # fmt: skip
    mtp = MOONLIGHT.replace(num_nextn_predict_layers=1)
    result = simulate(trace, mtp, engine=cfg, cost_model="unit", check_invariants=True)
    assert [r.num_output_tokens for r in result.requests] == [16 + i % 5 for i in range(12)]
    meta = result.meta
    assert 0 < meta["dp_padded_draft_passes"] < 4 * meta["dp_draft_passes"]
    assert meta["dp_draft_passes"] <= 3 * meta["dp_rounds"]
    a2a_floor = H200.all_to_all_latency_s * 4 * (26 * meta["dp_rounds"] + meta["dp_draft_passes"])
    assert meta["all_to_all_seconds"] >= a2a_floor


def test_simulate_cli_serves_deepseek_v3_over_8_expert_parallel_h200s_with_mtp(
    capsys: pytest.CaptureFixture[str],
) -> None:
    """The issue's command: DeepSeek-V3 (an MTP layer shipped) with EP8 fits an H200
    (1/8 of the routed experts, the MTP layer's too, a rank); on an H100 the error
    names the fix."""
    from deepinfer.entrypoints import cli

    args = ["simulate", "--model", "deepseek-v3", "--data-parallel-size", "8",
            "--enable-expert-parallel", "--num-speculative-tokens", "3",
            "--max-requests", "16", "--no-progress"]  # fmt: skip
    assert cli.main(args) == 0
    out = capsys.readouterr().out
    assert "8 ranks with expert parallelism" in out and "MTP passes in lock-step" in out
    assert cli.main([*args, "--hardware", "h100"]) == 2
    err = capsys.readouterr().err
    assert "holding 1/8 of its routed experts" in err and "more expert-parallel ranks" in err


def test_the_ranks_place_requests_with_the_engines_data_parallel_router() -> None:
    """data_parallel_router is read, not ignored: requests a second apart find both ranks
    idle, so least-load (ties to the lowest rank) sends all to rank 0, while round-robin
    alternates."""
    reqs = [TraceRequest(f"r{i}", 1.0 * i, 64, 5) for i in range(8)]
    placed = {
        name: simulate(
            reqs,
            "deepseek-v2-lite",
            engine=EngineConfig(data_parallel_size=2, data_parallel_router=name),
        ).meta["dp_requests_per_rank"]
        for name in ("round-robin", "least-load")
    }
    assert placed == {"round-robin": [4, 4], "least-load": [8, 0]}
