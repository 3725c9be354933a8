"""benchmarks/fidelity.py end to end on the CPU with the shipped demo model (no timing
assertions: this checks the pipeline, the device run checks the numbers)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from deepinfer.config import EngineConfig
from deepinfer.step_log_file import read_step_log
from sim.cost_model import CostModel


def _bench() -> Any:
    from benchmarks import fidelity

    return fidelity


class _Cost(CostModel):
    """Host 1 s, device 2 s a step."""

    def cpu_time(self, out: Any) -> float:
        return 1.0

    def step_time(self, out: Any) -> float:
        return 2.0


def test_each_real_step_is_compared_with_the_time_that_is_its_own() -> None:
    """On a CPU under async scheduling a round applies one step and then runs the next
    inside its launch: the round's wall belonged to another step (mixed steps read
    +180% at p50, +900% at p90), so the step's own launch time is compared there."""
    bench = _bench()
    basis = {
        (a, hw, k): bench.step_basis(EngineConfig(async_scheduling=a, num_speculative_tokens=k), hw)
        for a in (False, True)
        for hw in ("cpu", "h200")
        for k in (0, 1)
    }
    assert basis[(True, "cpu", 0)] == basis[(True, "cpu", 1)] == "launch"
    assert basis[(True, "h200", 0)] == "overlap"
    assert basis[(True, "h200", 1)] == "sequential"  # (verify steps are priced elsewhere)
    assert {basis[(False, hw, k)] for hw in ("cpu", "h200") for k in (0, 1)} == {"sequential"}
    step = [("decode", [(1, 10, False)], 100.0, 2.5)]  # (kind, shape, round wall, own time)
    real_and_predicted = {
        b: bench._predicted(step, _Cost(), b)[0][2:] for b in ("launch", "overlap", "sequential")
    }
    assert real_and_predicted == {
        "launch": (2.5, 2.0),
        "overlap": (100.0, 2.0),
        "sequential": (100.0, 3.0),
    }


def test_the_device_price_is_compared_with_the_device_span_alone() -> None:
    """A step's device span (CUDA events) against the device price only, host time
    apart; steps without a span (a CPU run) are left out, not counted as zero."""
    bench = _bench()
    steps = [
        ("decode", [(1, 10, False)], 2.5, 0.0),  # priced 2.0: -20%
        ("decode", [(1, 10, False)], 1.6, 0.0),  # +25%
        ("decode", [(1, 10, False)], 2.0, 0.0),  # 0%
        ("mixed", [(1, 10, False), (64, 0, True)], None, 0.0),
    ]
    table = bench.device_errors(steps, _Cost())
    assert set(table) == {"decode"}
    assert table["decode"]["steps"] == 3
    assert abs(table["decode"]["p50"]) < 1e-12
    assert abs(table["decode"]["median_abs"] - 0.2) < 1e-12
    assert bench.device_errors([steps[-1]], _Cost()) == {}


def test_a_step_launched_on_an_idle_device_is_priced_as_the_simulator_prices_that_launch() -> None:
    """A step launched after the one before had ended (the device idle before it, or the
    first step timed) has its input preparation inside its device span: it is compared
    with `launch_cost`'s sum (the sequential time), as the simulator charges such a
    launch; an overlapped launch (its span starting within microseconds of the step
    before's end) with `step_time`: priced at step_time alone, every idle launch read
    low by its input preparation."""

    class Launching(_Cost):
        def launch_cost(self, out: Any) -> tuple[float, float]:
            return 2.0, 0.5

    bench = _bench()
    shape = [(1, 10, False)]
    steps = [
        ("decode", shape, 2.5, None),  # the first step timed: 2.5 priced
        ("decode", shape, 2.5, 0.2),  # idle 200 ms before it: 2.5
        ("decode", shape, 2.0, 2e-6),  # overlapped: 2.0
    ]
    row = bench.device_errors(steps, Launching())["decode"]
    assert row["median_abs"] == 0.0 and row["pred_sum_s"] == 7.0


def test_a_recorded_decode_of_several_tokens_is_priced_as_the_verify_step_it_was() -> None:
    """A real step's shape holds (tokens, context, is_prompt) a request; a decode of q > 1
    tokens verified q - 1 drafts (only a speculating engine schedules one), so it is
    priced with them, under a kind of its own: priced without them it took the plain
    fit's prompt-like path and read +15% on a verify-only workload."""
    from benchmarks.replay import shape_kind

    bench = _bench()
    verify = [(4, 900, False), (4, 700, False)]
    out = bench._step_output(verify + [(1, 50, False), (30, 0, True)])
    assert [len(r.draft_token_ids) for r in out.scheduled] == [3, 3, 0, 0]
    assert shape_kind(verify) == "verify"
    assert shape_kind(verify + [(30, 0, True)]) == "mixed"
    assert shape_kind([(1, 5, False)]) == "decode"
    assert shape_kind([(30, 0, True), (8, 64, True)]) == "prefill"


def test_each_kind_sums_its_real_and_priced_time() -> None:
    """Beside the per-step percentiles, a kind's total: under async scheduling a round's
    wall goes to the step it applied, so per-step errors scatter while the totals (what
    a served run's time is made of) can still agree."""
    bench = _bench()
    steps = [("decode", [(1, 10, False)], 2.5, 0.0), ("decode", [(1, 10, False)], 1.5, 0.0)]
    row = bench.device_errors(steps, _Cost())["decode"]  # priced 2.0 each
    assert row["real_sum_s"] == 4.0 and row["pred_sum_s"] == 4.0 and row["sum_err"] == 0.0


