"""The fidelity benchmark's held-out workloads (benchmarks/fidelity_workloads.py) and
their suite: each recipe's load, the engine options that reach both sides, the skips
with their reasons, and the real engine's repeats with their spread beside the
simulator's error. The suite runs end to end on the CPU with the shipped demo model and
a few requests (the device run checks the numbers)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from deepinfer.config import EngineConfig
from deepinfer.model_config import load_model_config
from deepinfer.records import RequestRecord

MOONLIGHT = EngineConfig(num_gpu_blocks=20000, max_num_seqs=256, max_num_batched_tokens=8192)
DEMO_ENGINE = [
    "--num-gpu-blocks", "256", "--block-size", "16", "--max-num-batched-tokens", "512",
    "--max-num-seqs", "16",
]  # fmt: skip


@pytest.fixture(scope="module")
def recipes() -> Any:
    from benchmarks import fidelity_workloads

    return fidelity_workloads


@pytest.fixture(scope="module")
def bench() -> Any:
    from benchmarks import fidelity

    return fidelity


def test_the_suite_names_every_recipe_and_refuses_unknown_ones(recipes: Any) -> None:
    names = [w.name for w in recipes.parse_workloads("held-out")]
    assert names == [w.name for w in recipes.HELD_OUT]
    assert {"own-arrivals", "saturated", "overload-2x", "small-kv", "long-context", "sync"} <= set(
        names
    )
    assert {"prefix-reuse-50", "prefix-reuse-70", "prefix-reuse-90", "spec-k3", "spec-varlen"} <= (
        set(names)
    )
    assert [w.name for w in recipes.parse_workloads("sync, offline,sync")] == ["sync", "offline"]
    with pytest.raises(ValueError, match="unknown workload 'nope'.*own-arrivals"):
        recipes.parse_workloads("offline,nope")


def test_each_load_keeps_the_sizes_and_sets_the_arrival_times(recipes: Any) -> None:
    """Own arrivals at the trace's pace or faster; sped up to a fraction of the capacity
    (mean rate); Poisson at a fraction of it; offline all at 0."""
    w = recipes.by_name(recipes.HELD_OUT)
    cut = recipes.AZURE_CODE.cut(8192)
    assert len(cut) == 200 and cut.requests[0].arrival == 0.0
    own, twice = w["own-arrivals"].load(cut, None, 0), w["own-arrivals-x2"].load(cut, None, 0)
    assert [r.arrival for r in own.requests] == [r.arrival for r in cut.requests]
    assert [2 * r.arrival for r in twice.requests] == pytest.approx(
        [r.arrival for r in cut.requests]
    )
    assert [r.prompt_len for r in twice.requests] == [r.prompt_len for r in cut.requests]
    for name, frac in (("saturated", 1.0), ("overload-2x", 2.0)):
        load = w[name].load(cut, 20.0, 0)
        assert recipes.mean_rate(load) == pytest.approx(frac * 20.0)
        assert load.name == name
    with pytest.raises(ValueError, match="needs the offline capacity"):
        w["saturated"].load(cut, None, 0)
    assert recipes.mean_rate(w["sync"].load(cut, 20.0, 0)) == pytest.approx(14.0, rel=0.2)
    assert {r.arrival for r in w["offline"].load(cut, None, 0).requests} == {0.0}


def test_prefix_blocks_are_rewritten_to_the_hit_rate_named(recipes: Any) -> None:
    """An unbounded cache would serve 50 / 70 / 90% of the prompt tokens; the trace's own
    blocks give its own rate."""
    cut = recipes.CONVERSATION.cut(8192)
    assert recipes.ideal_hit_rate(cut) < 0.3
    for hit in (0.5, 0.7, 0.9):
        load = recipes.by_name(recipes.HELD_OUT)[f"prefix-reuse-{round(100 * hit)}"].load(
            cut, None, 0
        )
        assert recipes.ideal_hit_rate(load) == pytest.approx(hit, abs=0.01)
        assert [r.prompt_len for r in load.requests] == [r.prompt_len for r in cut.requests]
    with pytest.raises(ValueError, match="out of reach"):
        recipes.with_prefix_hit(recipes.CONVERSATION.cut(8192, 3), 0.9)


def test_recipe_options_and_a_small_cache_become_the_engine(recipes: Any) -> None:
    w = recipes.by_name(recipes.HELD_OUT)
    cut = recipes.CONVERSATION.cut(8192)
    small = w["small-kv"].engine(MOONLIGHT, cut)
    need = [-(-(r.prompt_len + r.output_len) // 64) for r in cut.requests]
    assert small.num_gpu_blocks == max(-(-15 * sum(need) // 100), max(need) + 1)
    assert small.replace(num_gpu_blocks=20000) == MOONLIGHT
    assert w["sync"].engine(MOONLIGHT, cut).async_scheduling is False
    assert w["async"].engine(MOONLIGHT.replace(async_scheduling=False), cut).async_scheduling
    varlen = w["spec-varlen"].engine(MOONLIGHT, cut)
    assert (varlen.num_speculative_tokens, varlen.enable_mtp_varlen) == (3, True)
    assert w["spec-k3"].acceptance == w["spec-varlen"].acceptance == 0.8
    with pytest.raises(ValueError, match="unknown engine option"):
        recipes.Workload("x", "", recipes.AZURE_CODE, overrides={"num_gpu_block": 5})


def test_what_a_model_cannot_run_is_skipped_with_its_reason(bench: Any, recipes: Any) -> None:
    """Long prompts beyond the model's context, speculation on a model with no MTP layer
    (unless one is added, dummy weights only): skipped and said, never run otherwise.
    A load that is a fraction of the capacity gets the offline run first; workloads of
    one executor run together."""
    moonlight = load_model_config("moonlight-16b-a3b")
    names = ["saturated", "spec-k3", "sync", "long-context", "small-kv"]
    wanted = [recipes.by_name(recipes.HELD_OUT)[n] for n in names]
    planned, skipped = bench.plan(wanted, moonlight, MOONLIGHT, 8192, 5, False, True)
    why = {s["workload"]: s["reason"] for s in skipped}
    assert set(why) == {"spec-k3", "long-context"}
    assert "--add-mtp-layer" in why["spec-k3"] and "deepseek-v2-lite" in why["long-context"]
    assert [p.workload.name for p in planned] == ["offline", "saturated", "sync", "small-kv"]
    assert planned[0].capacity_source and all(len(p.trace) == 5 for p in planned)

    planned, skipped = bench.plan(wanted, moonlight, MOONLIGHT, 8192, 5, True, True)
    spec = next(p for p in planned if p.workload.name == "spec-k3")
    assert spec.mtp_added and spec.cfg.num_speculative_tokens == 3
    assert len({p.executor_key for p in planned}) == 3  # base, small cache, MTP
    _, skipped = bench.plan(wanted, moonlight, MOONLIGHT, 8192, 5, True, False)
    assert "no MTP weights" in {s["workload"]: s["reason"] for s in skipped}["spec-k3"]

    v2 = load_model_config("deepseek-v2-lite")
    planned, skipped = bench.plan(wanted[3:4], v2, MOONLIGHT, 163840, None, False, True)
    assert not skipped and min(r.prompt_len for r in planned[0].trace.requests) >= 16384


def test_the_spread_of_the_real_runs_beside_the_simulated_figure(bench: Any) -> None:
    """The simulator's error is taken against the real runs' median; a figure between
    the runs' min and max is inside their range."""
    from benchmarks.fidelity_spread import spread

    def run(ttft: float) -> list[RequestRecord]:
        return [
            RequestRecord(f"r{i}", "finished", 0.0, 10, 5, 0.0, ttft, ttft + 0.4) for i in range(4)
        ]

    s = spread([run(1.0), run(1.2), run(1.1)], run(1.15))
    assert s["runs"] == 3
    row = s["ttft_p50"]
    assert row["real"] == pytest.approx([1.0, 1.2, 1.1]) and row["real_median"] == 1.1
    assert row["err"] == pytest.approx(0.05 / 1.1) and row["inside"]
    assert row["half_range"] == pytest.approx(0.1 / 1.1)
    assert not spread([run(1.0), run(1.2)], run(1.3))["ttft_p50"]["inside"]
    assert s["tpot_p50"]["real_cv"] == pytest.approx(0.0, abs=1e-12)