def test_an_fp8_engines_steps_are_compared_with_the_prices_of_its_fp8_profile() -> None:
    """The per-step tables price with what `simulate` prices with: an FP8 engine's FP8
    profile, not the bf16 one of the same model (its weights stream at half the bytes)."""
    bench = _bench()
    fp8 = EngineConfig(quantization="fp8", max_num_seqs=512, max_num_batched_tokens=16384)
    bf16 = EngineConfig(max_num_seqs=512, max_num_batched_tokens=16384)
    _, meta = bench.step_cost_model("moonlight-16b-a3b", "h100", None, fp8)
    assert Path(meta["profile"]).name == "moonlight-16b-a3b__fp8__h100.json"
    _, meta = bench.step_cost_model("moonlight-16b-a3b", "h100", None, bf16)
    assert Path(meta["profile"]).name == "moonlight-16b-a3b__h100.json"


def test_fidelity_pipeline_runs_on_the_demo_model(tmp_path: Path) -> None:
    bench = _bench()
    code = bench.main([
        "--out", str(tmp_path), "--model", "deepinfer-demo", "--device", "cpu",
        "--num-requests", "5", "--traces", "example.jsonl", "--rates", "1.2",
        "--num-gpu-blocks", "256", "--block-size", "16", "--max-num-batched-tokens", "512",
        "--max-num-seqs", "16", "--step-log", str(tmp_path / "logs"), "--bands", "4",
    ])  # fmt: skip
    assert code == 0
    report = json.loads((tmp_path / "fidelity.json").read_text())
    names = [w["workload"] for w in report["workloads"]]
    assert names == ["example offline", "example 120% of capacity"]
    for w in report["workloads"]:
        assert w["cost_model"]["cost_model"] == "profiled"
        assert w["cost_model"]["profile"].endswith("deepinfer-demo__cpu.json")
        assert w["requests"]["num_compared"] == 5
        for m in ("ttft", "tpot", "e2e"):
            assert {"real_p50", "sim_p50", "err_p99", "per_request_abs_err_median"} <= set(
                w["requests"][m]
            )
        assert {"decode", "prefill"} <= set(w["steps"])
    assert (tmp_path / "fidelity.png").read_bytes()[:4] == b"\x89PNG"
    # Each workload's real run as a step log (`deepinfer profile --from-log` fits them).
    logs = sorted(p.name for p in (tmp_path / "logs").iterdir())
    assert logs == ["example_120__of_capacity.jsonl", "example_offline.jsonl"]
    for name, w in zip(logs[::-1], report["workloads"]):
        log = read_step_log(tmp_path / "logs" / name)
        assert log.header["executor"] == "torch" and len(log.steps) == w["real_steps"]

    # Without a device: the simulated side again against the recorded real runs gives
    # the same request-level errors (the simulator is deterministic).
    again = tmp_path / "again"
    assert bench.main(["--real", str(tmp_path), "--out", str(again), "--bands", "4"]) == 0
    redone = {
        w["workload"]: w["requests"] for w in json.loads((again / "resimulated.json").read_text())
    }
    assert set(redone) == set(names)
    for w in report["workloads"]:
        for m in ("ttft", "tpot", "e2e"):
            assert redone[w["workload"]][m]["err_p50"] == w["requests"][m]["err_p50"]
    # ... and the same per-step errors, from the recorded step shapes.
    steps = {
        w["workload"]: w["steps"] for w in json.loads((again / "resimulated.json").read_text())
    }
    for w in report["workloads"]:
        assert steps[w["workload"]] == w["steps"]
    # ... and the same bands (seeded by the engine's seed), each real run read against them.
    bands = {
        w["workload"]: w["bands"] for w in json.loads((again / "resimulated.json").read_text())
    }
    for w in report["workloads"]:
        assert bands[w["workload"]] == w["bands"]
        assert w["bands"]["replicates"] == 4
        for key, row in w["bands"]["figures"].items():
            assert row["low"] <= row["point"] <= row["high"], key
            assert row["point"] == w["spread"][key]["sim"]
            assert row["inside"] == [row["low"] <= v <= row["high"] for v in row["real"]]


def test_bands_without_a_profile_are_refused_before_any_real_run(capsys) -> None:  # type: ignore[no-untyped-def]
    """The bands draw their noise from a profile: asked for on hardware with none shipped,
    the benchmark stops at once (not after its real runs) and says what to pass; by
    default there it runs without them and says so."""
    from benchmarks.fidelity_bands import replicates_for
    from deepinfer.model_config import load_model_config
    from sim.profiled_cost_model import profile_path

    spec, cfg = load_model_config("moonlight-16b-a3b"), EngineConfig()
    given = profile_path("moonlight-16b-a3b", "h200")
    assert replicates_for(None, spec, "h200", cfg, None) == 10  # shipped
    assert replicates_for(4, spec, "b200", cfg, given) == 4
    assert replicates_for(0, spec, "b200", cfg, None) == 0
    assert replicates_for(None, spec, "b200", cfg, None) == 0
    assert "no bands: no profile of moonlight-16b-a3b on b200" in capsys.readouterr().out
    with pytest.raises(ValueError, match="--bands 3: no profile of moonlight-16b-a3b on b200"):
        replicates_for(3, spec, "b200", cfg, None)