def test_the_suite_runs_its_workloads_on_the_demo_model(bench: Any, tmp_path: Path) -> None:
    """Named workloads through the real engine (twice each) and the simulator: the
    recipe's engine options reach both sides, each workload reports the real runs'
    spread beside the simulator's error, and `--real` simulates the recorded requests
    again to the same errors."""
    code = bench.main([
        "--out", str(tmp_path), "--model", "deepinfer-demo", "--device", "cpu",
        "--workloads", "sync,long-context", "--num-requests", "3", "--repeats", "2",
        "--async-scheduling", "true", *DEMO_ENGINE,
    ])  # fmt: skip
    assert code == 0
    report = json.loads((tmp_path / "fidelity.json").read_text())
    assert [w["workload"] for w in report["workloads"]] == ["offline", "sync"]
    assert [s["workload"] for s in report["skipped"]] == ["long-context"]
    assert report["meta"]["repeats"] == 2
    offline, sync = report["workloads"]
    assert offline["engine"]["async_scheduling"] and offline["sim_engine"]["async_scheduling"]
    assert sync["engine"]["async_scheduling"] is False
    assert sync["sim_engine"]["async_scheduling"] is False
    assert sync["recipe"]["overrides"] == {"async_scheduling": False}
    assert sync["recipe"]["arrivals"] == "poisson" and sync["recipe"]["of_capacity"] == 0.7
    for w in report["workloads"]:
        assert w["repeats"] == 2 and len(w["repeat_requests"]) == 2
        assert w["spread"]["runs"] == 2
        for key in ("ttft_p50", "ttft_p99", "e2e_p99", "makespan", "throughput"):
            row = w["spread"][key]
            assert len(row["real"]) == 2 and row["real_min"] <= row["real_max"]
            assert {"sim", "err", "inside", "half_range", "real_cv"} <= set(row)
    records = json.loads((tmp_path / "fidelity_records.json").read_text())
    assert [len(r["real_repeats"]) for r in records] == [1, 1]
    assert [len(r["trace"]) for r in records] == [3, 3]

    again = tmp_path / "again"
    assert bench.main(["--real", str(tmp_path), "--out", str(again)]) == 0
    redone = {w["workload"]: w for w in json.loads((again / "resimulated.json").read_text())}
    for w in report["workloads"]:
        assert redone[w["workload"]]["spread"]["e2e_p50"] == w["spread"]["e2e_p50"]
        assert redone[w["workload"]]["requests"]["ttft"] == w["requests"]["ttft"]


def test_a_small_cache_and_speculation_reach_both_sides(bench: Any, recipes: Any) -> None:
    """A small KV cache is the real executor's and the simulator's; speculating, the real
    engine's drafts are accepted at the recipe's rate (benchmark-only stand-in) as the
    simulator's are, and the stand-in is gone after."""
    import executors.model_runner as runner_module
    from executors.spec_decode import verify
    from executors.torch_executor import TorchExecutor

    example = recipes.TraceSlice("example", "example.jsonl", 4)
    wanted = [
        recipes.Workload("tiny-kv", "", example, kv_fraction=0.3),
        recipes.Workload(
            "spec", "", example, "own", speed=8.0, acceptance=0.9,
            overrides={"num_speculative_tokens": 2},
        ),
    ]  # fmt: skip
    demo = load_model_config(str(Path("executors/demo/deepinfer-demo").resolve()))
    base = EngineConfig(num_gpu_blocks=256, block_size=16, max_num_batched_tokens=512)
    planned, skipped = bench.plan(wanted, demo, base, 2048, None, False, False)
    assert not skipped

    def build(cfg: EngineConfig, mtp_added: bool) -> TorchExecutor:
        assert not mtp_added  # (the demo model ships an MTP layer)
        return TorchExecutor(cfg, "deepinfer-demo", device="cpu", dtype="float32")

    model = str(Path("executors/demo/deepinfer-demo").resolve())
    results = bench.run_planned(planned, build, lambda _: model, "cpu", None, 1)
    small, spec = results
    blocks = recipes.kv_blocks(planned[0].trace, 16, 0.3)
    assert small["real_kv_blocks"] == small["sim_kv_blocks"] == blocks < 256
    assert spec["engine"]["num_speculative_tokens"] == spec["sim_engine"]["num_speculative_tokens"]
    assert spec["cost_model"]["verify_steps"] == "profiled"
    acceptance = spec["draft_acceptance"]
    assert acceptance["real"][0] > 0.6 and acceptance["sim"] > 0.6
    assert runner_module.verify is verify


def test_a_load_whose_capacity_cannot_be_measured_is_skipped(bench: Any, recipes: Any) -> None:
    """The offline run that measures a slice's capacity skipped (too few requests fit):
    the loads that are fractions of it are skipped with it, not run at another rate, and
    the suite has nothing to run."""
    w = recipes.by_name(recipes.HELD_OUT)
    moonlight = load_model_config("moonlight-16b-a3b")
    planned, skipped = bench.plan([w["sync"]], moonlight, MOONLIGHT, 8192, 1, False, True)
    assert not planned
    why = {s["workload"]: s["reason"] for s in skipped}
    assert set(why) == {"offline", "sync"} and "fewer than two" in why["offline"]
